"""Process sets: collectives on a subset of the ranks, with Horovod's API.

A set is registered on every rank, in the same order (``init(process_sets=[...])`` or, with
``HOROVOD_DYNAMIC_PROCESS_SETS=1`` / ``HVPS_DYNAMIC_PROCESS_SETS=1``, ``add_process_set``
later). Registration is negotiated like a collective on the global set, and its members then
build a data plane of their own over just those ranks (``Comm.Create_group`` on MPI, a
sub-group on torch.distributed), so collectives of disjoint sets run side by side.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from ..control.negotiation import ADD_SET, GLOBAL_SET, REMOVE_SET, Request
from ..core.settings import env_text
from ..dataplane.executors import Entry
from . import state as runtime


class ProcessSet:
    """A subset of the ranks that collectives may be restricted to (``process_set=``).

    Built from a list of global ranks (or an mpi4py communicator over some of the job's ranks);
    usable once registered.
    """

    def __init__(self, ranks_or_comm: Any = None) -> None:
        #: None until registered; 0 for the global set
        self.process_set_id: Optional[int] = None
        self._ranks: Optional[list] = None
        if ranks_or_comm is not None:
            self._ranks = _ranks_of(ranks_or_comm)

    @property
    def ranks(self) -> list:
        """The global ranks in this set, ascending."""
        if self._ranks is None:  # the global set before init
            return list(range(runtime.size()))
        return list(self._ranks)

    def size(self) -> int:
        """The number of ranks in the set."""
        return len(self.ranks)

    def rank(self) -> int:
        """This process's index within the set (-1 when it is not a member)."""
        ranks = self.ranks
        me = runtime.rank()
        return ranks.index(me) if me in ranks else -1

    def included(self) -> bool:
        """Whether this process belongs to the set."""
        return runtime.rank() in self.ranks

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ProcessSet) and self.process_set_id == other.process_set_id
                and self.process_set_id is not None) or self is other

    def __hash__(self) -> int:
        return hash(self.process_set_id) if self.process_set_id is not None else id(self)

    def __repr__(self) -> str:
        ranks = "all" if self._ranks is None else self._ranks
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={ranks})"


def _ranks_of(ranks_or_comm: Any) -> list:
    if hasattr(ranks_or_comm, "Get_group"):  # an mpi4py communicator: its members' global ranks
        from mpi4py import MPI

        local = ranks_or_comm.Get_group()
        world = MPI.COMM_WORLD.Get_group()
        try:
            return sorted(MPI.Group.Translate_ranks(local, list(range(local.Get_size())), world))
        finally:
            local.Free()
            world.Free()
    ranks = [int(r) for r in ranks_or_comm]
    if sorted(set(ranks)) != sorted(ranks):
        raise ValueError(f"process set ranks {ranks} contain duplicates")
    return sorted(ranks)


#: every rank; its id is 0 from init on
global_process_set = ProcessSet()
global_process_set.process_set_id = GLOBAL_SET


class _Registry:
    def __init__(self) -> None:
        self.sets: dict = {GLOBAL_SET: global_process_set}
        self.next_id = 1
        self.static_only = False

    def reset(self) -> None:
        for process_set in self.sets.values():
            if process_set is not global_process_set:
                process_set.process_set_id = None
        self.__init__()


_registry = _Registry()


def _dynamic_allowed() -> bool:
    return (os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0") not in ("", "0")
            or env_text("HVPS_DYNAMIC_PROCESS_SETS", "0") != "0")


def resolve(process_set: Optional[ProcessSet]) -> tuple:
    """``(set id, its ranks)`` for a collective on ``process_set`` (None: global), checked on this rank.

    Raises ValueError, before anything is submitted, when the set is not registered or this
    rank is not one of its members.
    """
    if process_set is None or process_set is global_process_set:
        return GLOBAL_SET, tuple(range(runtime.size()))
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, not {type(process_set).__name__}")
    if process_set.process_set_id is None or _registry.sets.get(process_set.process_set_id) is None:
        raise ValueError(f"{process_set!r} is not registered: pass it to init(process_sets=...) or add_process_set()")
    ranks = tuple(process_set.ranks)
    if runtime.rank() not in ranks:
        raise ValueError(f"rank {runtime.rank()} is not a member of {process_set!r}; only its members may call "
                         "collectives on it")
    return process_set.process_set_id, ranks


def _negotiate(kind: str, set_id: int, ranks: Sequence[int]) -> None:
    request = Request(f"{kind}.{set_id}", kind, root=set_id, splits=tuple(ranks))
    runtime.engine().submit(Entry(request, [])).wait()


def register(process_set: Any) -> ProcessSet:
    """Register ``process_set`` (a ProcessSet or a list of ranks) on every rank (collective)."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set!r} is already registered")
    backend = runtime.engine().backend
    if not backend.supports_process_sets:  # refused alike on every rank, before negotiating
        raise NotImplementedError(f"the {backend.name} data plane does not support process sets; "
                                  "use HVPS_BACKEND=mpi or tdist")
    size = runtime.size()
    ranks = process_set.ranks
    if not ranks or ranks[0] < 0 or ranks[-1] >= size:
        raise ValueError(f"process set ranks {ranks} must be a non-empty subset of 0..{size - 1}")
    set_id = _registry.next_id
    _registry.next_id += 1  # taken on every rank alike, even if the negotiation below fails
    _negotiate(ADD_SET, set_id, ranks)
    process_set.process_set_id = set_id
    _registry.sets[set_id] = process_set
    return process_set


def add_process_set(process_set: Any) -> ProcessSet:
    """Add a process set after ``init`` (collective: every rank calls it, in the same order).

    Needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` (or ``HVPS_DYNAMIC_PROCESS_SETS=1``), as in Horovod.
    Returns the registered ProcessSet.
    """
    runtime.engine()
    if not _dynamic_allowed():
        raise ValueError("add_process_set() after init needs HOROVOD_DYNAMIC_PROCESS_SETS=1; or pass the sets "
                         "to init(process_sets=[...])")
    return register(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Remove a process set added before (collective). Returns whether it was registered."""
    runtime.engine()
    if not _dynamic_allowed():
        raise ValueError("remove_process_set() needs HOROVOD_DYNAMIC_PROCESS_SETS=1")
    set_id = process_set.process_set_id
    if set_id is None or set_id == GLOBAL_SET or set_id not in _registry.sets:
        return False
    _negotiate(REMOVE_SET, set_id, process_set.ranks)
    del _registry.sets[set_id]
    process_set.process_set_id = None
    return True


def setup(process_sets: Optional[Sequence[Any]]) -> list:
    """At ``init``: forget earlier sets and register the static ones (collective)."""
    _registry.reset()
    return [register(ps) for ps in process_sets or ()]


def reset() -> None:
    """At ``shutdown``: every set but the global one becomes unregistered."""
    _registry.reset()
