"""What every fuzzer here shares: byte mutation, the random and atheris modes, and replaying what
libFuzzer found through the real path. A fuzzer gives ``one_input(data) -> error text or None``
(a CheckpointError's text, or None for a clean load); anything it raises is a crash."""

import os
import random
import sys
import time


def mutate(rnd: random.Random, data: bytes, keep: int = 0) -> bytes:
    """``data`` with 1-8 random edits (bytes set, overwritten, deleted, inserted) after its first ``keep`` bytes."""
    out = bytearray(data)
    for _ in range(rnd.randint(1, 8)):
        choice, at = rnd.random(), rnd.randrange(keep, len(out))
        if choice < 0.6:
            out[at] = rnd.randrange(256)
        elif choice < 0.8:
            out[at:at + 8] = rnd.randbytes(8)
        elif choice < 0.9:
            del out[at:at + rnd.randint(1, 64)]
        else:
            out[at:at] = rnd.randbytes(rnd.randint(1, 64))
    return bytes(out)


def random_mode(one_input, corpus: str, seconds: float, seed: int = 0, keep: int = 0) -> int:
    """Mutated corpus files for ``seconds``; prints ``fuzz: N inputs, C crashes``; 1 if any crashed."""
    inputs = [open(os.path.join(corpus, n), "rb").read() for n in sorted(os.listdir(corpus))]
    rnd, runs, crashes = random.Random(seed), 0, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        data = mutate(rnd, rnd.choice(inputs), keep)
        runs += 1
        try:
            one_input(data)
        except Exception as exc:  # noqa: BLE001 - a crash is what we look for
            crashes += 1
            print(f"crash: {type(exc).__name__}: {exc}", file=sys.stderr)
    print(f"fuzz: {runs} inputs, {crashes} crashes")
    return 1 if crashes else 0


def atheris_mode(one_input, argv: list, modules: list) -> None:
    """libFuzzer through atheris, with ``modules`` (and what they import of hvps) instrumented."""
    import importlib

    import atheris

    with atheris.instrument_imports(include=["hvps"]):
        for module in modules:
            importlib.import_module(module)
    # libFuzzer's -fork mode re-runs argv[0]: an executable wrapper when one is given
    atheris.Setup([os.environ.get("HVPS_FUZZ_SELF", argv[0])] + argv[1:], one_input)
    atheris.Fuzz()


def replay(one_input, deadline: str, files: list) -> int:
    """Each input the way a load checks it, inspection helper included; 1 if any escapes as a crash."""
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


def in_process(one_input, path: str) -> None:
    """One input as the fuzzer ran it: a Python exception escapes (exit 1); a libhdf5 crash kills the process."""
    with open(path, "rb") as f:
        print(f"inprocess: {one_input(f.read())}")
