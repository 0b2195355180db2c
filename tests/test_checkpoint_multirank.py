"""Run tests/mpi/mpi_checkpoint.py under mpirun with 2 and 3 ranks; every rank must pass
every test (nothing failed, errored or skipped), in the jobs shared with the other small multi-rank
modules (conftest.SHARED_JOBS). And issue 39's re-sharding target between real jobs: a checkpoint saved
by a 3-rank job continues bit-identically in a 4-rank job, a 2-rank job and one process
(tests/inner_jobs/reshard_job.py)."""

import os
import signal
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, SHARED_JOBS, _base_env, case, mpirun_argv

NPS = [2, 3]
RESHARD_JOB = REPO_ROOT / "tests" / "inner_jobs" / "reshard_job.py"


@pytest.mark.inner_cases(cases=lambda np_: [(np_, case("checkpoint", "mpi_checkpoint.py", timeout=400))],
                         share=SHARED_JOBS)
@pytest.mark.parametrize("np_", NPS, ids=[f"np{n}" for n in NPS])
def test_checkpoint_multirank(np_, inner_results):
    inner_results["checkpoint"].assert_all_passed(min_passed=5)


@pytest.mark.timeout(900)
def test_sharded_checkpoints_saved_at_three_ranks_continue_bit_identically_at_four_two_and_one(tmp_path):
    """Stage 1-2 and stage 3 Adam runs saved by a real 3-rank job load in a real 4-rank job (blocks that straddle
    the saved shards), a real 2-rank job and one process that never starts hvps (an unsharded model and a plain
    Adam), and each continues bit for bit as the uninterrupted one-process run (the job checks every rank)."""
    for mode, np_ in (("save", 3), ("load", 4), ("load", 2), ("plain", 1)):
        argv = [sys.executable, str(RESHARD_JOB), mode, str(tmp_path)]
        cmd, env = (argv, _base_env(None)) if mode == "plain" else mpirun_argv(np_, argv, _base_env(None))
        proc = subprocess.Popen(cmd, cwd=str(REPO_ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            out = proc.communicate(timeout=200)[0].decode(errors="replace")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode == 0, f"the {mode} job at {np_} ranks failed:\n{out}"
        for rank in range(np_):
            assert f"RESHARD OK {mode} rank {rank} of {np_}" in out, out
