"""The jobs/slurm scripts on a real Slurm: munged + slurmctld + slurmd started by the
fixture (tests/slurm_cluster.py) with a generated slurm.conf, one node (this machine).

Each test submits the project's own sbatch script with ``sbatch``, waits for it, and
checks every rank's output and the benchmark JSON."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from slurm_cluster import SlurmCluster, ensure_installed

JOBS = REPO_ROOT / "jobs" / "slurm"
TINY_BENCH = ("--batch-size 2 --image-size 32 --num-warmup-batches 1 --num-batches-per-iter 1 --num-iters 2 "
              "--threads-per-rank 1")

_REASON = ensure_installed()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"no Slurm here: {_REASON}")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
    assert all(p.poll() is not None for p in cluster.procs.values())


def _env(tmp_path: Path, **extra) -> dict:
    env = dict(os.environ)
    env.update(HVPS_REPO=str(REPO_ROOT), HVPS_PYTHON=sys.executable, RESULTS_DIR=str(tmp_path / "results"),
               HVPS_STALL_CHECK_TIME_SECONDS="60", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _preflight_ranks(text: str, size: int) -> dict:
    rows = {int(m.group(1)): m.group(0) for m in re.finditer(rf"hvps preflight: rank (\d+)/{size} [^\n]*?: ok", text)}
    return rows


def _check_benchmark(path: Path, ranks: int) -> dict:
    assert path.exists(), f"no benchmark JSON at {path}"
    result = json.loads(path.read_text())
    flat = json.dumps(result)
    assert f'"ranks": {ranks}' in flat or f'"size": {ranks}' in flat or f'"world_size": {ranks}' in flat, flat[:800]
    assert "img" in flat or "images" in flat, flat[:800]
    return result


def _run_two_rank_benchmark(slurm, tmp_path, script, *sbatch_args):
    """sbatch ``jobs/slurm/<script>`` on the tiny benchmark, wait, require success and a preflight
    line from ranks 0 and 1; returns the job id."""
    job, rc, out = slurm.sbatch(JOBS / script, *sbatch_args, f"--output={tmp_path}/job-%j.out",
                                env=_env(tmp_path, BENCH_ARGS=TINY_BENCH), cwd=REPO_ROOT)
    log = (tmp_path / f"job-{job}.out")
    text = log.read_text() if log.exists() else ""
    assert rc == 0, f"sbatch rc={rc}: {out}\n{text}\n{slurm.logs()}"
    assert sorted(_preflight_ranks(text, 2)) == [0, 1], text
    return job


@pytest.mark.timeout(600)
def test_single_node_sbatch_runs_every_rank_and_writes_json(slurm, tmp_path):
    """jobs/slurm/resnet50.sbatch: hvpsrun inside the allocation -> srun --mpi=pmix, 2 tasks."""
    job = _run_two_rank_benchmark(slurm, tmp_path, "resnet50.sbatch", "-n", "2")
    _check_benchmark(tmp_path / "results" / f"resnet50-slurm-{job}.json", 2)


@pytest.mark.timeout(600)
def test_multinode_sbatch_with_srun_pmix(slurm, tmp_path):
    """jobs/slurm/resnet50-multinode.sbatch (srun --mpi=pmix directly). This cluster has one
    node, so it runs as --nodes=1 --ntasks-per-node=2."""
    job = _run_two_rank_benchmark(slurm, tmp_path, "resnet50-multinode.sbatch", "--nodes=1", "--ntasks-per-node=2")
    _check_benchmark(tmp_path / "results" / f"resnet50-slurm-multinode-{job}.json", 2)


@pytest.mark.timeout(600)
def test_restart_chain_resumes_from_latest_checkpoint(slurm, tmp_path):
    """jobs/slurm/submit-with-restarts.sh: the first job crashes in epoch 2; the standby
    (afternotok) resumes from epoch 2 and finishes; the last standby is never run."""
    ckpt = tmp_path / "ckpt"
    train = f"{sys.executable} {REPO_ROOT / 'tests' / 'inner_jobs' / 'resume_train.py'}"
    env = slurm.env(_env(tmp_path, CKPT_DIR=ckpt, TRAIN_CMD=train, EPOCHS=4, FAIL_AT_EPOCH=2, RESTARTS=2))
    import subprocess
    proc = subprocess.run(["bash", str(JOBS / "submit-with-restarts.sh"), "-n", "2",
                           f"--output={tmp_path}/job-%j.out"], env=env, cwd=str(REPO_ROOT), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    jobs = proc.stdout.split()
    assert len(jobs) == 3
    slurm.wait_all(timeout=400)
    first = (tmp_path / f"job-{jobs[0]}.out").read_text()
    second = (tmp_path / f"job-{jobs[1]}.out").read_text()
    assert "CRASH rank 1 in epoch 2" in first, first
    assert "FINISHED" not in first
    for rank in (0, 1):
        assert f"RESUME rank {rank} restart 1 from epoch 2" in second, second
        assert f"FINISHED rank {rank} restart 1" in second, second
    assert not (tmp_path / f"job-{jobs[2]}.out").exists(), "the last standby ran although the chain had finished"
    epochs = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in ckpt.glob("epoch-*.json")}
    assert sorted(epochs) == [0, 1, 2, 3]
    assert [epochs[e]["restart"] for e in range(4)] == [0, 0, 1, 1]
    assert all(epochs[e]["sum"] == 2 * e + 1 for e in range(4))
