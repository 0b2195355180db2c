"""Fuzz checkpoint reading: mutated real checkpoint files through read_header, read and
verify. Anything but a CheckpointError (or a clean load) is a crash.

    python tests/fuzz/fuzz_checkpoint.py CORPUS_DIR -max_total_time=30     (atheris / libFuzzer)
    python tests/fuzz/fuzz_checkpoint.py --random CORPUS_DIR SECONDS        (byte mutation, no atheris)
    python tests/fuzz/fuzz_checkpoint.py --replay DEADLINE FILE...          (through the helper)
    python tests/fuzz/fuzz_checkpoint.py --inprocess FILE                   (one input, as the fuzzer ran it)

Fuzzing inspects metadata in this process (HVPS_CHECKPOINT_INSPECT_TIMEOUT=0), so that
atheris sees the code it runs; a libhdf5 hang, memory blow-up or segfault then shows as a
libFuzzer timeout, OOM or crash, which ``--replay`` feeds through the real path (the helper
process with a deadline and a memory cap): each must end in a CheckpointError
(``replay: NAME error``).

Prints ``fuzz: N inputs, C crashes`` at the end (atheris prints its own ``Done N runs``).
"""

import os
import random
import sys
import tempfile
import time

_PATH = os.path.join(tempfile.mkdtemp(prefix="hvps-fuzz-"), "ckpt-epoch-000001.h5")


def one_input(data: bytes):
    """Write ``data`` as a checkpoint file and read it every way hvps does."""
    from hvps.checkpoint.format import CheckpointError, Reader
    from hvps.checkpoint.inspect import read_header

    with open(_PATH, "wb") as f:
        f.write(data)
    try:
        reader = Reader(_PATH, read_header(_PATH))
        reader.read()
        reader.verify()
    except CheckpointError as exc:
        return str(exc)
    return None


def _mutate(rnd: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rnd.randint(1, 8)):
        choice, at = rnd.random(), rnd.randrange(len(out))
        if choice < 0.6:
            out[at] = rnd.randrange(256)
        elif choice < 0.8:
            out[at:at + 8] = rnd.randbytes(8)
        elif choice < 0.9:
            del out[at:at + rnd.randint(1, 64)]
        else:
            out[at:at] = rnd.randbytes(rnd.randint(1, 64))
    return bytes(out)


def random_mode(corpus: str, seconds: float, seed: int = 0) -> int:
    seeds = [open(os.path.join(corpus, n), "rb").read() for n in sorted(os.listdir(corpus))]
    rnd, runs, crashes = random.Random(seed), 0, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        data = _mutate(rnd, rnd.choice(seeds))
        runs += 1
        try:
            one_input(data)
        except Exception as exc:  # noqa: BLE001 - a crash is what we look for
            crashes += 1
            print(f"crash: {type(exc).__name__}: {exc}", file=sys.stderr)
    print(f"fuzz: {runs} inputs, {crashes} crashes")
    return 1 if crashes else 0


def atheris_mode(argv: list) -> None:
    import atheris

    with atheris.instrument_imports(include=["hvps"]):
        import hvps.checkpoint.format  # noqa: F401
        import hvps.checkpoint.safety  # noqa: F401
    # libFuzzer's -fork mode re-runs argv[0]: an executable wrapper when one is given
    atheris.Setup([os.environ.get("HVPS_FUZZ_SELF", argv[0])] + argv[1:], one_input)
    atheris.Fuzz()


def replay(deadline: str, files: list) -> int:
    """Read each file the way load() does, helper included; 1 if any escapes as a crash."""
    os.environ["HVPS_CHECKPOINT_INSPECT_TIMEOUT"] = deadline
    crashes = 0
    for name in files:
        try:
            with open(name, "rb") as f:
                error = one_input(f.read())
            outcome = "ok" if error is None else "error " + error.replace("\n", " ")[:300]
        except Exception as exc:  # noqa: BLE001 - a crash is what we look for
            crashes += 1
            outcome = f"crash {type(exc).__name__}: {exc}"
        print(f"replay: {os.path.basename(name)} {outcome}", flush=True)
    return 1 if crashes else 0


if __name__ == "__main__":
    if sys.argv[1] == "--replay":
        sys.exit(replay(sys.argv[2], sys.argv[3:]))
    os.environ["HVPS_CHECKPOINT_INSPECT_TIMEOUT"] = "0"
    if sys.argv[1] == "--inprocess":  # a Python exception escapes (exit 1); a libhdf5 crash kills it
        with open(sys.argv[2], "rb") as f:
            print(f"inprocess: {one_input(f.read())}")
        sys.exit(0)
    if sys.argv[1] == "--random":
        sys.exit(random_mode(sys.argv[2], float(sys.argv[3])))
    atheris_mode(sys.argv)
