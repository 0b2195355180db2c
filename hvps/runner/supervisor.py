"""Run the launcher, and relaunch it after an abnormal end (``--max-restarts``).

The launcher (mpirun, or srun with ``--kill-on-bad-exit``) ends the other ranks
when one exits abnormally; the supervisor then ends anything still left in the
launcher's session (SIGTERM, then SIGKILL after a grace period), waits for it,
and starts the job again with ``HVPS_RESTART_COUNT`` incremented. The script
finds its checkpoints through ``HVPS_CHECKPOINT_DIR`` and resumes from the latest.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable, Mapping, Optional

RESTART_ENV = "HVPS_RESTART_COUNT"
CHECKPOINT_ENV = "HVPS_CHECKPOINT_DIR"


def _log(message: str) -> None:
    print(f"hvpsrun: {message}", file=sys.stderr, flush=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def end_group(pgid: int, grace: float) -> None:
    """SIGTERM the process group, SIGKILL whatever is left after ``grace`` seconds."""
    if not _group_alive(pgid):
        return
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not _group_alive(pgid):
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Supervisor:
    """Start ``cmd`` in its own session; restart it on failure up to ``max_restarts`` times."""

    def __init__(self, cmd: list, env: Mapping[str, str], *, max_restarts: int = 0,
                 checkpoint_dir: Optional[str] = None, grace_seconds: float = 10.0, verbose: bool = False,
                 popen: Callable = subprocess.Popen, log: Callable = _log) -> None:
        self.cmd = list(cmd)
        self.env = dict(env)
        self.max_restarts = max_restarts
        self.checkpoint_dir = checkpoint_dir
        self.grace_seconds = grace_seconds
        self.verbose = verbose
        self.popen = popen
        self.log = log
        self.attempts: list = []  # exit status of every launch
        self._stop_signal: Optional[int] = None
        self._proc = None

    def _attempt_env(self, restart: int) -> dict:
        """Restarts count on from the caller's HVPS_RESTART_COUNT (e.g. a Slurm restart chain's link)."""
        env = dict(self.env)
        try:
            base = int(self.env.get(RESTART_ENV, "0"))
        except ValueError:
            base = 0
        env[RESTART_ENV] = str(base + restart)
        if self.checkpoint_dir:
            env[CHECKPOINT_ENV] = self.checkpoint_dir
        return env

    def _on_signal(self, signum, _frame) -> None:
        self._stop_signal = signum
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.kill(self._proc.pid, signum)  # mpirun/srun forward it to the ranks
            except ProcessLookupError:
                pass

    def run(self) -> int:
        if self.checkpoint_dir:
            os.makedirs(self.checkpoint_dir, exist_ok=True)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            restart = 0
            while True:
                if self.verbose or restart:
                    self.log(f"launch {restart + 1}/{self.max_restarts + 1}: {' '.join(self.cmd)}")
                self._proc = self.popen(self.cmd, env=self._attempt_env(restart), start_new_session=True)
                rc = self._proc.wait()
                end_group(self._proc.pid, self.grace_seconds)
                self.attempts.append(rc)
                if rc == 0 or self._stop_signal is not None:
                    return rc
                if restart >= self.max_restarts:
                    if self.max_restarts:
                        self.log(f"job failed (exit {rc}) and all {self.max_restarts} restarts are used; giving up")
                    return rc
                restart += 1
                self.log(f"job failed (exit {rc}); ended the remaining ranks; restart {restart} of "
                         f"{self.max_restarts}" + (f", resuming from {self.checkpoint_dir}" if self.checkpoint_dir
                                                   else ""))
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def exit_status(rc: int) -> int:
    """A shell-style status: 128+N for a launcher killed by signal N."""
    return 128 - rc if rc < 0 else rc
