"""The engine: it owns every data-plane call, and a background thread runs it.

Each rank queues collectives locally; the engine announces them to rank 0's
coordinator (at most once per cycle, so that tensors arriving together fuse; above 17 ranks
through relays of the control-plane tree, ``control/tree.py``), which answers with the
responses every rank executes in the same order (see ``negotiation.py``). Between messages
the thread blocks in ``select`` on the control plane (``plane.py``), so it takes no CPU from
training while it waits.

The fast path: a thread that waits for a collective while nothing else is in flight runs the
engine's cycles itself, polling the control plane instead of sleeping, for up to
``HVPS_SPIN_WAIT_MICROSECONDS`` (``_drive``). A synchronous small collective then costs no
hand-over between threads and no wake-up of a sleeping thread on any rank: it is negotiated and
executed by the callers. The negotiation is the same code, so the mismatch and stall checks hold.
Only collectives the backend can abandon at once when a rank dies (``Backend.interruptible_bytes``)
run on the caller; a larger one is left to the engine thread (``_backlog``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
import weakref
from collections import deque
from typing import Iterator, Optional

from .. import metrics as _metrics
from ..control.liveness import SILENT, PeerLost
from ..control.negotiation import ALLGATHER, ADD_SET, GLOBAL_SET, JOIN, REMOVE_SET, SHUTDOWN, Coordinator, Request
from ..control.plane import ControlPlane
from ..control.relay import RelayBuffer
from ..control.response_cache import ResponseCache
from ..core import arrays
from ..core.errors import DataPlaneStall, DuplicateNameError, HvpsError
from ..core.handle import Handle
from ..core.timeline import Timeline
from ..dataplane.buffers import FusionBuffer
from ..dataplane.executors import EXECUTORS, Context, Entry
from .autotune import Autotuner, Setting

log = logging.getLogger("hvps")

#: after local work arrives, the engine polls its queue for this many cycles before it
#: goes back to sleeping until woken
_ACTIVE_CYCLES = 20
#: an idle engine reads unasked messages (other ranks' announcements, which only rank 0 gets) this often;
#: its own submissions wake it at once
_IDLE_READ_SECONDS = 0.05
#: a relay of the control-plane tree holds a request some ranks of its subtree have not announced for up to
#: this many cycles, so that the whole block's announcements go up together (control/relay.py)
_RELAY_HOLD_CYCLES = 10
#: after a collective failed in the data plane, how long the engine waits for the control plane to
#: tell which rank died (it knows within milliseconds of the kernel closing the dead rank's sockets), and
#: how long rank 0's roll call waits for the ranks' answers (a stopped rank keeps its sockets open; the live
#: ranks stuck in the same transfer leave it at about the same time, each after its own stall timeout)
_LOSS_GRACE_SECONDS = 1.0


#: ``waits_at_once`` marks this thread's submissions inside a synchronous call
_synchronous = threading.local()


@contextlib.contextmanager
def waits_at_once() -> Iterator[None]:
    """Collectives submitted inside are waited for at once by this thread (a synchronous call): the
    submission does not wake the engine thread, since the wait runs the collective itself or wakes
    it then (``Handle.wait``). Whoever leaves it by an exception must ``wake_if_queued``."""
    outer = getattr(_synchronous, "on", False)
    _synchronous.on = True
    try:
        yield
    finally:
        _synchronous.on = outer


def poll_timeout(deadline: float, now: float) -> float:
    """Seconds from ``now`` to ``deadline`` for ``select``, in whole microseconds.

    ``(now + cycle) - now`` is a hair above a cycle in floating point, and ``select`` rounds up
    to the next millisecond: unrounded, every 1 ms cycle lasted 2 ms.
    """
    return max(0.0, math.floor((deadline - now) * 1e6) / 1e6)


class Engine:
    """Queues collectives, negotiates them with the other ranks and runs them on a backend."""

    def __init__(self, comm, backend, settings, control_key: Optional[bytes] = None) -> None:
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.settings = settings
        self.backend = backend
        #: process set id -> Context, for the sets this rank belongs to
        self.contexts = {GLOBAL_SET: Context(backend, self.rank, self.size, fusion=FusionBuffer())}
        self.control = ControlPlane(comm, key=control_key, fanout=settings.control_fanout)
        self.coordinator = (
            Coordinator(self.size, settings.fusion_threshold, settings.stall_fail_seconds, settings.stall_warn_seconds)
            if self.rank == 0
            else None
        )
        tree = self.control.position
        self.cache = ResponseCache(settings.cache_capacity, self.size, self.rank,
                                   children={block.start: block for block in tree.blocks})
        #: process set id -> how many of its ranks are in this rank's subtree (what a relay waits for)
        self._members_below: dict = {}
        #: the fusion threshold and cycle time in force (HVPS_AUTOTUNE changes them during a run)
        self.fusion_threshold, self.cycle_s = settings.fusion_threshold, settings.cycle_time_ms / 1000.0
        #: a rank between rank 0 and others merges its subtree's announcements (control-plane tree)
        self.relay = (RelayBuffer(tree.subtree, tree.blocks, _RELAY_HOLD_CYCLES * self.cycle_s, self._announcers)
                      if tree.is_relay else None)
        #: rank 0's search, when HVPS_AUTOTUNE=1; its settings reach the other ranks with the next responses
        self.autotuner = (Autotuner(Setting(settings.fusion_threshold, settings.cycle_time_ms),
                                    settings.autotune_warmup_steps, settings.autotune_steps_per_sample)
                          if settings.autotune and self.rank == 0 else None)
        self._tuning: Optional[dict] = None
        #: time this rank's engine thread spent negotiating (announcing, matching, encoding, decoding)
        self.negotiation_seconds = 0.0
        #: when set (a benchmark does), the CPU time of the same (thread_time costs 0.6 us a call, so off)
        self.count_cpu = False
        self.negotiation_cpu_seconds = 0.0
        self._lock = threading.Lock()
        self._queue: deque = deque()
        self._queued_names: set = set()
        #: name -> the handle last submitted under it, while the handle lives: its name stays in use until
        #: a wait() takes the result (whether or not the collective has finished)
        self._unclaimed: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        #: the handles of the latest submission, held until the next one: a handle the caller dropped keeps its
        #: name in use until this rank submits something else, so that submitting one name twice in a row is an
        #: error whether or not the first has finished meanwhile (Horovod's duplicate-name tests drop the handle)
        self._latest: list = []
        self._wake_pending = False
        #: until then the engine polls its queue every cycle (submitters need not wake it)
        self._active_until = 0.0
        #: set (under the lock) when the engine may block longer than a cycle: then submitters wake it
        self._sleeping = False
        self._unannounced: list = []
        #: failure requests (``abandon``) not yet announced, and the names they failed under
        self._abandoned: list = []
        self._abandoned_names: set = set()
        self._last_announce = 0.0
        self._pending: dict[str, Entry] = {}
        #: the entries of the response being executed (taken out of _pending): a dead rank fails them too
        self._running: list = []
        self._failure: Optional[BaseException] = None
        #: set once ranks were found dead (_peers_lost); a collective in flight then gives up
        self._lost = threading.Event()
        #: set when other ranks' shutdown ended this engine (_ended_by_others): what its collectives raise
        self._ended: Optional[HvpsError] = None
        #: whether rank 0 has called the roll after a collective failed in a data plane (once: _roll_call)
        self._roll_called = False
        backend.interrupt_on(self._lost)
        backend.report_failures_to(self._failed)  # NCCL's asynchronous errors and timeouts (tdist.NcclWatch)
        #: held by whichever thread runs a cycle: the engine thread, or a waiter that drives it (_drive)
        self._cycle_lock = threading.Lock()
        #: whether the thread in a cycle is a waiter (it runs only what the backend can abandon at once)
        self._on_waiter = False
        #: agreed responses not yet executed, in order (a waiter left one too large for it)
        self._backlog: deque = deque()
        #: how long a waiter drives the engine before it blocks (seconds; 0: never)
        self.spin_seconds = settings.spin_wait_us / 1e6
        #: collectives that a waiting thread executed itself (the fast path)
        self.driven_collectives = 0
        self._stopping = False
        self.timeline = None
        if settings.timeline and settings.timeline != "DYNAMIC":  # DYNAMIC: start_timeline() later
            self.start_timeline(settings.timeline, settings.timeline_mark_cycles)
        if self.autotuner is not None:
            self._tune(self.autotuner.first())
        # A dead rank fails what is in flight at once, even while this thread is inside a transfer.
        self.control.watch(self._peers_lost)
        self._thread = threading.Thread(target=self._run, name="hvps-engine", daemon=True)
        self._thread.start()

    # -- called from user threads -------------------------------------------------
    def submit(self, entry: Entry) -> Handle:
        """Queue ``entry`` and return its handle."""
        return self.submit_all([entry])[0]

    def submit_all(self, entries: list) -> list:
        """Queue every entry, or none of them (a name in flight raises first); returns their handles."""
        with self._lock:
            if self._failure is not None:
                raise HvpsError(f"the hvps engine stopped: {self._failure}") from self._failure
            if self._stopping:
                raise self._ended or HvpsError("hvps is shutting down: call hvps.init() again")
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
            for entry in entries:
                # join() waits for ranks still training, for as long as they train: no watchdog.
                request = entry.request
                patience = math.inf if request.kind == JOIN else self.settings.stall_fail_seconds
                entry.handle = Handle(request.name, (entry.inputs, entry.outputs), patience, expedite=self._expedite)
                handles.append(entry.handle)
                self._unclaimed[request.name] = entry.handle
                self._queue.append(entry)
                self._queued_names.add(request.name)
            self._latest = handles
            # A wake-up costs the submitting (training) thread a syscall, a context
            # switch and the GIL (~150 us). Backward hooks submit in bursts, so while
            # the engine is active it polls its queue every cycle instead (as
            # Horovod's cycle does); after a quiet spell a collective wakes it at once.
            wake = self._claim_wake(self._sleeping and not getattr(_synchronous, "on", False))
        if wake:
            self.control.wake()
        return handles

    def wake_if_queued(self) -> None:
        """Wake the engine thread if collectives wait in the queue (and no wake-up is on its way)."""
        with self._lock:
            wake = self._claim_wake(bool(self._queue))
        if wake:
            self.control.wake()

    def abandon(self, request: Request) -> None:
        """Tell the other ranks that this rank could not submit ``request`` (its ``failure`` says why):
        the coordinator fails it on every rank at once instead of letting them wait for a stall."""
        with self._lock:
            if self._failure is not None or self._stopping:
                return
            self._abandoned.append(request)
            wake = self._claim_wake(True)
        if wake:
            self.control.wake()

    def _expedite(self, handle: Handle) -> None:
        """A thread is about to block on ``handle``: when nothing else is in flight, run the engine's
        cycles here until it is done (``_drive``); otherwise, if it still sits in the queue, wake the
        engine now instead of letting it wait for the next cycle.  The wake-up's cost falls on a
        thread that would only wait anyway, and a synchronous call saves up to a cycle per rank."""
        if not self._drive(handle):
            self.wake_if_queued()

    def _drive(self, handle: Handle) -> bool:
        """Run cycles on this (waiting) thread until ``handle`` is done, a response too large for it
        comes, or ``spin_seconds`` pass; False if it may not (the engine thread stays in a cycle longer, or
        other collectives are in flight: they keep the engine thread's pace and fusion)."""
        # The engine thread holds the lock for a cycle at a time (microseconds, unless it is inside a
        # large transfer): waiting for it beats handing over, which wakes a thread on every rank.
        if self.spin_seconds <= 0 or not self._alone(handle) or not self._cycle_lock.acquire(timeout=self.spin_seconds):
            return False
        if not self._alone(handle):  # checked again: the engine thread may have taken more meanwhile
            self._cycle_lock.release()
            return False
        try:
            self._on_waiter = True
            until = time.monotonic() + self.spin_seconds
            with self._failures_stop_it():
                while not handle.finished and not self._backlog and not self._stopping and self._failure is None:
                    self._cycle(0.0)
                    if time.monotonic() > until:
                        break
                    os.sched_yield()  # a peer rank or our own engine may be waiting for this core
            return True
        finally:
            self._on_waiter = False
            with self._lock:  # the engine thread may sleep for good: from now on submitters wake it
                self._sleeping = True
                wake = self._claim_wake(self._outstanding())
            self._cycle_lock.release()
            if wake:
                self.control.wake()

    def _alone(self, handle: Handle) -> bool:
        """Whether ``handle``'s collective is the only one in flight on this rank."""
        with self._lock:
            return (len(self._queue) + len(self._pending) == 1 and not self._backlog and not self._abandoned
                    and (handle.name in self._pending or handle.name in self._queued_names)
                    and not self._stopping and self._failure is None)

    def _outstanding(self) -> bool:
        """Whether the engine thread has anything to do or watch (the lock is held)."""
        return bool(self._queue or self._pending or self._backlog or self._abandoned or self._unannounced
                    or self.relay or self._stopping or self._failure is not None
                    or (self.coordinator is not None and self.coordinator.next_deadline() is not None))

    def _claim_wake(self, wanted: bool) -> bool:
        """Whether the caller should wake the engine (it holds the lock): once until it runs."""
        wake = wanted and not self._wake_pending
        self._wake_pending = self._wake_pending or wake
        return wake

    def step_done(self) -> None:
        """A training step ended on this rank (the adapters call it once per optimizer step)."""
        if self.autotuner is not None and not self.autotuner.done:
            setting = self.autotuner.step(time.monotonic())
            if setting is not None:
                self._tune(setting)

    def _tune(self, setting: Setting) -> None:
        """Apply ``setting`` here (rank 0) and send it to the other ranks with the next responses."""
        self.coordinator.fusion_threshold = setting.fusion_threshold
        tuning = {"fusion_threshold": setting.fusion_threshold, "cycle_time_ms": setting.cycle_time_ms}
        self._apply_tuning(tuning)
        with self._lock:
            self._tuning = tuning

    def _apply_tuning(self, tuning: dict) -> None:
        self.fusion_threshold = int(tuning["fusion_threshold"])
        self.cycle_s = float(tuning["cycle_time_ms"]) / 1000.0

    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        """Write the timeline to ``path`` from now on (rank 0 writes; other ranks keep none)."""
        if self.rank != 0:
            return
        old, self.timeline = self.timeline, Timeline(path, mark_cycles)
        if old is not None:
            old.close()

    def stop_timeline(self) -> None:
        """Stop writing the timeline and close its file."""
        old, self.timeline = self.timeline, None
        if old is not None:
            old.close()

    def shutdown(self) -> Optional[str]:
        """Agree with the other ranks to stop, then stop the thread.

        Returns None when MPI can still finalize normally, else why not (the job must then be
        aborted, or finalize would wait for ranks that will never get there): the engine failed (a
        collective failed midway, a rank died), the thread is stuck inside a collective, rank 0 left
        collectives of this rank unanswered (it is stopped or unreachable), or the ranks did not
        agree to stop.
        """
        why = self._failure and f"the hvps engine stopped: {str(self._failure).removeprefix('hvps: ')}"
        unanswered = sorted(entry.request.name for entry in list(self._pending.values()) if entry.handle.finished)
        if why is None and unanswered:  # failed by a waiter's watchdog: rank 0 never answered them
            why = f"rank 0 (the coordinator) never answered {unanswered[:3]}"
        if why is None and self._ended is None:  # (other ranks' shutdown ended this engine: nothing to agree)
            handle = self.submit(Entry(Request("shutdown", SHUTDOWN), []))
            try:
                handle.wait(timeout=self.settings.stall_fail_seconds + 5)
            except HvpsError as exc:
                why = f"the ranks did not agree to shut down: {exc}"
        with self._lock:
            self._stopping = True
        self.control.wake()
        self._thread.join(timeout=5 if why is None else 1)  # a failed engine's thread is gone, or stuck
        stuck = self._thread.is_alive()
        if stuck and why is None:
            why = "the hvps engine thread is stuck inside a collective"
        self._fail_all(HvpsError("hvps was shut down before this collective completed"))
        if not stuck:
            self.control.close()
        self.stop_timeline()
        return why

    # -- the engine thread ----------------------------------------------------------
    def _run(self) -> None:
        with self._failures_stop_it():
            while not self._stopping and self._failure is None:
                timeout = self._timeout()
                with self._lock:  # decided together with submit(), so no wake-up is lost
                    if self._queue or self._backlog:
                        timeout = 0.0
                    # "More than a cycle", with slack: (now + cycle) - now rounds to a hair above
                    # a cycle, which would make every submission pay for a wake-up while active.
                    self._sleeping = timeout is None or timeout > 1.5 * self.cycle_s
                    # a relay passes on what it hears at once, whether or not anything of its own is in flight
                    idle = timeout is None and not self._outstanding() and self.relay is None
                if idle:  # nothing of ours in flight: unasked messages (announcements to rank 0) can wait
                    self.control.wait(_IDLE_READ_SECONDS, messages=False)
                else:
                    self.control.wait(timeout)
                with self._cycle_lock:  # a waiter may be driving: it reads what woke us
                    if self._stopping or self._failure is not None:
                        break
                    self._cycle(0.0)

    def _cycle(self, timeout: Optional[float]) -> None:
        """One turn: read the control plane, take the queue, negotiate, execute (the cycle lock is held)."""
        messages, closed = self.control.poll(timeout)
        timeline = self.timeline
        if timeline is not None and timeline.mark_cycles:
            timeline.mark("CYCLE_START")
        self._take_queue()
        if self.rank == 0:
            self._coordinate(messages, closed)
        else:
            self._work(messages, closed)

    @contextlib.contextmanager
    def _failures_stop_it(self) -> Iterator[None]:
        """Any exception of a cycle is the engine's failure, surfaced on every handle; an interrupt of a
        driving user thread (Ctrl-C) also goes on up that thread."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)
        except BaseException as exc:
            self._failed(exc)
            if threading.current_thread() is not self._thread:
                raise

    def _failed(self, exc: BaseException) -> None:
        """A cycle raised ``exc`` (on the engine thread or a driving waiter): fail everything, once."""
        with self._lock:
            first, self._failure = self._failure is None, self._failure or exc
        if not first:
            return  # a rank died meanwhile (_peers_lost): this is a consequence, already reported
        if isinstance(exc, HvpsError):
            log.error("hvps rank %d: %s", self.rank, exc)
        else:
            log.exception("hvps engine failed on rank %d", self.rank)
        _metrics.on_engine_failure()
        self._fail_all(HvpsError(f"the hvps engine stopped on rank {self.rank} after: {exc}"))

    def _peers_lost(self, lost: dict) -> None:
        """Ranks died (the control plane's watch, or this thread's poll): fail every collective in
        flight at once, naming them, and stop. Rank 0 passes the word on to the other ranks."""
        error = PeerLost(lost)
        with self._lock:
            if self._failure is not None or self._stopping:
                return
            self._failure = error
        log.error("hvps rank %d: %s", self.rank, error)
        self.control.farewell(error.lost)
        self._fail_all(lambda entry: error.for_collective(entry.request.kind, entry.request.name))
        self._lost.set()  # after the handles have their errors (_run_collective waits for it)
        self.control.wake()

    def _timeout(self) -> Optional[float]:
        """How long poll may block: a cycle while active, else until the next announcement or
        stall deadline, else forever."""
        now = time.monotonic()
        deadlines = []
        if now < self._active_until:
            deadlines.append(now + self.cycle_s)
        if self._unannounced:
            deadlines.append(self._last_announce + self.cycle_s)
        if self.relay:
            deadlines.append(self.relay.deadline())
        if self.coordinator is not None and self.coordinator.next_deadline() is not None:
            deadlines.append(self.coordinator.next_deadline())
        return poll_timeout(min(deadlines), now) if deadlines else None

    def _take_queue(self) -> None:
        with self._lock:
            self._wake_pending = self._sleeping = False
            new = list(self._queue)
            self._queue.clear()
            self._queued_names.clear()
            for entry in new:  # under the lock: a name is always either queued or pending
                self._pending[entry.request.name] = entry
            abandoned, self._abandoned = self._abandoned, []
            if new and not self._on_waiter:  # more is likely to follow (a backward pass): poll for a while
                self._active_until = time.monotonic() + _ACTIVE_CYCLES * self.cycle_s
        self._unannounced.extend(e.request for e in new)
        self._unannounced.extend(abandoned)
        self._abandoned_names.update(r.name for r in abandoned)

    def _due_announcements(self) -> list:
        """Local requests to announce now.

        At once when nothing else is awaiting an answer (lowest latency);
        otherwise at most once per cycle, so that a burst of tensors fuses.
        """
        now = time.monotonic()
        if not self._unannounced:
            return []
        in_flight = len(self._pending) > len(self._unannounced)
        if in_flight and now < self._last_announce + self.cycle_s:
            return []
        due, self._unannounced = self._unannounced, []
        self._last_announce = now
        return due

    def _coordinate(self, messages: list, closed: list) -> None:
        started, cpu = time.perf_counter(), time.thread_time() if self.count_cpu else None
        if self.control.stalled and not self._roll_called:  # a worker's transfer stalled: did a rank stop?
            more, gone = self._roll_call()
            messages, closed = messages + more, closed + gone
            if self._failure is not None:
                return
        now = time.monotonic()
        self.coordinator.submit(0, self.cache.canonical(self._due_announcements()), now)
        for source, message in messages:
            self.coordinator.submit_pairs(self.cache.resolve(source, message), now)
        self._left_alone(closed)
        if self._failure is not None:
            return
        responses = self.coordinator.poll(time.monotonic())
        if not self._late_ranks_answer(responses):
            return
        if responses and self.size > 1:  # alone, rank 0 has no one to tell (nor a cache to keep)
            wire = {"responses": self.cache.encode_responses(responses)}
            if self._tuning is not None:
                with self._lock:
                    wire["tuning"], self._tuning = self._tuning, None
            self.control.send_down(wire)
        self._negotiated(started, cpu)
        self._execute(responses)

    def _late_ranks_answer(self, responses: list) -> bool:
        """Whether the ranks that did not ask for a shutdown among ``responses`` (the coordinator ends hvps
        everywhere once the first rank asked a stall time ago) are alive: rank 0 calls the roll first. A late rank
        busy in its own code answers, and the shutdown goes on (its collectives then fail, saying why). One that
        is stopped or hung answers nothing: it is lost (``SILENT``), this engine fails, and the job is aborted
        rather than left waiting for it in MPI_Finalize for ever. Always true when no shutdown is early."""
        early = next((r for r in responses if r.kind == SHUTDOWN and len(r.asked) < self.size), None)
        if early is None:
            return True
        late = set(range(self.size)) - set(early.asked)
        silent, messages, closed = self.control.roll_call(_LOSS_GRACE_SECONDS, self._lost)
        for source, message in messages:  # what else arrived meanwhile: the next poll's
            self.coordinator.submit_pairs(self.cache.resolve(source, message), time.monotonic())
        self._left_alone(closed)
        lost = {rank: SILENT for rank in silent if rank in late}
        if lost and self._failure is None:
            self._peers_lost(lost)
        return self._failure is None

    def _work(self, messages: list, closed: list) -> None:
        started, cpu = time.perf_counter(), time.thread_time() if self.count_cpu else None
        due = self._due_announcements()
        parent, relay = self.control.parent, self.relay
        if due and relay is None:
            self.control.send(parent, self.cache.announce(due))
        elif due:
            relay.add(self.rank, self.cache.announce(due), time.monotonic())
        responses: list = []
        for source, message in messages:
            if source != parent:  # a child's announcements, to merge and pass up
                relay.add(source, message, time.monotonic())
                continue
            if self.control.children:
                self.control.send_down(message)
            responses += self.cache.decode_responses(message["responses"])
            if "tuning" in message:
                self._apply_tuning(message["tuning"])
        upward = relay.take(time.monotonic(), self.cache.epoch) if relay is not None else None
        if upward is not None:
            self.control.send(parent, upward)
        self._negotiated(started, cpu)
        self._execute(responses)
        self._left_alone(closed)

    def _negotiated(self, started: float, cpu: Optional[float]) -> None:
        """Count the time since ``started`` (perf_counter) and CPU time since ``cpu`` (None: not counted)."""
        self.negotiation_seconds += time.perf_counter() - started
        if cpu is not None:
            self.negotiation_cpu_seconds += time.thread_time() - cpu

    def _announcers(self, bit: int) -> int:
        """How many ranks of this relay's subtree announce the request ``bit`` names: its process set's."""
        request = self.cache.request_of(bit)
        subtree = self.control.position.subtree
        if request is None or request.process_set == GLOBAL_SET:
            return len(subtree)
        return self._members_below.get(request.process_set, len(subtree))

    def _left_alone(self, closed: list) -> None:
        """Peers that said goodbye before every rank agreed to stop have left the job: it cannot go on."""
        if closed and not self._stopping:
            self._peers_lost({rank: "it shut its control connection down alone (its hvps engine stopped)"
                              for rank in closed})

    def _execute(self, responses: list) -> None:
        """Run ``responses`` after any left from before, in order; a waiter leaves the first one its
        backend could not abandon at once to the engine thread (``_drive``)."""
        self._backlog.extend(responses)
        while self._backlog:
            if self._failure is not None:  # a rank died meanwhile: every handle has its error
                return
            response = self._backlog[0]
            if self._on_waiter and not self._waiter_may_run(response):
                return
            self._backlog.popleft()
            entries = [self._pending.pop(name, None) for name in response.names]
            self._running = [entry for entry in entries if entry is not None]
            if response.error:
                self._report_error(response, entries)
            elif response.kind in (ADD_SET, REMOVE_SET):
                self._change_sets(response, entries)
            elif response.kind in (JOIN, SHUTDOWN):
                self._stopping = self._stopping or response.kind == SHUTDOWN
                if response.kind == SHUTDOWN and self.rank not in response.asked:
                    self._ended_by_others(response.asked)
                for entry in entries:
                    if entry is not None:
                        entry.handle.set_result(response.last_joined if response.kind == JOIN else None)
            else:
                self.driven_collectives += self._on_waiter
                self._run_collective(response, entries)
        self._running = []

    def _ended_by_others(self, asked: list) -> None:
        """Ranks ``asked`` shut hvps down and this rank did not follow within the stall time: hvps ends here
        too (Horovod's rule), and every collective of this rank, in flight or to come, fails saying so."""
        self._ended = HvpsError(
            f"hvps was shut down: ranks {asked} called hvps.shutdown() (or their scripts ended) and rank "
            f"{self.rank} did not follow within the stall time, so hvps ended on every rank; every rank must "
            "submit the same collectives and shut down at the same point (check for rank-dependent control "
            "flow), or call hvps.init() again")
        log.error("hvps rank %d: %s", self.rank, self._ended)
        self._fail_all(self._ended)

    def _waiter_may_run(self, response) -> bool:
        """Whether a waiting user thread may execute ``response``: negotiation-only kinds, and collectives
        small enough that the backend abandons them at once when a rank dies (never a hang in user code)."""
        if response.error or response.kind in (JOIN, SHUTDOWN):
            return True
        if response.kind in (ADD_SET, REMOVE_SET):
            return False  # building or freeing a process set's communicators may block
        context = self.contexts.get(response.requests[0].process_set)
        if context is None:
            return True
        limit = context.backend.interruptible_bytes
        nbytes = 0
        for name in response.names:
            entry = self._pending.get(name)
            if entry is None:
                return False  # joined: zeros of the agreed shapes, sized elsewhere
            for array in entry.inputs:
                if not arrays.is_numpy(array):
                    return False
                nbytes += array.nbytes
        return nbytes * (context.size if response.kind == ALLGATHER else 1) <= limit

    def _change_sets(self, response, entries: list) -> None:
        """Build (or free) the data plane of an agreed process set, on its members only."""
        req = response.requests[0]
        if response.kind == ADD_SET:
            self._members_below[req.root] = sum(rank in self.control.position.subtree for rank in req.splits)
        else:
            self._members_below.pop(req.root, None)
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
            # this can be trusted, so the engine stops (see _run) and says why. A failed transfer
            # is most often a dead or stopped peer, which the data plane notices without naming it:
            # the control plane's word on which rank died or stopped (_peers_lost) is the error to give.
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
            self._trace(timeline, response, entries, started)
        for entry, result in zip(entries, results):
            if entry is not None:
                entry.handle.set_result(result)
        _metrics.on_collective(response, entries, started, self.fusion_threshold)

    def _find_the_lost(self, what: str, stall: bool) -> None:
        """``what`` (a collective and its error) failed in this rank's data plane, by a ``stall`` or not: let the
        control plane name the ranks that died or stopped (``_peers_lost``, which fails every handle with their
        names), for up to about ``_LOSS_GRACE_SECONDS``. A dead rank's connections close, and the watch tells at
        once. A stopped one's stay open, and a stalled data plane can only name the neighbours that stopped
        sending, which may be waiting for it themselves: so a worker reports its failure to rank 0, and after a
        stall (its own, or one reported) rank 0 calls the roll (``_roll_call``); its notice reaches the
        workers through their watch, as a dead rank's does. Without a word, the data plane's error stands."""
        if self.rank != 0:
            self.control.report_failure(what, stall)
            # rank 0 stalls at about the same time as this rank (or it is idle and reads the report at once);
            # then its roll call takes up to a grace
            self._lost.wait(2 * _LOSS_GRACE_SECONDS if stall else _LOSS_GRACE_SECONDS)
            return
        # An error of rank 0's own calls no roll: the ranks waiting for it have not stalled yet. Unless a worker
        # reports a stall meanwhile (on shared memory, the rank that stalls ends the others' wait with an error).
        deadline = time.monotonic() + _LOSS_GRACE_SECONDS
        while not stall and not self._lost.is_set() and time.monotonic() < deadline:
            self.control.poll(min(0.05, deadline - time.monotonic()))  # the engine stops: what else it reads can go
            stall = bool(self.control.stalled)
        if stall and not self._lost.is_set():
            self._roll_call()

    def _roll_call(self) -> tuple:
        """Rank 0, once, after a transfer stalled: probe the other ranks (``ControlPlane.roll_call``); those that
        neither answer nor report a failed transfer within ``_LOSS_GRACE_SECONDS`` are lost (``SILENT``): the live
        ranks stuck in the same transfer stalled at about the same time and report it. Returns what the control
        plane said meanwhile, ``(messages, closed)``, for the cycle to handle."""
        if self._roll_called:
            return [], []
        self._roll_called = True
        silent, messages, closed = self.control.roll_call(_LOSS_GRACE_SECONDS, self._lost)
        if silent and not self._lost.is_set():
            self._peers_lost({rank: SILENT for rank in silent})
        return messages, closed

    @staticmethod
    def _trace(timeline, response, entries: list, started: float) -> None:
        ended = time.monotonic()
        for entry in entries:
            if entry is not None:
                name = entry.request.name
                timeline.span(name, f"NEGOTIATE_{response.kind.upper()}", entry.handle.submitted_at, started)
                timeline.span(name, response.kind.upper(), started, ended,
                              {"fused": len(response.names), "dtype": entry.request.dtype})
        timeline.flush()

    def _report_error(self, response, entries: list) -> None:
        mine = [e for e in entries if e is not None]
        _metrics.on_collective_error(response.error, bool(mine))
        if not mine and not any(name in self._abandoned_names for name in response.names):
            log.warning("rank %d: %s", self.rank, response.error)
        self._abandoned_names.difference_update(response.names)
        for entry in mine:
            entry.handle.set_error(HvpsError(response.error))

    def _fail_all(self, error) -> None:
        """Fail every collective in flight with ``error``, or with ``error(entry)`` (one per collective)."""
        with self._lock:
            entries = list(self._pending.values()) + list(self._queue)
            self._pending.clear()
            self._queue.clear()
            self._queued_names.clear()
        for entry in entries + self._running:
            if entry.handle.finished:
                continue
            if isinstance(error, BaseException):
                entry.handle.set_error(error)
            else:
                failure = error(entry)
                _metrics.on_collective_error(str(failure), True)
                entry.handle.set_error(failure)
