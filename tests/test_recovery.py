"""End-to-end recovery (issue 6): under ``hvpsrun -np 2 --max-restarts 2 --checkpoint-dir``,
rank 1 of a deterministic training job is SIGKILLed by this test halfway through epoch 3;
the supervisor relaunches the job, which resumes from the checkpoint of epoch 2 and
finishes, with final parameters and momentum buffers bit for bit equal to those of an
uninterrupted run with the same seed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO_ROOT

from hvps.checkpoint.manager import CheckpointManager

HVPSRUN = [sys.executable, "-m", "hvps.runner.launch"]
SCRIPT = REPO_ROOT / "tests" / "inner_jobs" / "ckpt_train.py"
EPOCHS, KILL_EPOCH = 5, 3


def launch(tmp: Path, name: str, kill: bool) -> tuple:
    """Start the job; when ``kill``, SIGKILL rank 1 once it reports its pid mid-epoch.
    Returns (returncode, output, killed pid or None)."""
    ckpt, out = tmp / f"{name}-ckpt", tmp / f"{name}.npz"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HVPS_STALL_CHECK_TIME_SECONDS="30", PYTHONUNBUFFERED="1",
               EPOCHS=str(EPOCHS), STEPS="6", OUT=str(out), OMPI_MCA_mpi_yield_when_idle="1")
    if kill:
        env.update(KILL_EPOCH=str(KILL_EPOCH), KILL_DIR=str(tmp))
    cmd = HVPSRUN + ["-np", "2", "--max-restarts", "2", "--checkpoint-dir", str(ckpt), sys.executable, str(SCRIPT)]
    log = tmp / f"{name}.log"
    killed = None
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=str(REPO_ROOT),
                                start_new_session=True)
        try:
            if kill:
                pidfile = tmp / "rank1.pid"
                deadline = time.monotonic() + 120
                while not pidfile.exists() and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                if pidfile.exists():
                    killed = int(pidfile.read_text())
                    os.kill(killed, signal.SIGKILL)
            proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return proc.returncode, log.read_text(), killed


@pytest.mark.timeout(400)
def test_sigkill_mid_epoch_recovers_bit_for_bit(tmp_path):
    rc, out, killed = launch(tmp_path, "crash", kill=True)
    assert killed is not None, "rank 1 never reported its pid mid-epoch:\n" + out
    assert rc == 0, out
    assert f"WAITING rank 1 pid {killed} in epoch {KILL_EPOCH} step 3" in out, out
    assert "NOT KILLED" not in out
    assert "restart 1 of 2" in out, out
    # The first launch saved epochs 0..2 and then lost only the epoch it was in:
    for e in range(KILL_EPOCH):
        assert f"EPOCH rank 0 restart 0 epoch {e} saved" in out
    assert f"EPOCH rank 0 restart 0 epoch {KILL_EPOCH} saved" not in out
    for r in (0, 1):
        assert f"RESUME rank {r} restart 0 from epoch 0" in out, out
        assert f"RESUME rank {r} restart 1 from epoch {KILL_EPOCH}" in out, out
        assert f"FINISHED rank {r} restart 1" in out, out
    assert "restart 2 of 2" not in out and "RESUME rank 0 restart 2" not in out, "needed a second restart:\n" + out
    mgr = CheckpointManager(tmp_path / "crash-ckpt")
    assert [v.epoch for v in mgr.list()] == [EPOCHS - 2, EPOCHS - 1]
    assert mgr.verify(EPOCHS - 1).attrs["world_size"] == 2

    rc, ref_out, _ = launch(tmp_path, "reference", kill=False)
    assert rc == 0, ref_out
    assert "restart 1 of" not in ref_out and "RESUME rank 0 restart 0 from epoch 0" in ref_out

    got, want = np.load(tmp_path / "crash.npz"), np.load(tmp_path / "reference.npz")
    assert sorted(got.files) == sorted(want.files) and any(k.startswith("momentum.") for k in got.files)
    for key in want.files:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
        assert got[key].tobytes() == want[key].tobytes(), f"{key} differs after recovery"
    # Training really moved the weights (the comparison is not between two initial states).
    assert np.abs(got["momentum.0"]).sum() > 0


@pytest.mark.unit
def test_harness_checkpoint_flags(monkeypatch, capsys):
    """The ResNet-50 harness's --epochs/--checkpoint-dir/--resume: defaults, the
    HVPS_CHECKPOINT_DIR fallback that hvpsrun --checkpoint-dir sets, and the modes they refuse."""
    from benchmarks.pytorch_synthetic_benchmark import parse_args

    assert parse_args([]).epochs is None and parse_args([]).checkpoint_dir is None
    args = parse_args(["--checkpoint-dir", "/x"])
    assert args.epochs == 1 and not args.resume
    monkeypatch.setenv("HVPS_CHECKPOINT_DIR", "/from/env")
    args = parse_args(["--epochs", "4", "--resume"])
    assert (args.epochs, args.checkpoint_dir, args.resume) == (4, "/from/env", True)
    monkeypatch.delenv("HVPS_CHECKPOINT_DIR")
    for bad, needle in ((["--resume"], "--resume needs --checkpoint-dir"),
                        (["--no-comm", "--epochs", "2"], "plain distributed mode only"),
                        (["--compare-no-comm", "--checkpoint-dir", "/x"], "plain distributed mode only"),
                        (["--epochs", "0"], "--epochs must be >= 1")):
        with pytest.raises(SystemExit) as exc:
            parse_args(bad)
        assert exc.value.code == 2 and needle in capsys.readouterr().err, bad
