"""NCCL's failure path, wired end to end on a CPU (issue 43, finding 4): the error ``NcclWatch`` reports
reaches the engine, which fails every later collective with an HvpsError naming the NCCL collective.
One rank, in a fresh process (the engine stops for good); on a GPU, ``tests/test_gpu.py`` aborts a real
NCCL communicator."""

import os
import subprocess
import sys
import textwrap

from conftest import REPO_ROOT


def test_a_failure_reported_by_the_nccl_watch_stops_the_engine_and_names_the_collective():
    code = textwrap.dedent("""
        import numpy as np, hvps
        from hvps.core.errors import HvpsError
        hvps.init()
        backend = hvps.runtime.state.engine().backend
        assert backend.name == "tdist", backend.name
        assert hvps.allreduce(np.ones(3), op=hvps.Sum, name="before").tolist() == [1.0, 1.0, 1.0]
        # what NcclWatch hands the engine when an NCCL Work fails or times out
        backend.watch.failed(HvpsError("hvps: NCCL allreduce 'allreduce.grad.fc' failed on rank 0: NCCL error"))
        try:
            hvps.allreduce(np.ones(3), op=hvps.Sum, name="after")
        except HvpsError as exc:
            assert "allreduce.grad.fc" in str(exc), exc
            print("raised:", exc)
        else:
            raise SystemExit("no HvpsError after the NCCL failure")
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HVPS_BACKEND="tdist")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    # the engine failed: at exit hvps ends the job (MPI's abort) rather than wait in MPI_Finalize
    assert "raised:" in proc.stdout and "allreduce.grad.fc" in proc.stdout, proc.stdout + proc.stderr
