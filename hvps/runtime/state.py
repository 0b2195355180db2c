"""Process-wide state: the running engine, its settings and topology, and the queries on them.

``hvps.runtime.lifecycle`` fills it in (``init``) and clears it (``shutdown``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

from ..core.errors import NOT_INITIALIZED, HvpsError
from ..core.settings import Settings


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
