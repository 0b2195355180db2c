"""A real single-node Slurm cluster for tests: munged, slurmctld and slurmd from Debian's
``slurm-wlm`` and ``munge``, with a generated ``slurm.conf`` in a private directory.

Everything is private to one instance: munged gets its own key and socket, the
daemons their own ports, state and spool directories, so it neither needs nor touches
a system Slurm. ``stop()`` ends only the daemons ``start()`` started, by pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                   "BOOT_FAIL", "DEADLINE"}


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}")
                                       if os.path.exists(p)), None)


def ensure_installed() -> Optional[str]:
    """Install slurm-wlm and munge with apt-get when missing; the reason they are unusable, or None."""
    if all(_which(d) for d in DAEMONS) and _which("sbatch"):
        return None
    if os.geteuid() != 0:
        return "slurm-wlm and munge are not installed and installing them needs root"
    if shutil.which("apt-get") is None:
        return "slurm-wlm and munge are not installed and there is no apt-get"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            return f"'{' '.join(cmd)}' failed: {proc.stderr.strip()[-300:]}"
    missing = [d for d in (*DAEMONS, "sbatch") if not _which(d)]
    return f"installed {PACKAGES} but {missing} are still missing" if missing else None


def unusable_reason() -> Optional[str]:
    """Why this cluster cannot run here (installing the packages first when missing), or None."""
    if os.geteuid() != 0:
        return "the test cluster's daemons run as root (SlurmUser=root) and this user is not root"
    return ensure_installed()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mem_mib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024 // 2
    return 1024


class SlurmCluster:
    """One node (this machine), one partition ``hvps``."""

    def __init__(self, workdir: Path, cpus: Optional[int] = None) -> None:
        self.dir = Path(workdir)
        self.cpus = cpus or os.cpu_count() or 1
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.socket"
        self.procs: dict = {}

    # -- environment for clients (sbatch, squeue, scontrol) ---------------------------
    def env(self, base: Optional[dict] = None) -> dict:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        for key in [k for k in env if k.startswith(("SLURM_JOB", "SLURM_NTASKS", "SBATCH_"))]:
            del env[key]  # never inherit an outer allocation
        return env

    def _write_conf(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "log", "munge"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        ctl_port, d_port = _free_port(), _free_port()
        self.conf.write_text("\n".join([
            "ClusterName=hvpstest",
            f"SlurmctldHost={self.node}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={ctl_port}",
            f"SlurmdPort={d_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "ReturnToService=2",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=600",
            "SlurmdParameters=config_overrides",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={_mem_mib()} State=UNKNOWN",
            f"PartitionName=hvps Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
            "",
        ]))

    # -- lifecycle --------------------------------------------------------------------
    def _spawn(self, name: str, argv: list) -> None:
        log = open(self.dir / "log" / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                            start_new_session=True)
        log.close()

    def start(self, timeout: float = 60) -> "SlurmCluster":
        self._write_conf()
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        os.chmod(self.dir / "munge", 0o700)
        self._spawn("munged", [_which("munged"), "-F", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={self.dir / 'munge' / 'munged.pid'}",
                               f"--log-file={self.dir / 'log' / 'munged.log'}",
                               f"--seed-file={self.dir / 'munge' / 'munged.seed'}"])
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged did not create its socket")
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-f", str(self.conf)])
        self._spawn("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf)])
        self._wait(self._node_idle, timeout, f"node {self.node} did not become idle")
        return self

    def _wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.logs()}")
            if predicate():
                return
            time.sleep(0.3)
        raise RuntimeError(f"{what} within {timeout:g} s:\n{self.logs()}")

    def _node_idle(self) -> bool:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env(), capture_output=True, text=True)
        return proc.returncode == 0 and proc.stdout.strip().startswith("idle")

    def logs(self, tail: int = 3000) -> str:
        out = []
        for f in sorted((self.dir / "log").glob("*")):
            text = f.read_text(errors="replace")
            out.append(f"--- {f.name}\n{text[-tail:]}")
        return "\n".join(out)

    def stop(self, grace: float = 10) -> None:
        """End the daemons start() started (slurmd first), by pid: SIGTERM, then SIGKILL."""
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- jobs ---------------------------------------------------------------------------
    def sbatch(self, script: Path, *args: str, env: Optional[dict] = None, cwd: Optional[Path] = None,
               timeout: float = 600) -> tuple:
        """Submit and wait for the job to end; returns (job id, exit code, sbatch output).

        Polls ``scontrol`` every 0.3 s rather than using ``sbatch --wait``, whose polling
        interval grows to tens of seconds and so adds up to half a minute to every job.
        """
        proc = subprocess.run(["sbatch", "--parsable", *args, str(script)], env=self.env(env),
                              cwd=str(cwd) if cwd else None, capture_output=True, text=True, timeout=60)
        output = proc.stdout + proc.stderr
        job_id = proc.stdout.strip().split(";")[0].splitlines()[0] if proc.stdout.strip() else ""
        if proc.returncode != 0 or not job_id:
            return job_id, proc.returncode or 1, output
        return job_id, self.wait_job(job_id, timeout), output

    def wait_job(self, job_id: str, timeout: float = 600) -> int:
        """Wait until the job has ended; its exit code (the batch script's, or 128+signal)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = self.job_state(job_id)
            state = fields.get("JobState", "PENDING")
            if state in TERMINAL_STATES:
                code, _, signal_number = fields.get("ExitCode", "0:0").partition(":")
                if int(code or 0):
                    return int(code)
                if int(signal_number or 0):
                    return 128 + int(signal_number)
                return 0 if state == "COMPLETED" else 1
            time.sleep(0.3)
        raise TimeoutError(f"job {job_id} still running after {timeout:g} s:\n{self.logs()}")

    def submit(self, script: Path, *args: str, env: Optional[dict] = None, cwd: Optional[Path] = None) -> str:
        proc = subprocess.run(["sbatch", "--parsable", *args, str(script)], env=self.env(env),
                              cwd=str(cwd) if cwd else None, capture_output=True, text=True, timeout=60, check=True)
        return proc.stdout.strip().split(";")[0]

    def job_state(self, job_id: str) -> dict:
        proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=self.env(), capture_output=True,
                              text=True)
        fields = {}
        for item in proc.stdout.split():
            key, _, value = item.partition("=")
            fields[key] = value
        return fields

    def wait_all(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env(), capture_output=True, text=True)
            if proc.returncode == 0 and not proc.stdout.strip():
                return
            time.sleep(1)
        raise TimeoutError(f"jobs still queued after {timeout:g} s")
