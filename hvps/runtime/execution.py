"""The engine's executor: it runs the responses every rank agreed on, in their order, on this rank's data
planes (one ``Context`` per process set it belongs to), and gives each handle its result or error."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Optional, Protocol

from .. import metrics as _metrics
from ..control.negotiation import (ADD_SET, ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, GLOBAL_SET, JOIN, REDUCESCATTER,
                                   REMOVE_SET, SHUTDOWN)
from ..core import arrays
from ..core.dtypes import ReduceOp
from ..core.errors import DataPlaneStall, HvpsError
from ..core.timeline import Timeline
from ..dataplane.buffers import FusionBuffer
from ..dataplane.executors import EXECUTORS, Context, Entry
from .engine_status import EngineStatus

log = logging.getLogger("hvps")


class PendingEntries(Protocol):
    """What the executor needs of the submission queue (``SubmissionQueue``)."""

    def pending_entry(self, name: str) -> Optional[Entry]: ...

    def take_pending(self, names: list) -> list: ...

    def forget_abandoned(self, names: list) -> bool: ...


class Executor:
    """Executes agreed responses: collectives on their process set's data plane, process-set changes, join
    and shutdown, and the errors the coordinator sent."""

    def __init__(self, rank: int, size: int, backend, status: EngineStatus, entries: PendingEntries,
                 find_the_lost: Callable[[str, bool], None], fail_all: Callable[[object], None],
                 set_changed: Callable[[object], None], fusion_threshold: Callable[[], int]) -> None:
        """``find_the_lost(what, stall)`` names the ranks behind a failed transfer (``losses.py``);
        ``fail_all(error)`` fails every collective in flight; ``set_changed(response)`` is told of every agreed
        process-set change first; ``fusion_threshold()`` is the threshold in force (for the metrics)."""
        self.rank, self.size = rank, size
        self.backend = backend
        self._status = status
        self._entries = entries
        self._find_the_lost = find_the_lost
        self._fail_all = fail_all
        self._set_changed = set_changed
        self._fusion_threshold = fusion_threshold
        #: process set id -> Context, for the sets this rank belongs to
        self.contexts = {GLOBAL_SET: Context(backend, rank, size, fusion=FusionBuffer())}
        #: agreed responses not yet executed, in order (a waiter left one too large for it)
        self.backlog: deque = deque()
        #: the entries of the response being executed (taken out of the pending ones): a dead rank fails them too
        self.running: list = []
        #: whether the thread in a cycle is a waiter (it runs only what the backend can abandon at once)
        self.on_waiter = False
        #: collectives that a waiting thread executed itself (the fast path)
        self.driven_collectives = 0
        #: where the collectives are traced (rank 0, while a timeline is on)
        self.timeline: Optional[Timeline] = None

    def execute(self, responses: list) -> None:
        """Run ``responses`` after any left from before, in order; a waiter leaves the first one its
        backend could not abandon at once to the engine thread (``FastPath.drive``)."""
        self.backlog.extend(responses)
        while self.backlog:
            if self._status.failure is not None:  # a rank died meanwhile: every handle has its error
                return
            response = self.backlog[0]
            if self.on_waiter and not self.waiter_may_run(response):
                return
            self.backlog.popleft()
            entries = self._entries.take_pending(response.names)
            self.running = [entry for entry in entries if entry is not None]
            if response.error:
                self._report_error(response, entries)
            elif response.kind in (ADD_SET, REMOVE_SET):
                self._change_sets(response, entries)
            elif response.kind in (JOIN, SHUTDOWN):
                self._status.stopping = self._status.stopping or response.kind == SHUTDOWN
                if response.kind == SHUTDOWN and self.rank not in response.asked:
                    self.ended_by_others(response.asked)
                for entry in entries:
                    if entry is not None:
                        entry.handle.set_result(response.last_joined if response.kind == JOIN else None)
            else:
                self.driven_collectives += self.on_waiter
                self._run_collective(response, entries)
        self.running = []

    def ended_by_others(self, asked: list) -> None:
        """Ranks ``asked`` shut hvps down and this rank did not follow within the stall time: hvps ends here
        too (Horovod's rule), and every collective of this rank, in flight or to come, fails saying so."""
        self._status.ended = HvpsError(
            f"hvps was shut down: ranks {asked} called hvps.shutdown() (or their scripts ended) and rank "
            f"{self.rank} did not follow within the stall time, so hvps ended on every rank; every rank must "
            "submit the same collectives and shut down at the same point (check for rank-dependent control "
            "flow), or call hvps.init() again")
        log.error("hvps rank %d: %s", self.rank, self._status.ended)
        self._fail_all(self._status.ended)

    def waiter_may_run(self, response) -> bool:
        """Whether a waiting user thread may execute ``response``: negotiation-only kinds, and collectives
        small enough that the backend abandons them at once when a rank dies (never a hang in user code)."""
        if response.error or response.kind in (JOIN, SHUTDOWN):
            return True
        if response.kind in (ADD_SET, REMOVE_SET):
            return False  # building or freeing a process set's communicators may block
        context = self.contexts.get(response.requests[0].process_set)
        if context is None:
            return True
        limit = context.backend.interruptible_bytes_for(_backend_method(response))
        nbytes = 0
        for name in response.names:
            entry = self._entries.pending_entry(name)
            if entry is None:
                return False  # joined: zeros of the agreed shapes, sized elsewhere
            for array in entry.inputs:
                if arrays.device_of(array) != "cpu":  # a device's transfer is abandoned by no backend
                    return False
                nbytes += array.nbytes
        return nbytes * (context.size if response.kind == ALLGATHER else 1) <= limit

    def _change_sets(self, response, entries: list) -> None:
        """Build (or free) the data plane of an agreed process set, on its members only."""
        req = response.requests[0]
        self._set_changed(response)
        try:
            if response.kind == ADD_SET and self.rank in req.splits:
                ranks = tuple(req.splits)
                backend = self.backend if len(ranks) == self.size else self.backend.subset(ranks)
                self.contexts[req.root] = Context(backend, ranks.index(self.rank), len(ranks), ranks,
                                                  self.contexts[GLOBAL_SET].fusion)
            elif response.kind == REMOVE_SET:
                context = self.contexts.pop(req.root, None)
                if context is not None and context.backend is not self.backend:
                    context.backend.close()
        except Exception as exc:
            for entry in entries:
                if entry is not None:
                    entry.handle.set_error(exc)
            raise
        for entry in entries:
            if entry is not None:
                entry.handle.set_result(req.root)

    def _run_collective(self, response, entries: list) -> None:
        context = self.contexts.get(response.requests[0].process_set)
        if context is None:  # a set this rank is not in: its members run it
            return
        started = time.monotonic()
        for entry in entries:
            if entry is not None:
                entry.handle.mark_started()
        try:
            with context.backend.ordered(entries):
                results = EXECUTORS[response.kind](context, response, entries)
        except Exception as exc:
            # Ranks may now disagree on which messages are in flight: nothing after
            # this can be trusted, so the engine stops (the exception goes on up) and says why. A failed
            # transfer is most often a dead or stopped peer, which the data plane notices without naming it:
            # the control plane's word on which rank died or stopped (``find_the_lost``) is the error to give.
            names = ", ".join(sorted({e.request.name for e in entries if e is not None})) or response.kind
            self._find_the_lost(f"{response.kind} {names!r}: {exc}", isinstance(exc, DataPlaneStall))
            error = exc
            if not isinstance(exc, HvpsError):  # Horovod's HorovodInternalError: what hvd.elastic.run retries
                error = HvpsError(f"hvps: {response.kind} {names!r} failed in the data plane: {exc}")
                error.__cause__ = exc
            for entry in entries:
                if entry is not None:
                    entry.handle.set_error(error)
            raise
        timeline = self.timeline
        if timeline is not None:
            _trace(timeline, response, entries, started)
        for entry, result in zip(entries, results):
            if entry is not None:
                entry.handle.set_result(result)
        _metrics.on_collective(response, entries, started, self._fusion_threshold())

    def _report_error(self, response, entries: list) -> None:
        mine = [e for e in entries if e is not None]
        _metrics.on_collective_error(response.error, bool(mine))
        if not self._entries.forget_abandoned(response.names) and not mine:
            log.warning("rank %d: %s", self.rank, response.error)
        for entry in mine:
            entry.handle.set_error(HvpsError(response.error))


#: the backend method each kind of collective calls (Adasum's allreduce exchanges halves point to point)
_ADASUM = ReduceOp.Adasum.value
_BACKEND_METHODS = {ALLREDUCE: "allreduce", ALLGATHER: "allgatherv", BROADCAST: "broadcast", ALLTOALL: "alltoallv",
                    REDUCESCATTER: "reducescatter"}


def _backend_method(response) -> str:
    """The name of the ``Backend`` method that executing ``response`` calls (``""``: none)."""
    if response.kind == ALLREDUCE and response.requests[0].op == _ADASUM:
        return "sendrecv"
    return _BACKEND_METHODS.get(response.kind, "")


def _trace(timeline: Timeline, response, entries: list, started: float) -> None:
    """Write one executed response's spans (negotiation, then the collective) for each of ``entries``."""
    ended = time.monotonic()
    for entry in entries:
        if entry is not None:
            name = entry.request.name
            timeline.span(name, f"NEGOTIATE_{response.kind.upper()}", entry.handle.submitted_at, started)
            timeline.span(name, response.kind.upper(), started, ended,
                          {"fused": len(response.names), "dtype": entry.request.dtype})
    timeline.flush()
