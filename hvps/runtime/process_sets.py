"""Process sets: collectives on a subset of the ranks, with Horovod's API and rules.

A set is registered on every rank, with the same id everywhere:

- **static** sets, by the first ``init(process_sets=[...])`` of a job: lists of ranks, or mpi4py
  communicators over some of the job's ranks (``ProcessSet(MPI.COMM_WORLD.Split(...))``: each
  communicator stands for every distinct group it has on the ranks, as in Horovod). Every rank must
  ask for the same sets; the ranks compare their lists before anything is registered, so a set with
  a rank outside the job, an empty set, or lists that differ across ranks raise the same ValueError,
  naming the ranks, on every rank. Ids are given in Horovod's order: the communicators' groups first
  (sorted), then the lists of ranks, duplicates once. A later ``init`` (hvps already running)
  registers nothing: it gives the ProcessSets it is passed the ids of the sets they match.
- **dynamic** sets, with ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` (or ``HVPS_DYNAMIC_PROCESS_SETS=1``, or
  ``init(process_sets="dynamic")``): ``add_process_set`` / ``remove_process_set``, collective calls
  made by every rank in the same order. A removed set's id is reused, oldest first (Horovod's queue).

A duplicate (a set of the same ranks as one registered before it, the global set included) is a
ValueError, as in Horovod; at ``init`` it is raised after the other sets are registered, so hvps is
running and a later ``init`` with the duplicate left out goes on from there.

Registration is negotiated like a collective on the global set, and its members then build a data
plane of their own over just those ranks (``Comm.Create_group`` on MPI, a sub-group on
torch.distributed), so collectives of disjoint sets run side by side.
"""

from __future__ import annotations

import numbers
from collections import deque
from typing import Any, Optional, Sequence

from ..control.negotiation import ADD_SET, GLOBAL_SET, REMOVE_SET, Request
from ..core.errors import HvpsError
from ..core.settings import env_text
from ..dataplane.executors import Entry
from . import state as runtime


def _is_comm(value: Any) -> bool:
    """Whether ``value`` is an mpi4py communicator (without importing mpi4py for anyone else)."""
    return hasattr(value, "Get_group") and hasattr(value, "Get_size")


class ProcessSet:
    """A subset of the ranks that collectives may be restricted to (``process_set=``).

    Built from global ranks (any order; duplicates refused) or from an mpi4py communicator over some of
    the job's ranks (its members' ranks are known once ``init`` registers it). Usable once registered.
    """

    def __init__(self, ranks_or_comm: Any = None) -> None:
        """Args:
            ranks_or_comm: an iterable of global ranks (integers), or an mpi4py communicator; None for
                the global set only.

        Raises:
            ValueError: a rank that is not an integer, or a rank given twice.
        """
        #: None until registered; 0 for the global set
        self.process_set_id: Optional[int] = None
        #: the communicator the set was built from (the global set's: the one given to ``init``), else None
        self.mpi_comm: Any = None
        self._ranks: Optional[list] = None
        if _is_comm(ranks_or_comm):
            self.mpi_comm = ranks_or_comm
        elif ranks_or_comm is not None:
            self._ranks = _checked_ranks(ranks_or_comm)

    @property
    def ranks(self) -> Optional[list]:
        """The global ranks in this set, ascending (None for a communicator's set before ``init``)."""
        if self is global_process_set:
            return list(range(runtime.size()))
        return None if self._ranks is None else list(self._ranks)

    def size(self) -> Optional[int]:
        """The number of ranks in the set.

        Returns:
            The count, or None for a communicator's set before ``init``.
        """
        ranks = self.ranks
        return None if ranks is None else len(ranks)

    def rank(self) -> Optional[int]:
        """This process's index within the set.

        Returns:
            Its index among the set's ranks (ascending), -1 when it is not a member, None when not known yet
            (a communicator's set before ``init``).
        """
        ranks = self.ranks
        if ranks is None:
            return None
        me = runtime.rank()
        return ranks.index(me) if me in ranks else -1

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set.

        Returns:
            True or False; None for a communicator's set before ``init``.
        """
        ranks = self.ranks
        return None if ranks is None else runtime.rank() in ranks

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ProcessSet) and self.process_set_id == other.process_set_id
                and self.process_set_id is not None) or self is other

    def __hash__(self) -> int:
        return hash(self.process_set_id) if self.process_set_id is not None else id(self)

    def __repr__(self) -> str:
        ranks = self._ranks
        if self is global_process_set:
            ranks = list(range(runtime.size())) if runtime.is_initialized() else []
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={ranks}, mpi_comm={self.mpi_comm})"


def _checked_ranks(ranks: Any) -> list:
    """``ranks`` as an ascending list of ints; ValueError for a non-integer or a repeated rank."""
    try:
        ranks = list(ranks)
    except TypeError:
        raise ValueError(f"a ProcessSet takes a list of ranks or an mpi4py communicator, not "
                         f"{type(ranks).__name__}") from None
    bad = [r for r in ranks if not isinstance(r, numbers.Integral) or isinstance(r, bool)]
    if bad:
        raise ValueError(f"process set ranks must be integers; got {bad!r}")
    ranks = sorted(int(r) for r in ranks)
    repeated = sorted({r for r in ranks if ranks.count(r) > 1})
    if repeated:
        raise ValueError(f"process set ranks {ranks} name ranks {repeated} more than once")
    return ranks


#: every rank; its id is 0 from init on
global_process_set = ProcessSet()
global_process_set.process_set_id = GLOBAL_SET


class _Registry:
    """The sets registered on this rank (the same on every rank): id -> the ProcessSet that holds it."""

    def __init__(self) -> None:
        self.sets: dict = {GLOBAL_SET: global_process_set}
        self.next_id = 1
        #: ids of removed sets, reused oldest first (Horovod's ProcessSetTable)
        self.free_ids: deque = deque()
        #: process set id -> the engine's id for it, never reused (so that nothing the engine keeps per
        #: set, such as cached responses or the names of unnamed collectives, outlives the set)
        self.engine_ids: dict = {GLOBAL_SET: GLOBAL_SET}
        self.next_engine_id = 1

    def reset(self) -> None:
        for process_set in self.sets.values():
            if process_set is not global_process_set:
                process_set.process_set_id = None
        self.__init__()

    def take_id(self) -> int:
        if self.free_ids:
            return self.free_ids.popleft()
        self.next_id += 1
        return self.next_id - 1

    def find(self, ranks: Sequence[int]) -> Optional[int]:
        """The id of the registered set of exactly ``ranks`` (ascending), or None."""
        ranks = list(ranks)
        for set_id, process_set in self.sets.items():
            if process_set.ranks == ranks:
                return set_id
        return None


_registry = _Registry()


def _dynamic_allowed() -> bool:
    return env_text("HVPS_DYNAMIC_PROCESS_SETS", "0") not in ("", "0")  # HOROVOD_* through the alias table


def resolve(process_set: Optional[ProcessSet]) -> tuple:
    """``(the engine's id for the set, its ranks)`` for a collective on ``process_set`` (None: global),
    checked on this rank.

    Raises:
        TypeError: ``process_set`` is not a ProcessSet.
        ValueError: the set is not registered, or this rank is not one of its members (before anything
            is submitted; the TensorFlow adapter raises it as ``tf.errors.InvalidArgumentError`` too).
    """
    if process_set is None or process_set is global_process_set:
        return GLOBAL_SET, tuple(range(runtime.size()))
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, not {type(process_set).__name__}")
    registered = _registry.sets.get(process_set.process_set_id) if process_set.process_set_id is not None else None
    if registered is None:
        raise ValueError(f"{process_set!r} is not registered: pass it to init(process_sets=...) or add_process_set()")
    ranks = tuple(registered.ranks)
    if runtime.rank() not in ranks:
        raise ValueError(f"rank {runtime.rank()} is not a member of {registered!r}; only its members may call "
                         "collectives on it")
    return _registry.engine_ids[process_set.process_set_id], ranks


def _negotiate(kind: str, engine_id: int, ranks: Sequence[int]) -> None:
    """Agree on a set's change with every rank (a collective on the global set) and apply it.

    Raises:
        ValueError: the ranks asked for different changes (the negotiation names them).
    """
    request = Request(f"{kind}.{engine_id}", kind, root=engine_id, splits=tuple(ranks))
    try:
        runtime.engine().submit(Entry(request, [])).wait()
    except HvpsError as err:
        from ..metrics.instruments import error_kind  # here: it imports prometheus_client, which metrics-off jobs never load

        if error_kind(str(err)) == "mismatch":  # the ranks disagree on the set: an argument error
            raise ValueError(str(err)) from None
        raise


def _register(ranks: Sequence[int], process_set: Optional[ProcessSet] = None) -> ProcessSet:
    """Register the set of ``ranks`` (checked, not registered yet) on every rank (collective)."""
    backend = runtime.engine().backend
    if not backend.supports_process_sets:  # refused alike on every rank, before negotiating
        raise NotImplementedError(f"the {backend.name} data plane does not support process sets; "
                                  "use HVPS_BACKEND=mpi or tdist")
    if process_set is None:
        process_set = ProcessSet(ranks)
    set_id, engine_id = _registry.take_id(), _registry.next_engine_id  # taken on every rank alike
    _registry.next_engine_id += 1
    try:
        _negotiate(ADD_SET, engine_id, ranks)
    except ValueError:  # refused on every rank alike (the ranks disagree): the id is free again
        _registry.free_ids.appendleft(set_id)
        raise
    process_set.process_set_id = set_id
    _registry.sets[set_id] = process_set
    _registry.engine_ids[set_id] = engine_id
    return process_set


def _outside(ranks: Sequence[int], size: int) -> list:
    return [r for r in ranks if r < 0 or r >= size]


def add_process_set(process_set: Any) -> ProcessSet:
    """Add a process set after ``init`` (collective: every rank calls it, in the same order).

    Needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` (or ``HVPS_DYNAMIC_PROCESS_SETS=1``), as in Horovod.

    Args:
        process_set: a ProcessSet built from ranks, or a list of ranks.

    Returns:
        The registered ProcessSet (``process_set`` itself when it was one).

    Raises:
        ValueError: dynamic sets are off; the set is already registered, empty, has ranks outside the
            job, or duplicates a registered set; or the ranks asked for different sets.
        NotImplementedError: a set built from an MPI communicator (as in Horovod), or a data plane
            without process sets.
    """
    runtime.engine()
    if not _dynamic_allowed():
        raise ValueError("add_process_set() after init needs HOROVOD_DYNAMIC_PROCESS_SETS=1; or pass the sets "
                         "to init(process_sets=[...])")
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.mpi_comm is not None and process_set._ranks is None:
        raise NotImplementedError("add_process_set() of a set built from an MPI communicator is not supported (as "
                                  "in Horovod); build it from the list of ranks")
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set!r} is already registered")
    ranks, size = process_set.ranks, runtime.size()
    if not ranks or _outside(ranks, size):
        raise ValueError(f"add_process_set({ranks}): a process set needs at least one rank, all of them in "
                         f"0..{size - 1}; ranks {_outside(ranks, size)} are outside the job")
    existing = _registry.find(ranks)
    if existing is not None:
        raise ValueError(f"add_process_set({ranks}) duplicates the registered {_registry.sets[existing]!r}")
    return _register(ranks, process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Remove a process set added before (collective: every rank calls it, in the same order).

    Args:
        process_set: a registered ProcessSet (the global set is never removed).

    Returns:
        Whether it was registered (and is now removed; its object is unregistered).

    Raises:
        ValueError: dynamic sets are off, or the ranks asked to remove different sets.
    """
    runtime.engine()
    if not _dynamic_allowed():
        raise ValueError("remove_process_set() needs HOROVOD_DYNAMIC_PROCESS_SETS=1")
    set_id = process_set.process_set_id
    if set_id is None or set_id == GLOBAL_SET or set_id not in _registry.sets:
        return False
    registered = _registry.sets[set_id]
    _negotiate(REMOVE_SET, _registry.engine_ids[set_id], registered.ranks)
    del _registry.sets[set_id]
    del _registry.engine_ids[set_id]
    _registry.free_ids.append(set_id)
    registered.process_set_id = None
    process_set.process_set_id = None
    return True


# -- init ----------------------------------------------------------------------------------------------
def request_of(process_sets: Optional[Sequence[Any]], world: Any) -> dict:
    """What this rank asks ``init`` to register, in a form the ranks exchange before registering.

    Args:
        process_sets: ``init``'s argument (ProcessSets, lists of ranks, or None).
        world: the communicator hvps runs on (communicators' groups are translated to its ranks).

    Returns:
        ``{"comms": [this rank's group of each communicator set], "ranks": [each list of ranks],
        "error": why this rank's list cannot be read, or ""}``.
    """
    comms: list = []
    lists: list = []
    try:
        for process_set in _as_sets(process_sets):
            if process_set._ranks is not None:
                lists.append(list(process_set._ranks))
            elif process_set.mpi_comm is not None:
                comms.append(_group_ranks(process_set.mpi_comm, world))
    except (TypeError, ValueError) as err:
        return {"comms": [], "ranks": [], "error": str(err)}
    return {"comms": comms, "ranks": lists, "error": ""}


def _as_sets(process_sets: Optional[Sequence[Any]]) -> list:
    if process_sets is None:
        return []
    if isinstance(process_sets, (str, bytes)) or not hasattr(process_sets, "__iter__"):
        raise ValueError(f"process_sets must be a list of ProcessSets (or 'dynamic'), not {process_sets!r}")
    return [ps if isinstance(ps, ProcessSet) else ProcessSet(ps) for ps in process_sets]


def _group_ranks(comm: Any, world: Any) -> list:
    """The ranks on ``world`` of the members of ``comm`` (this rank's group), ascending."""
    from mpi4py import MPI

    if not isinstance(world, MPI.Comm):
        raise ValueError("a ProcessSet built from an MPI communicator needs hvps running on MPI (mpirun, srun), "
                         "not on hvpsrun --gloo's or torchrun's rendezvous; build it from a list of ranks")
    group, world_group = comm.Get_group(), world.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world_group)
    finally:
        group.Free()
        world_group.Free()
    if any(r == MPI.UNDEFINED for r in ranks):
        raise ValueError(f"a ProcessSet's MPI communicator (size {comm.Get_size()}) has members outside the "
                         "communicator hvps runs on")
    return sorted(ranks)


def plan(requests: Sequence[dict], size: int) -> list:
    """The sets to register, in id order, from every rank's :func:`request_of` (the same on every rank).

    Args:
        requests: every rank's request, in rank order.
        size: the number of ranks in the job.

    Returns:
        Lists of ranks, ascending, none of them the global set's, each once.

    Raises:
        ValueError: naming the ranks: a request that could not be read, an empty set, a rank outside
            the job, or sets that differ across ranks.
    """
    errors = [f"rank {r}: {req['error']}" for r, req in enumerate(requests) if req["error"]]
    if errors:
        raise ValueError("init(process_sets=...) failed on " + "; ".join(errors))
    bad: dict = {}
    for r, req in enumerate(requests):
        for ranks in req["ranks"]:
            if not ranks or _outside(ranks, size):
                bad.setdefault(tuple(ranks), []).append(r)
    if bad:
        detail = "; ".join(f"{list(ranks) or 'an empty set'} (given by ranks {givers}"
                           + (f"; ranks {_outside(ranks, size)} are outside the job" if ranks else "") + ")"
                           for ranks, givers in bad.items())
        raise ValueError(f"init(process_sets=...): every process set needs at least one rank, all of them in "
                         f"0..{size - 1}: {detail}")
    counts = {len(req["comms"]) for req in requests}
    if len(counts) > 1:
        raise ValueError("init(process_sets=...) differs across ranks: " + _who_passed(
            requests, lambda req: f"{len(req['comms'])} sets built from MPI communicators"))
    from_comms: list = []
    for i in range(counts.pop() if counts else 0):
        from_comms += sorted({tuple(req["comms"][i]) for req in requests})
    everyone = tuple(range(size))
    chosen = [_unique([*from_comms, *map(tuple, req["ranks"])], everyone) for req in requests]
    if any(c != chosen[0] for c in chosen):
        raise ValueError("init(process_sets=...) differs across ranks: " + _who_passed(
            requests, lambda req: f"{req['ranks']}"))
    return [list(ranks) for ranks in chosen[0]] if chosen else []


def _unique(sets: list, everyone: tuple) -> list:
    out: list = []
    for ranks in sets:
        if ranks != everyone and ranks not in out:
            out.append(ranks)
    return out


def _who_passed(requests: Sequence[dict], what) -> str:
    groups: dict = {}
    for r, req in enumerate(requests):
        groups.setdefault(what(req), []).append(r)
    return "; ".join(f"ranks {ranks} passed {text}" for text, ranks in groups.items())


def setup(to_register: Sequence[Sequence[int]]) -> None:
    """At the first ``init``: forget earlier sets and register ``to_register`` (from :func:`plan`; collective)."""
    _registry.reset()
    for ranks in to_register:
        _register(ranks)


def attach(process_sets: Optional[Sequence[Any]], world: Any = None) -> None:
    """Give each ProcessSet passed to ``init`` the id of the registered set of its ranks (this rank only).

    Args:
        process_sets: ``init``'s argument.
        world: the communicator hvps runs on (None: ``MPI.COMM_WORLD``), for sets built from communicators.

    Raises:
        ValueError: a set that is not registered (sets are registered by a job's first ``init``), or a
            duplicate: the same ranks as the global set or as an earlier entry (that entry keeps its id;
            the duplicate gets none).
    """
    if process_sets is None or isinstance(process_sets, str):
        return
    if world is None and any(isinstance(ps, ProcessSet) and ps.mpi_comm is not None for ps in process_sets):
        from mpi4py import MPI

        world = MPI.COMM_WORLD
    seen = {GLOBAL_SET: "the global process set"}
    duplicates: list = []
    for number, process_set in enumerate(process_sets):
        if not isinstance(process_set, ProcessSet):
            continue  # a plain list of ranks: registered, but there is no object to give its id to
        if process_set is global_process_set or (process_set._ranks is None and process_set.mpi_comm is None):
            ranks = list(range(runtime.size()))
        elif process_set._ranks is not None:
            ranks = process_set._ranks
        else:
            ranks = _group_ranks(process_set.mpi_comm, world)
        set_id = _registry.find(ranks)
        if set_id is None:
            raise ValueError(f"init(process_sets=...) entry {number}, ranks {ranks}, is not registered: hvps was "
                             "already running, and only a job's first init registers sets; use add_process_set()")
        if process_set is global_process_set:
            duplicates.append(f"entry {number} is the global process set, which every job has")
            continue
        process_set._ranks = list(ranks)
        if set_id in seen:
            process_set.process_set_id = None
            duplicates.append(f"entry {number} (ranks {ranks}) duplicates {seen[set_id]}")
            continue
        seen[set_id] = f"entry {number}"
        process_set.process_set_id = set_id
    if duplicates:
        raise ValueError("init(process_sets=...): " + "; ".join(duplicates) + " (hvps is running with the other "
                         "sets; call init again without the duplicates)")


def ids_and_ranks() -> dict:
    """Every registered set: ``{process set id: its ranks}`` (Horovod's ``_get_process_set_ids_and_ranks``)."""
    runtime.engine()
    return {set_id: list(ps.ranks) for set_id, ps in sorted(_registry.sets.items())}


def reset() -> None:
    """At ``shutdown``: every set but the global one becomes unregistered."""
    _registry.reset()
    global_process_set.mpi_comm = None
