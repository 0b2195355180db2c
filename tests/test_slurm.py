"""The jobs/slurm scripts on a real Slurm: munged + slurmctld + slurmd started by the
fixture (tests/slurm_cluster.py) with a generated slurm.conf, one node (this machine).

Each test submits the project's own sbatch script with ``sbatch``, waits for it, and
checks every rank's output and the benchmark JSON. Inside the allocation the ranks start
with ``srun --mpi=pmix`` only when that plugin works here, else with mpirun inside the
allocation: the ``pmix`` fixture runs the same probe in a job of this cluster, and each
test checks that the job log names the path the probe implies and that the ranks really
started that way (Open MPI's --tag-output prefix marks ranks that mpirun started). The
forced srun test skips, with the probe's reason, where the pmix plugin cannot work (e.g.
Debian's slurm-wlm without libpmix)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from slurm_cluster import SlurmCluster, unusable_reason

from hvps.runner.slurm_command import PmixProbe, decide_slurm_launcher

JOBS = REPO_ROOT / "jobs" / "slurm"
TINY_BENCH = ("--batch-size 2 --image-size 32 --num-warmup-batches 1 --num-batches-per-iter 1 --num-iters 2 "
              "--threads-per-rank 1")

_REASON = unusable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"no Slurm cluster here: {_REASON}")


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
    if os.geteuid() == 0:  # the jobs run as the submitting user: root here
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


_PROBE_JOB = """#!/bin/bash
cd "$HVPS_REPO"
exec "$HVPS_PYTHON" -c 'import json, os
from hvps.runner.slurm_command import probe_pmix
result = probe_pmix(os.environ)
print(json.dumps([result.usable, result.reason]))'
"""


@pytest.fixture(scope="module")
def pmix(slurm, tmp_path_factory) -> PmixProbe:
    """What hvpsrun's probe finds inside a 2-task allocation of this cluster."""
    d = tmp_path_factory.mktemp("pmix-probe")
    (d / "probe.sh").write_text(_PROBE_JOB)
    job, rc, out = slurm.sbatch(d / "probe.sh", "-n", "2", f"--output={d}/probe-%j.out", env=_env(d),
                                cwd=REPO_ROOT, timeout=120)
    log = d / f"probe-{job}.out"
    text = log.read_text() if log.exists() else ""
    assert rc == 0, f"probe job rc={rc}: {out}\n{text}\n{slurm.logs()}"
    usable, reason = json.loads(text.strip().splitlines()[-1])
    return PmixProbe(usable, reason)


def _decisions(text: str, prog: str) -> list:
    """The launcher lines ``<prog>: Slurm job N: ...`` of a job log, without the prefix."""
    return [line[len(prog) + 2:] for line in text.splitlines() if line.startswith(f"{prog}: Slurm job ")]


def _launched_by(text: str) -> str:
    """How the preflight ranks were started: 'mpirun' when every line has Open MPI's --tag-output
    prefix (``[1,0]<stdout>: ``), 'srun' when none has, else 'mixed'."""
    tagged = re.findall(r"^\[\d+,\d+\]<stdout>:\s*hvps preflight: ", text, re.M)
    bare = re.findall(r"^hvps preflight: ", text, re.M)
    return "mpirun" if tagged and not bare else "srun" if bare and not tagged else "mixed"


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


def _run_two_rank_benchmark(slurm, tmp_path, script, *sbatch_args, **env) -> tuple:
    """sbatch ``jobs/slurm/<script>`` on the tiny benchmark, wait, require success and a preflight
    line from ranks 0 and 1; returns (job id, job log)."""
    job, rc, out = slurm.sbatch(JOBS / script, *sbatch_args, f"--output={tmp_path}/job-%j.out",
                                env=_env(tmp_path, BENCH_ARGS=TINY_BENCH, **env), cwd=REPO_ROOT)
    log = (tmp_path / f"job-{job}.out")
    text = log.read_text() if log.exists() else ""
    assert rc == 0, f"sbatch rc={rc}: {out}\n{text}\n{slurm.logs()}"
    assert sorted(_preflight_ranks(text, 2)) == [0, 1], text
    return job, text


@pytest.mark.timeout(600)
def test_single_node_sbatch_auto_launcher_follows_the_probe(slurm, pmix, tmp_path):
    """jobs/slurm/resnet50.sbatch, hvpsrun's auto launcher: srun --mpi=pmix where the probe finds the
    plugin usable, else mpirun inside the allocation; the log says which and why, once per hvpsrun."""
    job, text = _run_two_rank_benchmark(slurm, tmp_path, "resnet50.sbatch", "-n", "2")
    launcher, line = decide_slurm_launcher("auto", {"SLURM_JOB_ID": job}, lambda env: pmix)
    assert _decisions(text, "hvpsrun") == [line, line], text
    assert _launched_by(text) == launcher, text
    _check_benchmark(tmp_path / "results" / f"resnet50-slurm-{job}.json", 2)


@pytest.mark.timeout(600)
def test_single_node_sbatch_forced_mpirun_inside_allocation(slurm, tmp_path):
    """HVPSRUN_ARGS='--launcher mpirun': no probe; mpirun takes the nodes and slots from Slurm."""
    job, text = _run_two_rank_benchmark(slurm, tmp_path, "resnet50.sbatch", "-n", "2",
                                        HVPSRUN_ARGS="--launcher mpirun")
    line = f"Slurm job {job}: mpirun inside the allocation (--launcher mpirun)"
    assert _decisions(text, "hvpsrun") == [line, line], text
    assert _launched_by(text) == "mpirun", text
    _check_benchmark(tmp_path / "results" / f"resnet50-slurm-{job}.json", 2)


@pytest.mark.timeout(600)
def test_single_node_sbatch_srun_pmix(slurm, pmix, tmp_path):
    """HVPSRUN_ARGS='--launcher srun': Slurm starts the ranks and they wire up through its PMIx server."""
    if not pmix.usable:
        pytest.skip(f"srun --mpi=pmix cannot work on this machine: {pmix.reason}")
    job, text = _run_two_rank_benchmark(slurm, tmp_path, "resnet50.sbatch", "-n", "2",
                                        HVPSRUN_ARGS="--launcher srun")
    assert _decisions(text, "hvpsrun") == [f"Slurm job {job}: srun --mpi=pmix (--launcher srun; pmix not probed)"] * 2
    assert _launched_by(text) == "srun", text
    _check_benchmark(tmp_path / "results" / f"resnet50-slurm-{job}.json", 2)


@pytest.mark.timeout(600)
def test_multinode_sbatch_auto_launcher(slurm, pmix, tmp_path):
    """jobs/slurm/resnet50-multinode.sbatch starts the ranks itself (jobs/common.sh's
    slurm_launch_prefix): srun --mpi=pmix directly, or hvpsrun --launcher mpirun. This cluster
    has one node, so it runs as --nodes=1 --ntasks-per-node=2."""
    job, text = _run_two_rank_benchmark(slurm, tmp_path, "resnet50-multinode.sbatch", "--nodes=1",
                                        "--ntasks-per-node=2")
    launcher, line = decide_slurm_launcher("auto", {"SLURM_JOB_ID": job}, lambda env: pmix)
    assert _decisions(text, "hvps") == [line], text
    forced = [f"Slurm job {job}: mpirun inside the allocation (--launcher mpirun)"] * 2
    assert _decisions(text, "hvpsrun") == (forced if launcher == "mpirun" else []), text
    assert _launched_by(text) == launcher, text
    _check_benchmark(tmp_path / "results" / f"resnet50-slurm-multinode-{job}.json", 2)


@pytest.mark.timeout(600)
def test_restart_chain_resumes_from_latest_checkpoint(slurm, pmix, tmp_path):
    """jobs/slurm/submit-with-restarts.sh: the first job crashes in epoch 2; the standby
    (afternotok) resumes from epoch 2 and finishes; the last standby is never run."""
    ckpt = tmp_path / "ckpt"
    train = f"{sys.executable} {REPO_ROOT / 'tests' / 'inner_jobs' / 'resume_train.py'}"
    env = slurm.env(_env(tmp_path, CKPT_DIR=ckpt, TRAIN_CMD=train, EPOCHS=4, FAIL_AT_EPOCH=2, RESTARTS=2))
    proc = subprocess.run(["bash", str(JOBS / "submit-with-restarts.sh"), "-n", "2",
                           f"--output={tmp_path}/job-%j.out"], env=env, cwd=str(REPO_ROOT), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    jobs = proc.stdout.split()
    assert len(jobs) == 3
    slurm.wait_all(timeout=400)
    first = (tmp_path / f"job-{jobs[0]}.out").read_text()
    second = (tmp_path / f"job-{jobs[1]}.out").read_text()
    for job, log in ((jobs[0], first), (jobs[1], second)):
        line = decide_slurm_launcher("auto", {"SLURM_JOB_ID": job}, lambda env: pmix)[1]
        assert _decisions(log, "hvpsrun") == [line], log
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


@pytest.mark.timeout(600)
def test_the_docs_batch_files_run_as_printed(slurm, tmp_path):
    """Every Slurm batch file of the docs (a ``slurm`` snippet, tests/test_docs_snippets.py), as printed, run by
    a user whose venv is active, from a folder holding the README's train.py: sbatch's --nodes=1
    --ntasks-per-node=2 override its #SBATCH sizes, as a user shrinks a job to try it on one node. Every rank
    of the job trains and prints its loss."""
    from test_docs_snippets import slurm_batch_files

    batch_files, first_job = slurm_batch_files()
    assert batch_files, "the docs show no Slurm batch file (a 'slurm' snippet): running.md had one"
    (tmp_path / "train.py").write_text(first_job)
    venv = str(Path(sys.executable).parent)
    for i, (where, text) in enumerate(batch_files):
        script = tmp_path / f"docs-{i}.sbatch"
        script.write_text(text)
        job, rc, out = slurm.sbatch(script, "--nodes=1", "--ntasks-per-node=2", f"--output={tmp_path}/docs-%j.out",
                                    env=_env(tmp_path, PATH=f"{venv}:{os.environ.get('PATH', '')}"), cwd=tmp_path)
        log = tmp_path / f"docs-{job}.out"
        text = log.read_text() if log.exists() else ""
        assert rc == 0, f"{where}: sbatch rc={rc}: {out}\n{text}\n{slurm.logs()}"
        assert sorted(re.findall(r"rank (\d) of 2: loss", text)) == ["0", "1"], f"{where}:\n{text}\n{out}\n{sorted(tmp_path.iterdir())}"
