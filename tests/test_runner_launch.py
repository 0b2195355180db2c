"""hvpsrun end to end on this machine: bad input exits 2 with one line, --dry-run,
--check-build, a real 2-rank launch, and --max-restarts resuming from a checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from hvps.runner.supervisor import Supervisor

HVPSRUN = [sys.executable, "-m", "hvps.runner.launch"]
INNER = REPO_ROOT / "tests" / "inner_jobs"


def run(args, env=None, timeout=120, cwd=REPO_ROOT):
    full = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HVPS_STALL_CHECK_TIME_SECONDS="20")
    full.update(env or {})
    return subprocess.run(HVPSRUN + args, capture_output=True, text=True, env=full, timeout=timeout, cwd=str(cwd))


@pytest.mark.parametrize("args,needle", [
    (["-np", "2", "-H", "no-such-host.invalid:2", sys.executable, "-c", "0"], "unknown host 'no-such-host.invalid'"),
    (["-np", "3", "-H", "localhost:2", sys.executable, "-c", "0"], "more than the 2 slots"),
    (["-np", "2", sys.executable, "missing_script.py"], "script 'missing_script.py' not found"),
    (["-np", "2", "--mpirun", "no-such-mpirun", sys.executable, "-c", "0"], "no MPI found"),
    (["-np", "2", "no-such-program-xyz"], "not on PATH"),
    (["-np", "2"], "no command given"),
])
def test_bad_input_one_line_exit_2(args, needle):
    proc = run(args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hvpsrun: error: ") and needle in lines[0], proc.stderr


def test_dry_run_prints_command():
    proc = run(["--dry-run", "-np", "2", "--fusion-threshold-mb", "1", sys.executable, "-c", "0"],
               env={"SLURM_JOB_ID": ""})
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert "-bind-to none -map-by slot" in line and "-x HVPS_FUSION_THRESHOLD=1048576" in line


def test_check_build_lists_components():
    proc = run(["--check-build"])
    assert proc.returncode == 0, proc.stderr
    for needle in ("Available Frameworks", "PyTorch", "TensorFlow", "[X] MPI", "NCCL", "mpirun"):
        assert needle in proc.stdout, proc.stdout


@pytest.mark.timeout(300)
def test_real_launch_two_ranks():
    code = ("import os, hvps, numpy as np; hvps.init(); "
            "s = hvps.allreduce(np.array([hvps.rank() + 1.0]), op=hvps.Sum); "
            "print(f\"RANK {hvps.rank()} {hvps.size()} {int(s[0])} {os.environ['HVPS_CYCLE_TIME']} "
            "{os.environ['OMP_NUM_THREADS']}\")")
    proc = run(["-np", "2", "--cycle-time-ms", "2", sys.executable, "-c", code], env={"OMP_NUM_THREADS": ""})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cores = max(1, (os.cpu_count() or 1) // 2)
    for rank in (0, 1):
        assert f"RANK {rank} 2 3 2 {cores}" in proc.stdout, proc.stdout


@pytest.mark.timeout(300)
def test_max_restarts_resumes_from_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = run(["-np", "2", "--max-restarts", "2", "--checkpoint-dir", str(ckpt), "--stall-check-time-seconds",
                "20", sys.executable, str(INNER / "resume_train.py")],
               env={"EPOCHS": "4", "FAIL_AT_EPOCH": "2"}, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "CRASH rank 1 in epoch 2" in out
    assert "restart 1 of 2" in out
    assert "RESUME rank 0 restart 1 from epoch 2" in out and "RESUME rank 1 restart 1 from epoch 2" in out
    assert sorted(p.name for p in ckpt.glob("epoch-*.json")) == [f"epoch-{e}.json" for e in range(4)]


def test_supervisor_gives_up_after_max_restarts(tmp_path):
    script = tmp_path / "fail.sh"
    script.write_text('#!/bin/sh\necho "try $HVPS_RESTART_COUNT $HVPS_CHECKPOINT_DIR" >> "$0.log"\nexit 5\n')
    script.chmod(0o755)
    logs = []
    sup = Supervisor([str(script)], {"PATH": os.environ["PATH"], "HVPS_RESTART_COUNT": "3"}, max_restarts=2,
                     checkpoint_dir=str(tmp_path / "c"), grace_seconds=1, log=logs.append)
    assert sup.run() == 5
    assert sup.attempts == [5, 5, 5]
    assert Path(f"{script}.log").read_text().split("\n")[:3] == [
        f"try {n} {tmp_path / 'c'}" for n in (3, 4, 5)]
    assert any("giving up" in line for line in logs)
