"""The engine's submission side: the queue of collectives user threads submit (``SubmissionQueue``) and the
waiter fast path (``FastPath``).

The fast path: a thread that waits for a collective while nothing else is in flight runs the engine's cycles
itself, polling the control plane instead of sleeping, for up to ``HVPS_SPIN_WAIT_MICROSECONDS``
(``FastPath.drive``). A synchronous small collective then costs no hand-over between threads and no wake-up of
a sleeping thread on any rank: it is negotiated and executed by the callers. The negotiation is the same code,
so the mismatch and stall checks hold. Only collectives the backend can abandon at once when a rank dies
(``Backend.interruptible_bytes_for``: on the node's shared-memory plane, any size) run on the caller; a larger one
is left to the engine thread (the executor's backlog, ``execution.py``).
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from collections import deque
from typing import Callable, ContextManager, Optional, Protocol

from ..control.negotiation import JOIN, Request
from ..core.errors import DuplicateNameError, HvpsError
from ..core.handle import Handle
from ..dataplane.executors import Entry
from .engine_status import EngineStatus

#: after local work arrives, the engine polls its queue for this many cycles before it
#: goes back to sleeping until woken
ACTIVE_CYCLES = 20

#: gradients submitted during backward (``Entry.bucketed``) wait in the queue, the engine neither woken nor
#: polling for them, until this many bytes of them are queued (DDP's default bucket; never more than the fusion
#: threshold, and nothing waits while it is 0) ...
GRADIENT_BUCKET_BYTES = 25 << 20
#: ... or a waiter wants them (``wake_if_queued``), another collective takes them along, or the oldest has
#: waited this long. On two cores, one response per gradient cost the engine ~0.6 ms of CPU each (negotiating,
#: executing, and its polling every cycle in between): ~140 of the ~220 ms it spent per ResNet-50 step.
GRADIENT_HOLD_SECONDS = 0.1

#: ``waits_at_once`` marks this thread's submissions inside a synchronous call
_synchronous = threading.local()


class _WaitingAtOnce:
    """``waits_at_once``'s context: a class, as a generator's context manager cost every synchronous call ~2 us."""

    __slots__ = ("_outer",)

    def __enter__(self) -> None:
        self._outer = getattr(_synchronous, "on", False)
        _synchronous.on = True

    def __exit__(self, *exc_info: object) -> None:
        _synchronous.on = self._outer


def waits_at_once() -> ContextManager[None]:
    """Collectives submitted inside are waited for at once by this thread (a synchronous call): the
    submission does not wake the engine thread, since the wait runs the collective itself or wakes
    it then (``Handle.wait``). Whoever leaves it by an exception must ``wake_if_queued``.

    Returns:
        The context manager (it nests: the outer setting is restored on leaving).
    """
    return _WaitingAtOnce()


class SubmissionQueue:
    """Collectives submitted on this rank: queued, then pending (taken by a cycle, not yet executed), and the
    requests not yet announced; it decides when a submitter wakes the engine thread."""

    def __init__(self, rank: int, status: EngineStatus, stall_seconds: float, wake: Callable[[], None],
                 expedite: Optional[Callable[[Handle], None]] = None,
                 fusion_threshold: Callable[[], int] = lambda: GRADIENT_BUCKET_BYTES) -> None:
        """``wake`` wakes the engine thread; ``expedite`` is what a handle's first blocking wait calls
        (``FastPath.expedite``); ``stall_seconds`` is a waiter's patience (its handle's watchdog);
        ``fusion_threshold()`` is the one in force (it caps the gradients' bucket)."""
        self.rank = rank
        self._status = status
        self._lock = status.lock
        self._stall_seconds = stall_seconds
        self._wake = wake
        self._expedite = expedite
        self._queue: deque = deque()
        self._queued_names: set = set()
        #: name -> entry, taken from the queue by a cycle and not yet executed
        self._pending: dict[str, Entry] = {}
        #: name -> the handle last submitted under it, while the handle lives: its name stays in use until
        #: a wait() takes the result (whether or not the collective has finished)
        self._unclaimed: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        #: the handles of the latest submission, held until the next one: a handle the caller dropped keeps its
        #: name in use until this rank submits something else, so that submitting one name twice in a row is an
        #: error whether or not the first has finished meanwhile (Horovod's duplicate-name tests drop the handle)
        self._latest: list = []
        self._wake_pending = False
        #: until then the engine polls its queue every cycle (submitters need not wake it)
        self.active_until = 0.0
        #: whether the queue holds a submission no waiter is about to run (an asynchronous one: more may follow)
        self._burst = False
        #: set (under the lock) when the engine may block longer than a cycle: then submitters wake it
        self.sleeping = False
        self._unannounced: list = []
        self._last_announce = 0.0
        #: failure requests (``abandon``) not yet announced, and the names they failed under
        self._abandoned: list = []
        self._abandoned_names: set = set()
        self._fusion_threshold = fusion_threshold
        #: the gradients' bucket: bytes of bucketed entries queued, since when the oldest waits, the queued
        #: entries due at once (neither bucketed nor a synchronous call's), and whether a waiter asked for the
        #: queue (``wake_if_queued``)
        self._bucket_bytes = 0
        self._bucket_since: Optional[float] = None
        self._due_at_once = 0
        self._release = False

    # -- called from user threads -------------------------------------------------
    def submit_all(self, entries: list) -> list:
        """Queue every entry, or none of them (a name in flight raises first); returns their handles."""
        with self._lock:
            status = self._status
            if status.failure is not None:
                raise HvpsError(f"the hvps engine stopped: {status.failure}") from status.failure
            if status.stopping:
                raise status.ended or HvpsError("hvps is shutting down: call hvps.init() again")
            seen: set = set()
            for entry in entries:
                name = entry.request.name
                if name in self._pending or name in self._queued_names or name in seen:
                    raise DuplicateNameError(
                        f"a collective named '{name}' is already in flight on rank {self.rank}; "
                        "names must be unique among outstanding operations"
                    )
                earlier = self._unclaimed.get(name)
                if earlier is not None and not earlier.claimed:
                    raise DuplicateNameError(
                        f"a collective named '{name}' finished on rank {self.rank} but nothing has waited for its "
                        "result yet (wait() or synchronize() on its handle, or drop the handle and submit something "
                        "else first); names must be unique among outstanding operations")
                seen.add(name)
            handles = []
            first_held = self._bucket_since is None
            synchronous = getattr(_synchronous, "on", False)
            for entry in entries:
                self._count_in(entry, synchronous)
                # join() waits for ranks still training, for as long as they train: no watchdog.
                request = entry.request
                patience = math.inf if request.kind == JOIN else self._stall_seconds
                entry.handle = Handle(request.name, (entry.inputs, entry.outputs), patience, expedite=self._expedite)
                handles.append(entry.handle)
                self._unclaimed[request.name] = entry.handle
                self._queue.append(entry)
                self._queued_names.add(request.name)
            self._latest = handles
            if synchronous:  # its waiter runs it, or wakes the engine (``FastPath.expedite``)
                return handles
            held = all(entry.bucketed for entry in entries)
            self._burst = self._burst or not held
            # A wake-up costs the submitting (training) thread a syscall, a context
            # switch and the GIL (~150 us). Backward hooks submit in bursts, so while
            # the engine is active it polls its queue every cycle instead (as
            # Horovod's cycle does); after a quiet spell a collective wakes it at once.
            # A gradient bucket wakes it once it is full, and when it starts, even an engine
            # that is not asleep yet (it may have just decided to sleep with no deadline): the
            # engine then sleeps until the bucket's deadline at the latest.
            wake = self.claim_wake((self.sleeping and (not held or self._bucket_full())) or (held and first_held))
        if wake:
            self._wake()
        return handles

    def wake_if_queued(self) -> None:
        """Wake the engine thread if collectives wait in the queue (and no wake-up is on its way); a gradient
        bucket in the queue goes with the next cycle, full or not (a waiter wants it)."""
        with self._lock:
            self._release = self._release or bool(self._queue)
            wake = self.claim_wake(bool(self._queue))
        if wake:
            self._wake()

    def abandon(self, request: Request) -> None:
        """Announce ``request`` as one this rank could not submit (its ``failure`` says why)."""
        with self._lock:
            if not self._status.running:
                return
            self._abandoned.append(request)
            wake = self.claim_wake(True)
        if wake:
            self._wake()

    def claim_wake(self, wanted: bool) -> bool:
        """Whether the caller should wake the engine (it holds the lock): once until it runs."""
        wake = wanted and not self._wake_pending
        self._wake_pending = self._wake_pending or wake
        return wake

    # -- called by whichever thread runs a cycle ------------------------------------------
    def take(self, cycle_s: float, on_waiter: bool) -> None:
        """Move the queue to the pending collectives and their requests to the unannounced ones; unless a
        waiter runs the cycle (``on_waiter``) or every one taken is a synchronous call's (its waiter runs it or
        wakes the engine), poll the queue every ``cycle_s`` for a while (more is likely to follow, a backward
        pass). A loop of synchronous calls thus leaves the engine thread asleep: polling, it would take the
        next call's collective from its waiter and wake up for every message the waiter reads."""
        with self._lock:
            self._wake_pending = self.sleeping = False
            new = self._empty_queue() if on_waiter or self.has_due(time.monotonic()) else []
            for entry in new:  # under the lock: a name is always either queued or pending
                self._pending[entry.request.name] = entry
            abandoned, self._abandoned = self._abandoned, []
            if new and self._burst and not on_waiter:
                self.active_until = time.monotonic() + ACTIVE_CYCLES * cycle_s
            self._burst = False
        self._unannounced.extend(e.request for e in new)
        self._unannounced.extend(abandoned)
        self._abandoned_names.update(r.name for r in abandoned)

    def take_alone(self, handle: Handle) -> Optional[Entry]:
        """``handle``'s collective, when it is the only one queued and nothing else is in flight: moved to the
        pending ones without being announced (the fast lane's; :meth:`announce` it if the lane refuses it)."""
        with self._lock:
            if len(self._queue) != 1 or self._pending or self._abandoned or self._unannounced:
                return None
            entry = self._queue[0]
            if entry.handle is not handle:
                return None
            self._empty_queue()
            self._pending[entry.request.name] = entry
        return entry

    def announce(self, request: Request) -> None:
        """Announce ``request`` (pending, taken by :meth:`take_alone`) with the next cycle's announcements."""
        self._unannounced.append(request)

    def due_announcements(self, cycle_s: float) -> list:
        """Local requests to announce now.

        At once when nothing else is awaiting an answer (lowest latency);
        otherwise at most once per ``cycle_s``, so that a burst of tensors fuses.
        """
        now = time.monotonic()
        if not self._unannounced:
            return []
        in_flight = len(self._pending) > len(self._unannounced)
        if in_flight and now < self._last_announce + cycle_s:
            return []
        due, self._unannounced = self._unannounced, []
        self._last_announce = now
        return due

    def deadlines(self, now: float, cycle_s: float) -> list:
        """When the engine must look at the queue again: a cycle from ``now`` while active, and when the
        unannounced requests are due."""
        deadlines = []
        if now < self.active_until:
            deadlines.append(now + cycle_s)
        if self._unannounced:
            deadlines.append(self._last_announce + cycle_s)
        since = self._bucket_since
        if since is not None:
            deadlines.append(since + GRADIENT_HOLD_SECONDS)
        return deadlines

    def has_due(self, now: float) -> bool:
        """Whether the next cycle takes the queue (the lock is held): it holds anything but a gradient bucket
        not yet full, whose oldest entry has waited less than ``GRADIENT_HOLD_SECONDS``, and synchronous calls
        (their waiters run them, or ask for the queue: ``wake_if_queued``), nobody waiting for it. An engine
        thread that took a synchronous call from its waiter would cost it the fast lane, and a hand-over."""
        if not self._queue:
            return False
        since = self._bucket_since
        return (self._due_at_once > 0 or self._release or self._bucket_full()
                or (since is not None and now >= since + GRADIENT_HOLD_SECONDS))

    def _bucket_full(self) -> bool:
        return self._bucket_bytes >= min(GRADIENT_BUCKET_BYTES, self._fusion_threshold())

    def _count_in(self, entry: Entry, waited: bool) -> None:
        """Count a queued ``entry`` into the bucket, or as one that is due at once unless its submitter waits for
        it at once (``waited``: a synchronous call, whose waiter runs it or releases the queue; the lock is
        held)."""
        if not entry.bucketed:
            self._due_at_once += not waited
            return
        if self._bucket_since is None:
            self._bucket_since = time.monotonic()
        self._bucket_bytes += sum(array.nbytes for array in entry.inputs)

    def has_work(self) -> bool:
        """Whether anything submitted is queued, pending or unannounced (the lock is held)."""
        return bool(self._queue or self._pending or self._abandoned or self._unannounced)

    def alone(self, handle: Handle) -> bool:
        """Whether ``handle``'s collective is the only one submitted and nothing else is to be announced."""
        with self._lock:
            return (len(self._queue) + len(self._pending) == 1 and not self._abandoned
                    and (handle.name in self._pending or handle.name in self._queued_names)
                    and self._status.running)

    def pending_entry(self, name: str) -> Optional[Entry]:
        """The pending entry named ``name``, or None (joined: this rank submitted nothing)."""
        return self._pending.get(name)

    def take_pending(self, names: list) -> list:
        """The pending entries named ``names``, taken out (None for a name not pending here)."""
        return [self._pending.pop(name, None) for name in names]

    def forget_abandoned(self, names: list) -> bool:
        """Whether this rank abandoned any of ``names`` (``abandon``); they are forgotten."""
        abandoned = any(name in self._abandoned_names for name in names)
        self._abandoned_names.difference_update(names)
        return abandoned

    def unanswered(self) -> list:
        """Names of pending collectives whose handles finished all the same (a waiter's watchdog), sorted."""
        return sorted(entry.request.name for entry in list(self._pending.values()) if entry.handle.finished)

    def drain(self) -> list:
        """Every queued and pending entry, taken out (to fail them)."""
        with self._lock:
            entries = list(self._pending.values()) + self._empty_queue()
            self._pending.clear()
        return entries

    def _empty_queue(self) -> list:
        """The queued entries, taken out, the bucket's and the release's counts reset with them (the lock is
        held)."""
        entries = list(self._queue)
        self._queue.clear()
        self._queued_names.clear()
        self._bucket_bytes, self._bucket_since, self._due_at_once, self._release = 0, None, 0, False
        return entries


class WaiterRuns(Protocol):
    """What the fast path needs of the executor: its backlog, where to say a waiter runs the cycle, and (for the
    fast lane) what a waiter may run and running it."""

    backlog: deque
    on_waiter: bool

    def waiter_may_run(self, response) -> bool: ...

    def execute(self, responses: list) -> None: ...


class FastPath:
    """Lets a thread about to block on the only collective in flight run the engine's cycles itself."""

    def __init__(self, queue: SubmissionQueue, status: EngineStatus, executor: WaiterRuns,
                 cycle_lock: threading.Lock, cycle: Callable[[], None], guard: Callable[[], ContextManager],
                 outstanding: Callable[[], bool], wake: Callable[[], None], spin_seconds: float) -> None:
        """``cycle`` runs one engine cycle (under ``cycle_lock``, which the engine thread holds for each of its
        own), inside ``guard()`` (which turns an exception into the engine's failure); ``outstanding`` (called
        with the status lock held) says whether the engine thread has something to do or watch, and ``wake``
        wakes it."""
        self._queue = queue
        self._status = status
        self._executor = executor
        self._cycle_lock = cycle_lock
        self._cycle = cycle
        self._guard = guard
        self._outstanding = outstanding
        self._wake = wake
        #: how long a waiter drives the engine before it blocks (seconds; 0: never)
        self.spin_seconds = spin_seconds
        #: the node's fast lane (``fast_lane.FastLane``), when every rank of the job is on this node's segment
        self.lane = None

    def _through_lane(self, handle: Handle) -> bool:
        """Run ``handle``'s collective through the fast lane (``fast_lane.py``) if it may go and every rank
        agrees; otherwise leave it announced for the cycles. Whether it ran."""
        entry = self._queue.take_alone(handle)
        if entry is None:
            return False
        response = self.lane.agree(entry.request)
        if response is not None:
            self._executor.execute([response])  # one too large for a waiter is left to the engine thread
            return True
        self._queue.announce(entry.request)
        return False

    def expedite(self, handle: Handle) -> None:
        """A thread is about to block on ``handle``: when nothing else is in flight, run the engine's
        cycles here until it is done (``drive``); otherwise, if it still sits in the queue, wake the
        engine now instead of letting it wait for the next cycle.  The wake-up's cost falls on a
        thread that would only wait anyway, and a synchronous call saves up to a cycle per rank."""
        if not self.drive(handle):
            self._queue.wake_if_queued()

    def alone(self, handle: Handle) -> bool:
        """Whether ``handle``'s collective is the only one in flight on this rank."""
        return not self._executor.backlog and self._queue.alone(handle)

    def drive(self, handle: Handle) -> bool:
        """Run cycles on this (waiting) thread until ``handle`` is done, a response too large for it
        comes, or ``spin_seconds`` pass; False if it may not (the engine thread stays in a cycle longer, or
        other collectives are in flight: they keep the engine thread's pace and fusion)."""
        # The engine thread holds the lock for a cycle at a time (microseconds, unless it is inside a
        # large transfer): waiting for it beats handing over, which wakes a thread on every rank.
        if self.spin_seconds <= 0 or not self.alone(handle) or not self._cycle_lock.acquire(timeout=self.spin_seconds):
            return False
        executor, status = self._executor, self._status
        try:
            executor.on_waiter = True
            until = time.monotonic() + self.spin_seconds
            with self._guard():
                if self.lane is not None and self._through_lane(handle):  # it checks alone-ness under the lock
                    return True
                if not self.alone(handle):  # checked again: the engine thread may have taken more meanwhile
                    return False
                while not handle.finished and not executor.backlog and status.running:
                    self._cycle()
                    if handle.finished or time.monotonic() > until:
                        break  # no yield after the cycle that finished it: on a busy core one costs a time slice
                    os.sched_yield()  # a peer rank or our own engine may be waiting for this core
            return True
        finally:
            executor.on_waiter = False
            with status.lock:  # the engine thread may sleep for good: from now on submitters wake it
                self._queue.sleeping = True
                wake = self._queue.claim_wake(self._outstanding())
            self._cycle_lock.release()
            if wake:
                self._wake()
