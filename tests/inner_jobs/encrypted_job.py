"""One job of tests/test_encryption.py (MODE): a sealed collective whose chunk is damaged on one rank
(``flip``, ``replay``, ``long``: HVPS_TEST_TAMPER), or a rank started without HVPS_ENCRYPT (``mismatch``), or
``secret``: each rank's HVPS_SECRET from SECRET_<rank> (then $OUT/ok.RANK holds the bootstrap's kind and whether
it carries the secret).
Each rank writes what it raised to $OUT/err.RANK (seconds since the collective began, then the message)."""

import os
import sys
import time

import numpy as np

import hvps
from hvps.core.launchers import env_rank

mode, out = os.environ["MODE"], os.environ["OUT"]
rank = env_rank()
if mode == "mismatch" and rank == 1:
    os.environ.pop("HVPS_ENCRYPT", None)
boots = []
if mode == "secret":  # this rank's HVPS_SECRET (issue 38), and the bootstrap init builds on
    from hvps.runtime import bootstrap

    if os.environ.get(f"SECRET_{rank}"):
        os.environ["HVPS_SECRET"] = os.environ[f"SECRET_{rank}"]
    _start = bootstrap.start
    bootstrap.start = lambda comm=None: boots.append(_start(comm)) or boots[-1]
try:
    hvps.init()
except hvps.HvpsError as exc:
    with open(f"{out}/err.{rank}", "w") as f:
        f.write(f"0\n{exc}")
    sys.exit(0)
if mode == "mismatch":
    print("NO ERROR at init", flush=True)
    sys.exit(0)
if mode == "secret":
    assert hvps.allreduce(np.ones(1000), op=hvps.Sum)[0] == hvps.size()  # sealed, keys bound to the secret
    with open(f"{out}/ok.{rank}", "w") as f:
        f.write(f"{boots[0].kind} {boots[0].secret == bootstrap.read_secret()} {boots[0].secret is not None}")
    sys.exit(0)
size = hvps.size()
assert hvps.allreduce(np.ones(1000), op=hvps.Sum)[0] == size  # sealed and well
os.environ["HVPS_TEST_TAMPER"] = f"{mode}:{size - 1}:2"
began = time.monotonic()
try:
    result = hvps.allreduce(np.arange(300_000, dtype=np.float32), op=hvps.Sum, name="tampered")
    print(f"NO ERROR on rank {rank}: {result[:3]}", flush=True)
except hvps.HvpsError as exc:
    with open(f"{out}/err.{rank}", "w") as f:
        f.write(f"{time.monotonic() - began}\n{exc}")
    # the first rank to exit ends the job (MPI's abort at exit, hvps/runtime/lifecycle.py): wait until every
    # rank has written what it raised, so that a slower rank's record is not cut off (a hang guard, not a limit)
    waited = time.monotonic()
    while (time.monotonic() - waited < 60
           and not all(os.path.exists(f"{out}/err.{other}") for other in range(size))):
        time.sleep(0.05)
