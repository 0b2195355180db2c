"""Process-wide state: ``init``/``shutdown``, topology queries and the running engine."""

from __future__ import annotations

import atexit
import logging
import os
import threading
from dataclasses import dataclass
from typing import Optional

from .errors import NOT_INITIALIZED, HvpsError
from .mpi_env import mpi_defaults
from .settings import Settings


@dataclass(frozen=True)
class Topology:
    """Where this process sits: globally, within its node, and across nodes."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.engine = None
        self.topology: Optional[Topology] = None
        self.settings: Optional[Settings] = None


_state = _State()


def _node_comms(comm):
    """Communicators over this node's ranks and over the ranks sharing this local rank.

    ``HVPS_LOCAL_SIZE=k`` overrides the discovery: consecutive blocks of k ranks
    count as one node (to emulate several nodes on one machine, e.g. in tests).
    """
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    override = os.environ.get("HVPS_LOCAL_SIZE")
    if override:
        if not override.isdigit() or int(override) < 1 or size % int(override):
            raise HvpsError(f"HVPS_LOCAL_SIZE={override!r} must be a positive divisor of the job size ({size})")
        local = comm.Split(color=rank // int(override), key=rank)
    else:
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    cross = comm.Split(color=local.Get_rank(), key=rank)
    return local, cross


def _topology(comm, local, cross) -> Topology:
    return Topology(comm.Get_rank(), comm.Get_size(), local.Get_rank(), local.Get_size(),
                    cross.Get_rank(), cross.Get_size())


def init(comm=None, process_sets=None) -> None:
    """Start hvps on ``comm`` (default: MPI.COMM_WORLD). Calling it again is a no-op.

    Reads ``HVPS_*`` settings from the environment and starts the engine thread.
    ``process_sets`` (ProcessSets or lists of ranks) are registered on every rank, in order.
    """
    with _state.lock:
        if _state.engine is not None:
            return
        _start(comm)
    from . import metrics
    from . import process_sets as sets

    sets.setup(process_sets)
    metrics.start_from_env()  # HVPS_METRICS_PORT: serve this rank's metrics on port + local rank


def _start(comm) -> None:
    """Build the topology, settings, backend and engine (under the state lock)."""
    mpi_defaults(os.environ)  # before MPI initialises: HOME for Open MPI 5, no spinning waits
    from mpi4py import MPI

    from . import backends
    from .engine import Engine

    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        raise HvpsError(
            "MPI was initialized without thread support; hvps needs MPI_THREAD_SERIALIZED or better "
            "(do not set mpi4py.rc.thread_level below 'serialized')"
        )
    comm = MPI.COMM_WORLD if comm is None else comm
    local, cross = _node_comms(comm)
    topology = _topology(comm, local, cross)
    settings = Settings.from_env().resolved(single_host=topology.local_size == topology.size)
    try:
        backend = backends.build(settings, comm, local, cross)
    finally:
        local.Free()
        cross.Free()
    _state.topology = topology
    _state.settings = settings
    _state.engine = Engine(comm, backend, settings)


def shutdown() -> None:
    """Stop the engine on every rank (collective). Safe to call when not initialized."""
    from . import process_sets

    process_sets.reset()
    with _state.lock:
        engine, _state.engine = _state.engine, None
        if engine is None:
            return
        _state.topology = None
        if engine.shutdown():
            engine.backend.close()
            return
    # A collective failed midway or is stuck inside MPI (a peer or link died):
    # MPI cannot finalize, so end the job rather than hang at exit.
    from mpi4py import MPI

    logging.getLogger("hvps").error("hvps: a collective failed midway; aborting the MPI job")
    MPI.COMM_WORLD.Abort(1)


atexit.register(shutdown)


def is_initialized() -> bool:
    """Whether ``init`` has run and ``shutdown`` has not."""
    return _state.engine is not None


def engine():
    """The running engine; raises HvpsError before ``init``."""
    current = _state.engine
    if current is None:
        raise HvpsError(NOT_INITIALIZED)
    return current


def step_done() -> None:
    """Tell hvps that a training step ended (the framework adapters' optimizers call it; call it
    yourself from a custom loop to let ``HVPS_AUTOTUNE=1`` measure steps). A no-op before ``init``."""
    current = _state.engine
    if current is not None:
        current.step_done()


def autotune_report() -> Optional[dict]:
    """What ``HVPS_AUTOTUNE=1`` tried and chose, on rank 0 (None elsewhere, or when it is off)."""
    tuner = engine().autotuner
    return None if tuner is None else tuner.report()


def topology() -> Topology:
    current = _state.topology
    if current is None:
        raise HvpsError(NOT_INITIALIZED)
    return current


def settings() -> Settings:
    """The settings the engine was started with."""
    engine()
    return _state.settings


def rank() -> int:
    """This process's rank in the job."""
    return topology().rank


def size() -> int:
    """The number of processes in the job."""
    return topology().size


def local_rank() -> int:
    """This process's rank among the processes on its node."""
    return topology().local_rank


def local_size() -> int:
    """The number of processes on this node."""
    return topology().local_size


def cross_rank() -> int:
    """The index of this node among nodes (this process's rank among same-local-rank peers)."""
    return topology().cross_rank


def cross_size() -> int:
    """The number of nodes (processes that share this local rank)."""
    return topology().cross_size


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline to ``file_path`` (rank 0 writes it; Horovod's API)."""
    engine().start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop writing the timeline started by ``start_timeline`` (or ``HVPS_TIMELINE``)."""
    engine().stop_timeline()


def is_homogeneous() -> bool:
    """Whether every node runs the same number of ranks (judged from this rank's view of the topology)."""
    current = topology()
    return current.local_size * current.cross_size == current.size
