"""The sealed data plane's streams (backends/sealed.py: the allgather sent chunk by chunk as the reduce-scatter
folds, each ring step as the one before opens, every chunk in MPI pieces): real 2- and 3-rank jobs, every pair
sealed, whose allreduce (in place and not), allgather and broadcast give the bits of the fold in rank order."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, _base_env, mpi_launcher

from hvps.runner.mpi_command import build_mpirun_command, launch_environment
from hvps.runner.settings import LaunchSettings

pytest.importorskip("cryptography")

SCRIPT = Path(__file__).resolve().parent / "inner_jobs" / "sealed_stream_job.py"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_sealed_streams_give_the_bits_of_the_fold_in_rank_order(np_):
    env = _base_env(dict(HVPS_ENCRYPT="all", HVPS_RING_CHUNK_BYTES="100003", HVPS_STALL_CHECK_TIME_SECONDS="30"))
    settings = LaunchSettings(command=(sys.executable, str(SCRIPT)), num_proc=np_)
    cmd = build_mpirun_command(settings, env, mpi=mpi_launcher(), hosts=[])
    env = launch_environment(settings, env, np_, [], os.cpu_count() or 1)
    proc = subprocess.run(cmd, cwd=str(REPO_ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=100)
    out = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, out
    for rank in range(np_):
        assert f"SEALED STREAM OK rank {rank}" in out, out
