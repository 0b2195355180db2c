"""Process-wide state: the running engine, its settings and topology, and the queries on them.

``hvps.runtime.lifecycle`` fills it in (``init``) and clears it (``shutdown``)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Optional

from ..core.errors import NOT_INITIALIZED, HvpsError, NotInitializedError
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
        #: the pid of the process that ran ``init``, in a child forked after it (None elsewhere)
        self.forked_from: Optional[int] = None

    def after_fork_in_child(self) -> None:
        """The child has a copy of the engine but not its thread, and shares the parent's control
        connection: from now on it must never submit anything (see ``engine``)."""
        self.lock = threading.Lock()  # the parent may have held it at the fork
        if self.engine is not None and self.forked_from is None:
            self.forked_from = os.getppid()


_state = _State()
os.register_at_fork(after_in_child=_state.after_fork_in_child)


def forked() -> bool:
    """Whether this process is a child forked after ``init`` (hvps refuses to run collectives in it)."""
    return _state.forked_from is not None


def forked_error() -> HvpsError:
    return HvpsError(
        f"hvps cannot be used in a child process forked after init (this is pid {os.getpid()}; rank "
        f"{_state.topology.rank if _state.topology else '?'} is pid {_state.forked_from}): run collectives in the "
        "process that called hvps.init(), and start helper processes with multiprocessing's 'spawn' or "
        "'forkserver' method if they must use hvps")


def is_initialized() -> bool:
    """Whether ``init`` has run and ``shutdown`` has not.

    Returns:
        True between ``init()`` and ``shutdown()``.
    """
    return _state.engine is not None


def engine():
    """The running engine; raises HvpsError before ``init``."""
    current = _state.engine
    if current is None:
        raise NotInitializedError(NOT_INITIALIZED)
    if _state.forked_from is not None:
        raise forked_error()
    return current


def step_done() -> None:
    """Tell hvps that a training step ended (the framework adapters' optimizers call it; call it
    yourself from a custom loop to let ``HVPS_AUTOTUNE=1`` measure steps). A no-op before ``init``."""
    current = _state.engine
    if current is not None:
        current.step_done()


def autotune_report() -> Optional[dict]:
    """What ``HVPS_AUTOTUNE=1`` tried and chose, on rank 0.

    Returns:
        ``{"done", "chosen": {"fusion_threshold", "cycle_time_ms"} or None, "warmup_steps", "steps_per_sample",
        "samples": [...]}`` (JSON-ready); None on the other ranks, or when autotuning is off.

    Raises:
        NotInitializedError: before ``init()`` (an ``HvpsError``).
    """
    tuner = engine().autotuner
    return None if tuner is None else tuner.report()


def topology() -> Topology:
    current = _state.topology
    if current is None:
        raise NotInitializedError(NOT_INITIALIZED)
    return current


def settings() -> Settings:
    """The settings the engine was started with."""
    engine()
    return _state.settings


def rank() -> int:
    """This process's rank in the job.

    Returns:
        0 to ``size() - 1``.

    Raises:
        NotInitializedError: before ``init()`` (an ``HvpsError``).
    """
    return topology().rank


def size() -> int:
    """The number of processes in the job.

    Returns:
        The job's rank count (1 for a script run alone).

    Raises:
        NotInitializedError: before ``init()`` (an ``HvpsError``).
    """
    return topology().size


def local_rank() -> int:
    """This process's rank among the processes on its node.

    Returns:
        0 to ``local_size() - 1`` (the GPU to pin, one per process).

    Raises:
        NotInitializedError: before ``init()`` (an ``HvpsError``).
    """
    return topology().local_rank


def local_size() -> int:
    """The number of processes on this node.

    Returns:
        This node's rank count (``HVPS_LOCAL_SIZE`` overrides discovery).

    Raises:
        NotInitializedError: before ``init()`` (an ``HvpsError``).
    """
    return topology().local_size


def cross_rank() -> int:
    """The index of this node among nodes (this process's rank among same-local-rank peers).

    Returns:
        0 to ``cross_size() - 1``.

    Raises:
        NotInitializedError: before ``init()`` (an ``HvpsError``).
    """
    return topology().cross_rank


def cross_size() -> int:
    """The number of nodes (processes that share this local rank).

    Returns:
        The count of processes whose ``local_rank()`` is this one's.

    Raises:
        NotInitializedError: before ``init()`` (an ``HvpsError``).
    """
    return topology().cross_size


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline to ``file_path`` (rank 0 writes it; Horovod's API).

    Args:
        file_path: the JSON file rank 0 writes (open it in ``chrome://tracing`` or Perfetto).
        mark_cycles: also mark each engine cycle with an instant ``CYCLE_START`` event.

    Raises:
        NotInitializedError: before ``init()`` (an ``HvpsError``).
    """
    engine().start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop writing the timeline started by ``start_timeline`` (or ``HVPS_TIMELINE``)."""
    engine().stop_timeline()


def is_homogeneous() -> bool:
    """Whether every node runs the same number of ranks (judged from this rank's view of the topology).

    Returns:
        True when ``local_size() * cross_size() == size()``.

    Raises:
        NotInitializedError: before ``init()`` (an ``HvpsError``).
    """
    current = topology()
    return current.local_size * current.cross_size == current.size
