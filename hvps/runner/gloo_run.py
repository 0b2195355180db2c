"""``hvpsrun --gloo``: start a job without MPI, the way ``horovodrun --gloo`` does.

hvpsrun itself starts the workers: on this machine as child processes, on other hosts through
``ssh`` (non-interactive: keys, not passwords). It hosts the job's rendezvous, a torch
``TCPStore`` that every worker joins (:func:`hvps.runtime.bootstrap.start`), and hands each worker
Horovod's variables (``HOROVOD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``, ``_CROSS_RANK``,
``_CROSS_SIZE``, ``_HOSTNAME``), the store's addresses and a fresh random secret (``HVPS_SECRET``,
from which the control plane's key is derived). A remote worker gets hvpsrun's whole environment
but this session's own variables (as horovodrun forwards it), on ssh's stdin, never on a command
line. Each worker line of output is tagged ``[rank]<stdout>:`` or ``[rank]<stderr>:``.

When a worker exits with a failure, hvpsrun names it, ends the others (SIGTERM to each worker's
process group, SIGKILL after a grace period) and exits with that worker's status; hvpsrun's
supervisor may then restart the whole job (``--max-restarts``). This module is the job process the
supervisor starts (``python -m hvps.runner.gloo_run PLAN``): one try of the job per process, so each
try gets a new store, a new secret and the restart count in its environment.
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import IO, Mapping, Optional, Sequence

from ..control.membership import Slot
from ..control.plane import interface_address
from . import hosts as hostlib
from .elastic_settings import elastic_settings
from .errors import LaunchError
from .mpi_command import default_num_proc, rank_environment
from .settings import LaunchSettings
from .supervisor import exit_status

#: seconds the other workers get to end after SIGTERM before SIGKILL
GRACE_SECONDS = 5.0
#: seconds between two looks for a signal to hvpsrun, and at workers being ended
POLL_SECONDS = 0.05
#: ssh options: fail instead of asking for a password or a host key
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new")


def assign_slots(hosts: Sequence[hostlib.Host], num_proc: int) -> list:
    """Ranks host by host, each host's slots in order (as ``-map-by slot``). A rank's cross rank is its
    host's index among the hosts that have a rank of the same local rank (Horovod's rule)."""
    per_host = hostlib.ranks_per_host(list(hosts), num_proc)
    placed = [(host.name, local, count) for host, count in zip(hosts, per_host) for local in range(count)]
    slots = []
    for rank, (name, local, count) in enumerate(placed):
        peers = [n for n, other, _ in placed if other == local]
        slots.append(Slot(rank, num_proc, name, local, count, peers.index(name), len(peers)))
    return slots


@dataclass(frozen=True)
class Plan:
    """What the job process runs (written by hvpsrun as JSON, without the secret)."""

    command: tuple
    hosts: tuple  # ((name, slots), ...); empty: this machine only
    num_proc: int
    env: dict  # the variables hvpsrun sets for every worker (flags, OMP_NUM_THREADS)
    network_interface: Optional[str] = None
    ssh_port: Optional[int] = None
    ssh_identity_file: Optional[str] = None
    cwd: str = ""
    elastic: Optional[dict] = None  # elastic mode's settings (hvps.runner.elastic_settings.ElasticSettings)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f)

    @classmethod
    def load(cls, path: str) -> "Plan":
        with open(path) as f:
            data = json.load(f)
        data["command"] = tuple(data["command"])
        data["hosts"] = tuple(tuple(h) for h in data["hosts"])
        return cls(**data)

    def host_list(self) -> list:
        return [hostlib.Host(name, slots) for name, slots in self.hosts] or [hostlib.Host("localhost",
                                                                                         self.num_proc)]


def _refuse_mpi_flags(settings: LaunchSettings) -> None:
    for given, flag in ((settings.mpi_args, "--mpi-args"), (settings.mpirun, "--mpirun"),
                        (settings.launcher == "srun", "--launcher srun")):
        if given:
            raise LaunchError(f"{flag} is for an MPI launch, and --gloo starts no MPI: drop {flag}, or drop --gloo")
    if settings.backend == "mpi":
        raise LaunchError(f"--backend {settings.backend} needs MPI, and --gloo starts none: its data plane is "
                          "torch.distributed (--backend tdist or auto)")


def build_plan(settings: LaunchSettings, env: Mapping[str, str], cpu_count: int) -> Plan:
    """The job for ``hvpsrun --gloo`` (checks the flags; raises LaunchError for bad input)."""
    import importlib.util

    _refuse_mpi_flags(settings)
    if importlib.util.find_spec("torch") is None:
        raise LaunchError("--gloo needs torch (its data plane is torch.distributed): pip install 'hvps[torch]', "
                          "or launch with MPI (hvpsrun without --gloo)")
    hosts = hostlib.resolve_hosts(settings.hosts, settings.hostfile)
    hostlib.check_resolvable(hosts)
    elastic = None
    if settings.elastic:
        elastic = asdict(elastic_settings(settings, hosts))
        num_proc = settings.num_proc or elastic["min_np"]
    else:
        num_proc = default_num_proc(settings, hosts)
    if hosts and not elastic:
        hostlib.check_slots(hosts, num_proc)
    nic = settings.network_interfaces[0] if settings.network_interfaces else None
    return Plan(tuple(settings.command), tuple((h.name, h.slots) for h in hosts), num_proc,
                rank_environment(settings, env, num_proc, hosts, cpu_count), nic, settings.ssh_port,
                settings.ssh_identity_file, os.getcwd(), elastic)


def preview(plan: Plan) -> str:
    """What ``--dry-run`` prints: one line per worker (the rendezvous' port is chosen at start)."""
    local = hostlib.local_names()
    lines = []
    for slot in assign_slots(plan.host_list(), plan.num_proc):
        env = {**plan.env, **slot.environment(), "HVPS_RENDEZVOUS_PORT": "<chosen at start>"}
        if slot.host in local:
            lines.append(shlex.join([f"{k}={v}" for k, v in sorted(env.items())] + list(plan.command)))
        else:  # what ssh's stdin carries besides: hvpsrun's own environment, and the secret
            shown = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items()))
            lines.append(f"{shlex.join(ssh_command(plan, slot.host))}  # stdin: {shown} + the caller's environment")
    return "\n".join(lines)


def rendezvous_addresses(plan: Plan, local_only: bool) -> list:
    """The addresses workers try for the store: loopback on one machine, else the training interface's
    (``--network-interface``) or every address this host's name resolves to."""
    if local_only:
        return ["127.0.0.1"]
    if plan.network_interface:
        address = interface_address(plan.network_interface)
        if address is None:
            raise LaunchError(f"--network-interface {plan.network_interface}: no IPv4 address on this host")
        return [address]
    import socket

    found = []
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:  # a hostname that does not resolve: loopback, and the workers' error names the flag
        infos = []
    for info in infos:
        if info[4][0] not in found and not info[4][0].startswith("127."):
            found.append(info[4][0])
    return found or ["127.0.0.1"]


def rendezvous_bind_address(plan: Plan, local_only: bool, addresses: list) -> str:
    """Where the store listens: loopback for a job on this machine alone, the training interface's address
    with ``--network-interface``, else every interface (a discovery script may name any host later)."""
    if local_only:
        return "127.0.0.1"
    if plan.network_interface:
        return addresses[0]
    return "0.0.0.0"


#: variables of hvpsrun's environment that describe this host or session, not the job: a remote worker's
#: login shell sets its own (everything else is forwarded, as horovodrun does)
_SESSION_ONLY = re.compile(r"(HOSTNAME|HOME|USER|LOGNAME|MAIL|SHELL|PWD|OLDPWD|SHLVL|_|TERM|TERMCAP|COLUMNS|LINES|"
                           r"DISPLAY|XAUTHORITY|PS1|PROMPT_COMMAND|STY|WINDOW|SSH_\w*|TMUX\w*|BASH_FUNC_\S*)")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def remote_environment(env: Mapping[str, str]) -> dict:
    """What a remote worker gets of ``env``: everything but this session's own variables (and values
    that cannot travel as one line)."""
    return {k: v for k, v in env.items() if _NAME.fullmatch(k) and not _SESSION_ONLY.fullmatch(k)
            and "\n" not in v and "\0" not in v}


def ssh_command(plan: Plan, host: str) -> list:
    """``ssh host 'cd CWD && export each line of stdin until an empty one && exec COMMAND'``: the
    environment (the secret too) travels on ssh's stdin (:func:`ssh_input`), never on a command line,
    where any user of either host could read it."""
    remote = (f"cd {shlex.quote(plan.cwd or os.getcwd())} && "
              'while IFS= read -r kv && [ -n "$kv" ]; do export "$kv"; done && '
              f"exec {shlex.join(plan.command)}")
    cmd = ["ssh", *SSH_OPTIONS]
    if plan.ssh_port:
        cmd += ["-p", str(plan.ssh_port)]
    if plan.ssh_identity_file:
        cmd += ["-i", plan.ssh_identity_file]
    hostlib.check_name(host, "ssh")
    return cmd + ["--", host, remote]  # "--": a host name is never read as an option of ssh


def ssh_input(env: Mapping[str, str]) -> bytes:
    """What :func:`ssh_command`'s remote shell reads: ``NAME=value`` lines, then an empty line."""
    return ("".join(f"{k}={v}\n" for k, v in sorted(remote_environment(env).items())) + "\n").encode()


def _pump(stream: IO[bytes], tag: str, out: IO[str], lock: threading.Lock) -> None:
    """Copy a worker's output line by line, each line tagged with its rank."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        with lock:
            out.write(f"{tag}{line}\n")
            out.flush()
    stream.close()


def signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def status_text(status: int) -> str:
    return f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"


class GlooJob:
    """One try of the job: the store, the workers, their output, and the first failure."""

    def __init__(self, plan: Plan, env: Mapping[str, str]) -> None:
        self.plan = plan
        self.env = dict(env)
        self.workers: list = []  # (slot, Popen)
        self.pumps: list = []
        self._lock = threading.Lock()
        self._stop_signal: Optional[int] = None

    def _worker_env(self, slot: Slot) -> dict:
        env = dict(self.plan.env)
        env.update(slot.environment())
        env.update(HVPS_RENDEZVOUS_ADDR=",".join(self.addresses), HVPS_RENDEZVOUS_PORT=str(self.port),
                   HVPS_SECRET=self.secret)
        return env

    def _start(self, slot: Slot, env: dict) -> subprocess.Popen:
        """Start ``slot``'s worker: a child process on this machine, else over ssh."""
        local = slot.host in self.local
        if local:
            cmd, full, stdin = list(self.plan.command), {**self.env, **env}, subprocess.DEVNULL
        else:
            cmd, full, stdin = ssh_command(self.plan, slot.host), self.env, subprocess.PIPE
        proc = subprocess.Popen(cmd, env=full, cwd=self.plan.cwd or None, stdin=stdin, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        if not local:
            proc.stdin.write(ssh_input({**self.env, **env}))
            proc.stdin.close()
        for stream, out, kind in ((proc.stdout, sys.stdout, "stdout"), (proc.stderr, sys.stderr, "stderr")):
            pump = threading.Thread(target=_pump, args=(stream, f"[{slot.rank}]<{kind}>:", out, self._lock),
                                    daemon=True)
            pump.start()
            self.pumps.append(pump)
        return proc

    def _on_signal(self, signum: int, _frame) -> None:
        self._stop_signal = signum

    def run(self) -> int:
        """Start every worker and wait; the job's exit status (the first failed worker's)."""
        hosts = self.plan.host_list()
        store = self._open_rendezvous(hosts)
        try:
            for slot in assign_slots(hosts, self.plan.num_proc):
                self.workers.append((slot, self._start(slot, self._worker_env(slot))))
            return self._wait()
        finally:
            self._end_all()
            for pump in self.pumps:
                pump.join(timeout=2.0)
            del store

    def _open_rendezvous(self, hosts: Sequence[hostlib.Host]):
        """Host the job's store, choose its addresses and the secret, catch SIGINT/SIGTERM; the store."""
        import torch.distributed as dist

        self.local = hostlib.local_names()
        # a discovery script names the hosts only later, any of them remote: never loopback alone then
        discovered = bool(self.plan.elastic and self.plan.elastic.get("discovery_script"))
        local_only = not discovered and hostlib.is_local_only(list(hosts), self.local)
        self.addresses = rendezvous_addresses(self.plan, local_only)
        self.bound = rendezvous_bind_address(self.plan, local_only, self.addresses)
        # torch's TCPStore listens on every interface whatever host it is given; a socket of our own, bound
        # to one address, keeps strangers on other networks out (issue 38)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((self.bound, 0))
            listener.listen(128)
        except OSError as exc:
            listener.close()
            raise LaunchError(f"cannot listen for the job's rendezvous on {self.bound}: {exc.strerror}") from None
        store = dist.TCPStore(self.bound, listener.getsockname()[1], None, True, datetime.timedelta(seconds=300),
                              wait_for_workers=False, master_listen_fd=listener.detach())
        self.port, self.secret = store.port, secrets.token_hex(32)
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self._on_signal)
        return store

    def _wait(self) -> int:
        """Until every worker has ended well, or one failed: one thread per worker records when it ended, so
        the first failure is the one reported, not the survivors that fail after it."""
        ended: queue.Queue = queue.Queue()
        for slot, proc in self.workers:
            threading.Thread(target=lambda s=slot, p=proc: ended.put((s, p.wait())), daemon=True).start()
        running = len(self.workers)
        while running:
            if self._stop_signal is not None:
                self._log(f"got signal {self._stop_signal}; ending the job's {len(self.workers)} workers")
                return 128 + self._stop_signal
            try:
                slot, status = ended.get(timeout=POLL_SECONDS)
            except queue.Empty:
                continue
            running -= 1
            if status != 0:
                self._log(f"rank {slot.rank} (on {slot.host}) {status_text(status)}; ending the other {running} "
                          "running worker(s)")
                return exit_status(status)
        return 0

    def _processes(self) -> list:
        return [proc for _, proc in self.workers]

    def _end_all(self) -> None:
        alive = [proc for proc in self._processes() if proc.poll() is None]
        for proc in alive:
            signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECONDS
        while alive and time.monotonic() < deadline:
            alive = [proc for proc in alive if proc.poll() is None]
            time.sleep(POLL_SECONDS)
        for proc in alive:
            signal_group(proc, signal.SIGKILL)
        for proc in self._processes():
            proc.wait()

    def _log(self, message: str) -> None:
        with self._lock:
            print(f"hvpsrun: {message}", file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None, job: type = GlooJob) -> int:
    """The job process: ``job`` (GlooJob, or the elastic driver) runs the plan file ``argv[0]``."""
    argv = sys.argv[1:] if argv is None else argv
    plan = Plan.load(argv[0])
    try:
        return job(plan, os.environ).run()
    except LaunchError as exc:
        print(f"hvpsrun: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
