"""Inner script for the link-cut tests: allreduce in a loop until hvps raises.

Env: MH_ELEMENTS (float32 elements per allreduce), MH_GAP (seconds between steps).
Prints ``SUBMIT rank i t`` before and ``STEP rank i t`` after each allreduce, and
``HVPS_ERROR rank t message`` when hvps raises; then waits a moment (so mpirun's
abort does not cut off the other survivors' messages) and exits 3.
"""
import os
import sys
import time

import numpy as np

import hvps


def say(line: str) -> None:
    """One write per line, so mpirun --tag-output keeps the line whole."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


hvps.init()
rank = hvps.rank()
elements = int(os.environ.get("MH_ELEMENTS", "1024"))
gap = float(os.environ.get("MH_GAP", "0.5"))
data = np.ones(elements, dtype=np.float32)
step = 0
try:
    while True:
        say(f"SUBMIT {rank} {step} {time.time():.3f}")
        out = hvps.allreduce(data, op=hvps.Sum, name=f"step{step}")
        if out[0] != hvps.size():
            say(f"WRONG {rank} {step} {out[0]}")
            os._exit(4)
        say(f"STEP {rank} {step} {time.time():.3f}")
        step += 1
        time.sleep(gap)
except hvps.HvpsError as exc:
    say(f"HVPS_ERROR {rank} {time.time():.3f} {exc}")
    time.sleep(1.0)
    os._exit(3)
