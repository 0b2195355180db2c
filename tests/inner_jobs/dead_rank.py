"""One rank of tests/test_dead_ranks.py's jobs: a rank that dies or stops, and what the others see.

``MODE=kill``: every rank runs allreduces (a large one, so the ranks are inside the data plane);
rank ``VICTIM`` SIGKILLs itself once its large allreduce has started (or, when that one finished
first on a loaded machine, before the next collective), after writing the time to ``$OUT/killed``.
Every other rank catches the HvpsError, writes ``time\\nmessage`` to ``$OUT/err.R``, waits
(briefly) for the other survivors' files, and exits 3.

``MODE=stopworker``: rank ``VICTIM`` SIGSTOPs itself before an allreduce; every other rank writes what it
raised to ``$OUT/err.R`` (as ``kill``), then ends the job (issue 38: the stopped rank must be the one named).
With ``SET=1`` (and ``INSIDE=1``) the large allreduce runs on a process set of every rank but rank 0, which
stays out of it (idle: it hears of the stall only from a worker's report) until rank 1 has raised, and then
submits an allreduce.

``MODE=stop``: after a barrier, rank 0 SIGSTOPs itself outside any collective (writing the time to
``$OUT/stopped``); the others then start an allreduce and let its HvpsError end the script
uncaught, as a training script would.
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

import hvps

OUT = Path(os.environ["OUT"])
MODE = os.environ["MODE"]

hvps.init()
rank, size = hvps.rank(), hvps.size()
segment = getattr(hvps.runtime.state._state.engine.backend, "segment", None)  # HVPS_SHM=1
if segment is not None and rank == 0:
    (OUT / "segment").write_text(segment.path)
small = np.ones(16, np.float32)
large = np.ones(int(os.environ.get("ELEMENTS", str(16 << 20))), np.float32)  # 64 MiB: long enough to be inside it


_dying = threading.Lock()  # taken once and never released: one thread writes the time and kills


def kill_self_now() -> None:
    """Record the time and SIGKILL this process."""
    _dying.acquire()
    (OUT / "killed").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def kill_self_soon(handle) -> None:
    """SIGKILL this process as soon as ``handle``'s collective has started moving data."""
    def run():
        while handle._started is None and not handle.poll():
            time.sleep(0.001)
        time.sleep(0.05)
        kill_self_now()

    threading.Thread(target=run, daemon=True).start()


if MODE == "kill":
    victim = int(os.environ["VICTIM"])
    try:
        for step in range(3):
            hvps.allreduce(small, name=f"small.{step}", op=hvps.Sum)
        hvps.barrier()
        handle = hvps.allreduce_async(large, name="large", op=hvps.Sum)
        if rank == victim:
            kill_self_soon(handle)
        handle.wait()
        if rank == victim:
            kill_self_now()  # a loaded machine finished the large one first: die before the next one
        hvps.allreduce(small, name="after", op=hvps.Sum)
        print(f"rank {rank}: NO ERROR", flush=True)
    except hvps.HvpsError as exc:
        (OUT / f"err.{rank}").write_text(f"{time.time()!r}\n{exc}")
        print(f"rank {rank} raised: {exc}", flush=True)
    # Let every survivor record what it saw before the first one's exit aborts the job.
    deadline = time.monotonic() + 10
    survivors = [r for r in range(size) if r != victim]
    while time.monotonic() < deadline and not all((OUT / f"err.{r}").exists() for r in survivors):
        time.sleep(0.02)
    sys.exit(3)

if MODE == "stop":
    hvps.allreduce(small, name="warm", op=hvps.Sum)
    hvps.barrier()
    if rank == 0:
        (OUT / "stopped").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(600)
    time.sleep(0.2)
    hvps.allreduce(small, name="after.stop", op=hvps.Sum)  # raises: rank 0 never answers
    print(f"rank {rank}: NO ERROR", flush=True)

if MODE == "stopworker":
    victim = int(os.environ["VICTIM"])
    hvps.allreduce(small, name="warm", op=hvps.Sum)
    hvps.barrier()
    inside = os.environ.get("INSIDE") == "1"  # stop once the large allreduce moves data, not before it
    if rank == victim and not inside:
        (OUT / "stopped").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(600)
    workers = hvps.add_process_set(list(range(1, size))) if os.environ.get("SET") == "1" else None
    try:
        if workers is not None and rank == 0:  # idle until rank 1 raised, then a collective of its own
            deadline = time.monotonic() + 30
            while not (OUT / "err.1").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        elif inside:
            handle = hvps.allreduce_async(large, name="large", op=hvps.Sum, process_set=workers)
            if rank == victim:
                while handle._started is None and not handle.poll():
                    time.sleep(0.001)
                time.sleep(float(os.environ.get("STOP_AFTER", "0.05")))  # seconds into the transfer
                (OUT / "stopped").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(600)
            handle.wait()
        hvps.allreduce(small, name="after.stop", op=hvps.Sum)
        print(f"rank {rank}: NO ERROR", flush=True)
    except hvps.HvpsError as exc:
        (OUT / f"err.{rank}").write_text(f"{time.time()!r}\n{exc}")
        print(f"rank {rank} raised: {exc}", flush=True)
    deadline = time.monotonic() + 10
    survivors = [r for r in range(size) if r != victim]
    while time.monotonic() < deadline and not all((OUT / f"err.{r}").exists() for r in survivors):
        time.sleep(0.02)
    sys.exit(3)
