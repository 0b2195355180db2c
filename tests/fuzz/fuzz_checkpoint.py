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
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402

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


if __name__ == "__main__":
    if sys.argv[1] == "--replay":
        sys.exit(driver.replay(one_input, sys.argv[2], sys.argv[3:]))
    os.environ["HVPS_CHECKPOINT_INSPECT_TIMEOUT"] = "0"
    if sys.argv[1] == "--inprocess":
        driver.in_process(one_input, sys.argv[2])
        sys.exit(0)
    if sys.argv[1] == "--random":
        sys.exit(driver.random_mode(one_input, sys.argv[2], float(sys.argv[3])))
    driver.atheris_mode(one_input, sys.argv, ["hvps.checkpoint.format", "hvps.checkpoint.safety"])
