"""How a process finds the rest of its job at ``init``: through MPI, hvpsrun's rendezvous, torchrun's
store, or not at all (a job of one).

- **MPI**, under ``mpirun``/``srun`` (the launcher's rank variables are set) or with a communicator
  given to ``init``: ``MPI.COMM_WORLD``.
- **hvpsrun** (``hvpsrun --gloo``; ``HVPS_RENDEZVOUS_ADDR`` is set): the launcher hosts a store and
  hands each worker its rank (Horovod's ``HOROVOD_RANK``/``HOROVOD_SIZE``/``HOROVOD_HOSTNAME``) and
  the job's secret (``HVPS_SECRET``).
- **torchrun** (``TORCHELASTIC_RUN_ID``, or ``MASTER_ADDR`` with ``WORLD_SIZE``): torch's ``env://``
  rendezvous, the store torchrun's agent hosts. It has no authentication: see SECURITY.md and
  ``HVPS_SECRET_FILE``.
- **alone**: a job of one on an in-memory store, when mpi4py is not installed (else an MPI singleton).

Without MPI the bootstrap communicator is a :class:`~hvps.control.store_comm.StoreComm`, the data
plane is torch.distributed, and mpi4py is never imported. A launcher that says the job has several
ranks but gives no way to find them is an error, never a job of independent singletons.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import hmac
import logging
import os
import socket
import stat
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ..control import membership
from ..control.plane import reachable
from ..control.store_comm import StoreComm
from ..core.errors import HvpsError
from ..core.files import RefusedFile, read_untrusted
from ..core.launchers import MPI_LAUNCH_VARIABLES
from ..core.mpi_env import mpi_defaults
from ..core.settings import env_text

#: seconds a rank waits for the others during start-up (as the control plane's connect timeout)
START_TIMEOUT = 60.0
KINDS = ("mpi", "hvpsrun", "torchrun", "alone")


@dataclass(frozen=True)
class Bootstrap:
    """The communicator ``init`` builds the job on, and what the launcher said about it."""

    comm: Any
    kind: str
    #: the node this process runs on, as the launcher names it (None: MPI's shared-memory split finds it)
    node: Optional[str] = None
    #: the job's shared secret (None when there is none: MPI, or torchrun without HVPS_SECRET_FILE)
    secret: Optional[bytes] = None

    @property
    def has_mpi(self) -> bool:
        return self.kind == "mpi"

    def control_key(self) -> Optional[bytes]:
        """The control plane's key, derived from the secret so that it never travels (None: none)."""
        if self.secret is None:
            return None
        return hmac.new(self.secret, b"hvps control plane", hashlib.sha256).digest()


def launched_by(env: Mapping[str, str]) -> str:
    """Which of :data:`KINDS` started this process, from its environment."""
    if env.get("HVPS_RENDEZVOUS_ADDR"):
        return "hvpsrun"
    if any(env.get(name) for name in MPI_LAUNCH_VARIABLES):
        return "mpi"
    if env.get("TORCHELASTIC_RUN_ID") or (env.get("MASTER_ADDR") and env.get("WORLD_SIZE")):
        return "torchrun"
    world = env.get("WORLD_SIZE", "")
    if world not in ("", "0", "1"):
        raise HvpsError(
            f"WORLD_SIZE={world} says this job has several processes, but neither MASTER_ADDR/MASTER_PORT "
            "(torchrun) nor an MPI launcher's variables are set, so they cannot find each other; start the job "
            "with torchrun, hvpsrun (-np N, or --gloo without MPI) or mpirun")
    return "alone"


#: how many times this process has joined a store-based job: each ``init`` after a ``shutdown`` reads
#: and writes keys of its own, never the last one's (every rank calls init as often as the others)
_joins = 0


def _fresh_keys(store: Any) -> Any:
    """``store`` with a key prefix of this join's own."""
    global _joins
    _joins += 1
    return dist_prefix(store, f"join{_joins}")


def start(comm: Any = None) -> Bootstrap:
    """The bootstrap for this process (collective: every rank of the job calls it).

    One secret rule for every launcher: with ``HVPS_SECRET``/``HVPS_SECRET_FILE`` set, the secret is read
    (an unsafe file refused), and every rank checks that all of them hold the same one before anything
    else crosses the wire (:func:`check_same_secret`); the control plane's key and the sealed data plane's
    key exchange are then bound to it. Without one, rank 0 warns when something is exposed (:func:`warn_exposure`).
    """
    kind = "mpi" if comm is not None else launched_by(os.environ)
    secret = read_secret()
    if kind == "mpi" or (kind == "alone" and _mpi4py_installed()):
        boot = Bootstrap(_mpi_world(comm), "mpi", secret=secret)
    elif kind == "hvpsrun":
        boot = _hvpsrun(secret)
    elif kind == "torchrun":
        boot = _torchrun(secret)
    else:
        import torch.distributed as dist

        boot = Bootstrap(StoreComm(dist.HashStore(), 0, 1, secret), "alone", node=socket.gethostname(), secret=secret)
    check_same_secret(boot.comm, secret)
    warn_exposure(boot)
    return boot


_SECRET_CHECK = b"hvps: every rank holds the job's secret"


def check_same_secret(comm: Any, secret: Optional[bytes]) -> None:
    """Every rank of ``comm`` learns whether all of them hold ``secret`` (collective; one allgather of a
    fresh nonce and an HMAC over it and the rank, never the secret); HvpsError on every rank otherwise."""
    if comm.Get_size() == 1:
        return
    rank, nonce = comm.Get_rank(), os.urandom(16)
    proof = None if secret is None else hmac.new(secret, _SECRET_CHECK + nonce + rank.to_bytes(4, "big"),
                                                 hashlib.sha256).digest()
    entries = comm.allgather([nonce, proof])
    without = [r for r, (_, p) in enumerate(entries) if p is None]
    if secret is None and len(without) == len(entries):
        return
    if without:
        raise HvpsError(f"ranks {without} have no job secret but the others do (HVPS_SECRET/HVPS_SECRET_FILE): give "
                        "every rank the same one")
    other = [r for r, (n, p) in enumerate(entries)
             if not hmac.compare_digest(bytes(p), hmac.new(secret, _SECRET_CHECK + bytes(n) + r.to_bytes(4, "big"),
                                                           hashlib.sha256).digest())]
    if other:
        raise HvpsError(f"rank {rank}'s job secret (HVPS_SECRET/HVPS_SECRET_FILE) differs from that of ranks {other}: "
                        "give every rank the same one")


def warn_exposure(boot: Bootstrap) -> None:
    """Rank 0's one warning when the job has no secret and a listener beyond loopback exposes something."""
    if boot.secret is not None or boot.comm.Get_rank() != 0 or boot.comm.Get_size() == 1:
        return
    if boot.kind == "torchrun":
        what = (f"torchrun's store (MASTER_ADDR={os.environ.get('MASTER_ADDR')}, MASTER_PORT="
                f"{os.environ.get('MASTER_PORT')}) listens on every interface without authentication, and without a "
                "job secret hvps sends its control plane's key through it in clear: anyone who reaches the port "
                "during start-up can read it and pose as a rank")
    elif boot.kind == "mpi" and env_text("HVPS_ENCRYPT", "0") not in ("0", "off", "false"):
        what = ("HVPS_ENCRYPT's key exchange is not authenticated without a job secret: an attacker who can rewrite "
                "MPI's traffic while init runs could put itself in the middle")
    else:
        return
    logging.getLogger("hvps").warning(
        "hvps: this job has no secret: %s. Give every rank the same HVPS_SECRET_FILE (an owner-only file, e.g. on "
        "shared storage: python -c 'import secrets; print(secrets.token_hex(32))' > FILE; chmod 600 FILE); see "
        "SECURITY.md", what)


def read_secret() -> Optional[bytes]:
    """The job's secret: ``HVPS_SECRET`` (hex; what hvpsrun hands its workers), else the first line of
    ``HVPS_SECRET_FILE``, which only its owner may read."""
    text = env_text("HVPS_SECRET")
    if text:
        try:
            return bytes.fromhex(text)
        except ValueError:
            raise HvpsError("HVPS_SECRET is not hexadecimal; let hvpsrun set it, or use HVPS_SECRET_FILE") from None
    path = env_text("HVPS_SECRET_FILE")
    if not path:
        return None
    try:  # never blocks (a FIFO), never follows a link planted at the name
        first = read_untrusted(path, 4096, follow_links=False, own=True, forbidden_mode=stat.S_IRWXG | stat.S_IRWXO)
    except RefusedFile as exc:
        if exc.missing or exc.reason.startswith("cannot"):
            raise HvpsError(f"HVPS_SECRET_FILE={path!r} cannot be read: {exc.reason}") from None
        fix = (f"chmod 600 {path}" if "by others" in exc.reason else "use a file of your own, mode 600"
               if "user" in exc.reason else "give a file of at least 16 random bytes")
        raise HvpsError(f"HVPS_SECRET_FILE={path!r} {exc.reason}; {fix}") from None
    line = first.split(b"\n", 1)[0].strip()
    if len(line) < 16:
        raise HvpsError(f"HVPS_SECRET_FILE={path!r} holds {len(line)} bytes on its first line; give at least 16 "
                        "random bytes, e.g. python -c 'import secrets; print(secrets.token_hex(32))'")
    return line


def _mpi4py_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


#: whether hvps initialised MPI itself (the script set ``mpi4py.rc.initialize = False``): then hvps finalizes it
_mpi_initialized_here = False


def _mpi_world(comm: Any = None) -> Any:
    """``comm`` (default: MPI.COMM_WORLD), once MPI is known to support hvps's engine thread.

    A script that set ``mpi4py.rc.initialize = False`` leaves MPI to hvps, as it would to Horovod: hvps
    then initialises it with MPI_THREAD_MULTIPLE (what mpi4py asks for by default), and finalizes it
    when the process exits, after hvps's own shutdown.
    """
    global _mpi_initialized_here
    mpi_defaults(os.environ)  # before MPI initialises: HOME for Open MPI 5, no spinning waits
    from mpi4py import MPI

    if MPI.Is_finalized():
        raise HvpsError("MPI was finalized before hvps.init(); call hvps.init() before MPI.Finalize()")
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        _mpi_initialized_here = True
    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        raise HvpsError(
            "MPI was initialized without thread support; hvps needs MPI_THREAD_SERIALIZED or better "
            "(do not set mpi4py.rc.thread_level below 'serialized')")
    return MPI.COMM_WORLD if comm is None else comm


def _finalize_mpi() -> None:
    """At exit: finalize MPI if hvps initialised it. Registered when this module is imported, before
    ``lifecycle`` registers ``shutdown``, so that it runs after it (atexit runs handlers last in, first out)."""
    MPI = sys.modules.get("mpi4py.MPI")
    if _mpi_initialized_here and MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


atexit.register(_finalize_mpi)


def _int_variable(name: str, launcher: str) -> int:
    text = os.environ.get(name) or ""
    if not text.isdigit():
        raise HvpsError(f"{name}={text!r}: {launcher} sets it for every worker; start this script with {launcher}")
    return int(text)


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=START_TIMEOUT)


#: this process's connection to hvpsrun's store, by (addresses, port, pid): each init after a shutdown reuses
#: it (under keys of its own), as a new one costs torch's client and server a reverse DNS lookup of the peer's
#: address, which a resolver that drops a query makes 5 s long (resolv.conf's timeout)
_rendezvous_clients: dict = {}


def _join_rendezvous(addresses: list, port: int) -> tuple:
    """``(store, where)``: a client of hvpsrun's store at the first of ``addresses`` that answers."""
    import torch.distributed as dist

    address, _ = reachable(addresses, port, "hvpsrun's rendezvous")
    where = f"hvpsrun's rendezvous at {address}:{port}"
    try:
        store = dist.TCPStore(address, port, None, False, _timeout(), wait_for_workers=False)
    except Exception as exc:  # torch's DistNetworkError/RuntimeError
        raise HvpsError(f"could not join {where}: {exc} (the address is hvpsrun's host's; choose the network "
                        "with hvpsrun --network-interface)") from None
    return store, where


def _hvpsrun(secret: Optional[bytes]) -> Bootstrap:
    addresses = [a for a in env_text("HVPS_RENDEZVOUS_ADDR").split(",") if a]
    port = env_text("HVPS_RENDEZVOUS_PORT", "")
    if not port.isdigit():
        raise HvpsError(f"HVPS_RENDEZVOUS_PORT={port!r}: hvpsrun --gloo sets it; start this script with hvpsrun")
    port = int(port)
    key = (tuple(addresses), port, os.getpid())
    if key not in _rendezvous_clients:
        _rendezvous_clients[key] = _join_rendezvous(addresses, port)
    store, where = _rendezvous_clients[key]
    if elastic_worker():
        return _elastic_join(store, secret, where)
    rank, size = _int_variable("HOROVOD_RANK", "hvpsrun"), _int_variable("HOROVOD_SIZE", "hvpsrun")
    node = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
    return Bootstrap(StoreComm(_fresh_keys(store), rank, size, secret, timeout=START_TIMEOUT, where=where),
                     "hvpsrun", node, secret)


def elastic_worker() -> Optional[str]:
    """This worker's id (``host:slot``) when hvpsrun's elastic driver started it, else None."""
    return env_text("HVPS_ELASTIC_WORKER") or None


@dataclass
class ElasticSession:
    """What this worker knows of its elastic job: the store, and the last round it joined."""

    store: Any = None
    secret: Optional[bytes] = None
    round: int = 0
    rank: int = -1
    worker: Optional[str] = None
    #: this worker joined a job in progress: its first round is not the first, and it had no slot in the one before
    joined_late: bool = False

    def report_failure(self, reason: str) -> None:
        """Tell hvpsrun that a collective of this round failed here (it may have to end a stopped peer)."""
        if self.store is not None:
            membership.report_failure(self.store, self.secret, self.round, self.worker, reason)

    def give_up(self, reason: str) -> None:
        """Tell hvpsrun that this worker's elastic loop gave up (the job then fails with ``reason``)."""
        if self.store is not None:
            membership.report_gave_up(self.store, self.secret, self.worker, reason)

    def pending_notice(self) -> Optional[tuple]:
        """Rank 0's view: ``(timestamp, kind)`` of a host change that a round after this one brings."""
        if self.store is None or self.rank != 0:
            return None
        found = membership.notice(self.store, self.secret)
        if found is None or int(found["round"]) <= self.round:
            return None
        return float(found["timestamp"]), int(found["kind"])


#: this process's elastic session (one per worker; ``round`` grows with every re-initialization)
elastic_session = ElasticSession()


def _elastic_join(store: Any, secret: Optional[bytes], where: str) -> Bootstrap:
    """Join the newest round above the last one joined: wait for it, find this worker's slot in it."""
    worker = elastic_worker()
    timeout = float(env_text("HVPS_ELASTIC_TIMEOUT", "600") or 600)
    deadline = time.monotonic() + timeout
    while True:
        number = membership.latest_round(store, secret, elastic_session.round)
        if number > elastic_session.round:
            break
        if time.monotonic() > deadline:
            raise HvpsError(f"{where}: hvpsrun's elastic driver published no new membership within {timeout:g} s "
                            "(--elastic-timeout); is hvpsrun still running?")
        time.sleep(0.02)
    slots = membership.round_slots(store, secret, number)
    if worker not in slots:
        logging.getLogger("hvps").warning("hvps: worker %s has no place in the job's membership %d (its host was "
                                          "removed or blacklisted); leaving", worker, number)
        raise SystemExit(0)
    slot = slots[worker]
    if elastic_session.round == 0 and number > 1:
        try:
            elastic_session.joined_late = worker not in membership.round_slots(store, secret, number - 1)
        except HvpsError:  # the round before cannot be read: do what a first worker does (its wrap-time collectives)
            elastic_session.joined_late = False
    elastic_session.store, elastic_session.secret = store, secret
    elastic_session.round, elastic_session.rank, elastic_session.worker = number, slot.rank, worker
    os.environ.update(slot.environment())  # scripts read Horovod's variables

    def abandon() -> None:
        newer = membership.latest_round(store, secret, number)
        if newer > number:
            raise membership.MembershipChanged(f"{where}: membership {newer} replaced {number} while joining it")

    comm = StoreComm(dist_prefix(store, f"round{number}"), slot.rank, slot.size, secret, timeout=timeout,
                     where=f"{where} (membership {number})", abandon=abandon)
    return Bootstrap(comm, "hvpsrun", slot.host, secret)


def dist_prefix(store: Any, prefix: str) -> Any:
    import torch.distributed as dist

    return dist.PrefixStore(prefix, store)


def _torchrun(secret: Optional[bytes]) -> Bootstrap:
    import torch.distributed as dist

    where = f"torchrun's store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    try:
        store, rank, size = next(dist.rendezvous("env://", timeout=_timeout()))
    except (ValueError, RuntimeError) as exc:  # a missing variable, or the store cannot be reached
        raise HvpsError(f"could not join {where} (RANK={os.environ.get('RANK')}, WORLD_SIZE="
                        f"{os.environ.get('WORLD_SIZE')}): {exc}") from None
    # torchrun restarts every worker on a failure; each try gets keys of its own
    store = _fresh_keys(dist.PrefixStore(f"hvps/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store))
    node = os.environ.get("GROUP_RANK")
    node = f"node{node}" if node else socket.gethostname()
    return Bootstrap(StoreComm(store, rank, size, secret, timeout=START_TIMEOUT, where=where), "torchrun", node,
                     secret)

