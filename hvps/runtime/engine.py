"""The engine: it owns every data-plane call, and a background thread runs it.

Each rank queues collectives locally; the engine announces them to rank 0's
coordinator (at most once per cycle, so that tensors arriving together fuse; above 17 ranks
through relays of the control-plane tree, ``control/tree.py``), which answers with the
responses every rank executes in the same order (see ``negotiation.py``). Between messages
the thread blocks in ``select`` on the control plane (``plane.py``), so it takes no CPU from
training while it waits.

``Engine`` composes the roles, each in a module of its own, and owns the thread and the cycle loop:

- ``submission.py``: the queue user threads submit to, and the fast path, on which a thread that waits for
  the only collective in flight runs the engine's cycles itself (``FastPath``);
- ``coordinator.py``: rank 0's side of the negotiation (matching, answering, the shutdown rule's roll call,
  the autotuner's settings);
- ``worker.py``: the other ranks' side, and the control-plane tree's relays;
- ``execution.py``: running the agreed responses on the data planes;
- ``losses.py``: naming the ranks that died or stopped when a transfer failed;
- ``failures.py``: the engine's failure, and every handle's error with it;
- ``engine_status.py``: whether the engine runs, which every role reads.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Optional

from ..control.negotiation import SHUTDOWN, Coordinator, Request
from ..control.plane import ControlPlane
from ..control.response_cache import ResponseCache
from ..core.errors import HvpsError
from ..core.handle import Handle, watchdog_seconds
from ..core.timeline import Timeline
from ..dataplane.executors import Entry
from .autotune import Autotuner, Setting
from .coordinator import RankZeroCoordinator
from .engine_status import EngineStatus, NegotiationClock
from .execution import Executor
from .failures import EngineFailures
from .fast_lane import FastLane
from .losses import LostRankFinder
from .submission import FastPath, SubmissionQueue, waits_at_once
from .worker import RELAY_HOLD_CYCLES, WorkerNegotiation

__all__ = ["Engine", "poll_timeout", "waits_at_once"]

log = logging.getLogger("hvps")

#: an idle engine reads unasked messages (other ranks' announcements, which only rank 0 gets) this often;
#: its own submissions wake it at once
_IDLE_READ_SECONDS = 0.05


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
        self.status = EngineStatus()
        self.clock = NegotiationClock()
        #: the fusion threshold and cycle time in force (HVPS_AUTOTUNE changes them during a run)
        self.fusion_threshold, self.cycle_s = settings.fusion_threshold, settings.cycle_time_ms / 1000.0
        self.control = ControlPlane(comm, key=control_key, fanout=settings.control_fanout)
        tree = self.control.position
        self.cache = ResponseCache(settings.cache_capacity, self.size, self.rank,
                                   children={block.start: block for block in tree.blocks})
        self.queue = SubmissionQueue(self.rank, self.status, settings.stall_fail_seconds, self.control.wake,
                                     expedite=self._expedite, fusion_threshold=lambda: self.fusion_threshold)
        self.failures = EngineFailures(self.rank, self.status, self.control,
                                       lambda: self.queue.drain() + self.executor.running,
                                       lambda: threading.current_thread() is self._thread)
        self.finder = LostRankFinder(self.rank, self.control, self.status, self.failures.peers_lost)
        self.executor = Executor(self.rank, self.size, backend, self.status, self.queue, self.finder.find,
                                 self.failures.fail_all, self._set_changed, lambda: self.fusion_threshold)
        self.negotiation = self._negotiation(settings)
        #: rank 0's search, when HVPS_AUTOTUNE=1; its settings reach the other ranks with the next responses
        self.autotuner = (Autotuner(Setting(settings.fusion_threshold, settings.cycle_time_ms),
                                    settings.autotune_warmup_steps, settings.autotune_steps_per_sample)
                          if settings.autotune and self.rank == 0 else None)
        backend.interrupt_on(self.status.lost)
        backend.report_failures_to(self.failures.failed)  # NCCL's asynchronous errors and timeouts (tdist.NcclWatch)
        #: held by whichever thread runs a cycle: the engine thread, or a waiter that drives it (FastPath)
        self._cycle_lock = threading.Lock()
        self.fast_path = FastPath(self.queue, self.status, self.executor, self._cycle_lock, self._cycle,
                                  self.failures.stop_the_engine, self._outstanding, self.control.wake,
                                  settings.spin_wait_us / 1e6)
        self.fast_path.lane = self._fast_lane(backend, settings)
        if self.rank == 0:
            self.negotiation.lane = self.fast_path.lane
        if settings.timeline and settings.timeline != "DYNAMIC":  # DYNAMIC: start_timeline() later
            self.start_timeline(settings.timeline, settings.timeline_mark_cycles)
        if self.autotuner is not None:
            self._tune(self.autotuner.first())
        # A dead rank fails what is in flight at once, even while this thread is inside a transfer.
        self.control.watch(self.failures.peers_lost)
        self._thread = threading.Thread(target=self._run, name="hvps-engine", daemon=True)
        self._thread.start()

    def _fast_lane(self, backend, settings) -> Optional[FastLane]:
        """The fast lane on the node's segment, when every rank of the job shares it (and the fast path, the
        response cache and ``HVPS_FAST_LANE`` are on); else None."""
        segment = getattr(backend, "segment", None)
        if (segment is None or segment.size != self.size or segment.rank != self.rank or self.size == 1
                or not self.control.is_star
                or not settings.fast_lane or settings.cache_capacity <= 0 or settings.spin_wait_us <= 0):
            return None

        def poke() -> None:  # an empty announcement: wakes rank 0's engine, which settles the lane
            self.control.send(0, self.cache.announce([]))

        return FastLane(segment, self.rank, self.size, self.cache, self.status, settings.spin_wait_us / 1e6,
                        watchdog_seconds(settings.stall_fail_seconds), poke)

    def _negotiation(self, settings) -> "RankZeroCoordinator | WorkerNegotiation":
        """This rank's side of the negotiation: rank 0's coordination, or a worker's (a relay's) announcing."""
        def announcements() -> list:
            return self.queue.due_announcements(self.cycle_s)

        if self.rank == 0:
            coordinator = Coordinator(self.size, settings.fusion_threshold, settings.stall_fail_seconds,
                                      settings.stall_warn_seconds)
            return RankZeroCoordinator(self.size, coordinator, self.control, self.cache, self.status, self.finder,
                                       announcements, self.executor.execute, self.failures.left_alone,
                                       self.failures.peers_lost,
                                       self._apply_tuning, self.clock)
        return WorkerNegotiation(self.rank, self.control, self.cache, announcements, self.executor.execute,
                                 self.failures.left_alone, self._apply_tuning, self.clock, RELAY_HOLD_CYCLES * self.cycle_s)

    # -- called from user threads -------------------------------------------------
    def submit(self, entry: Entry) -> Handle:
        """Queue ``entry`` and return its handle."""
        return self.queue.submit_all([entry])[0]

    def submit_all(self, entries: list) -> list:
        """Queue every entry, or none of them (a name in flight raises first); returns their handles."""
        return self.queue.submit_all(entries)

    def wake_if_queued(self) -> None:
        """Wake the engine thread if collectives wait in the queue (and no wake-up is on its way)."""
        self.queue.wake_if_queued()

    def abandon(self, request: Request) -> None:
        """Tell the other ranks that this rank could not submit ``request`` (its ``failure`` says why):
        the coordinator fails it on every rank at once instead of letting them wait for a stall."""
        self.queue.abandon(request)

    def _expedite(self, handle: Handle) -> None:
        """A thread is about to block on ``handle`` (``FastPath.expedite``)."""
        self.fast_path.expedite(handle)

    def step_done(self) -> None:
        """A training step ended on this rank (the adapters call it once per optimizer step)."""
        if self.autotuner is not None and not self.autotuner.done:
            setting = self.autotuner.step(time.monotonic())
            if setting is not None:
                self._tune(setting)

    def _tune(self, setting: Setting) -> None:
        """Apply ``setting`` here (rank 0) and send it to the other ranks with the next responses."""
        self.negotiation.tune(setting.fusion_threshold, setting.cycle_time_ms)

    def _apply_tuning(self, tuning: dict) -> None:
        self.fusion_threshold = int(tuning["fusion_threshold"])
        self.cycle_s = float(tuning["cycle_time_ms"]) / 1000.0

    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        """Write the timeline to ``path`` from now on (rank 0 writes; other ranks keep none)."""
        if self.rank != 0:
            return
        old, self.executor.timeline = self.executor.timeline, Timeline(path, mark_cycles)
        if old is not None:
            old.close()

    def stop_timeline(self) -> None:
        """Stop writing the timeline and close its file."""
        old, self.executor.timeline = self.executor.timeline, None
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
        status = self.status
        why = status.failure and f"the hvps engine stopped: {str(status.failure).removeprefix('hvps: ')}"
        unanswered = self.queue.unanswered()
        if why is None and unanswered:  # failed by a waiter's watchdog: rank 0 never answered them
            why = f"rank 0 (the coordinator) never answered {unanswered[:3]}"
        if why is None and status.ended is None:  # (other ranks' shutdown ended this engine: nothing to agree)
            handle = self.submit(Entry(Request("shutdown", SHUTDOWN), []))
            try:
                handle.wait(timeout=self.settings.stall_fail_seconds + 5)
            except HvpsError as exc:
                why = f"the ranks did not agree to shut down: {exc}"
        with status.lock:
            status.stopping = True
        self.control.wake()
        self._thread.join(timeout=5 if why is None else 1)  # a failed engine's thread is gone, or stuck
        stuck = self._thread.is_alive()
        if stuck and why is None:
            why = "the hvps engine thread is stuck inside a collective"
        self.failures.fail_all(HvpsError("hvps was shut down before this collective completed"))
        if not stuck:
            self.control.close()
        self.stop_timeline()
        return why

    # -- what benchmarks and tests read (and set) -----------------------------------
    @property
    def spin_seconds(self) -> float:
        """How long a waiter drives the engine before it blocks (seconds; 0: never)."""
        return self.fast_path.spin_seconds

    @spin_seconds.setter
    def spin_seconds(self, seconds: float) -> None:
        self.fast_path.spin_seconds = seconds

    @property
    def driven_collectives(self) -> int:
        """Collectives that a waiting thread executed itself (the fast path)."""
        return self.executor.driven_collectives

    @property
    def negotiation_seconds(self) -> float:
        """Time this rank's engine spent negotiating (announcing, matching, encoding, decoding)."""
        return self.clock.seconds

    @property
    def negotiation_cpu_seconds(self) -> float:
        """The CPU time of the same, while ``count_cpu`` is set."""
        return self.clock.cpu_seconds

    @property
    def count_cpu(self) -> bool:
        """Whether the negotiation's CPU time is counted too (a benchmark sets it)."""
        return self.clock.count_cpu

    @count_cpu.setter
    def count_cpu(self, on: bool) -> None:
        self.clock.count_cpu = on

    @property
    def _ended(self) -> Optional[HvpsError]:
        """Set when other ranks' shutdown ended this engine: what its collectives raise."""
        return self.status.ended

    # -- the engine thread ----------------------------------------------------------
    def _run(self) -> None:
        status, queue = self.status, self.queue
        with self.failures.stop_the_engine():
            while status.running:
                timeout = self._timeout()
                with status.lock:  # decided together with submit(), so no wake-up is lost
                    if queue.has_due(time.monotonic()) or self.executor.backlog:
                        timeout = 0.0
                    # "More than a cycle", with slack: (now + cycle) - now rounds to a hair above
                    # a cycle, which would make every submission pay for a wake-up while active.
                    queue.sleeping = timeout is None or timeout > 1.5 * self.cycle_s
                    # A waiter driving the engine (FastPath.drive) reads the messages itself, and wakes this
                    # thread when it stops with anything outstanding: meanwhile, woken by each message, this
                    # thread would only queue up for the cycle lock (a context switch per message).
                    idle = (timeout is None and not self.negotiation.listens_always
                            and (self.executor.on_waiter or not self._outstanding()))
                if idle:  # nothing of ours in flight, or a waiter drives: unasked messages can wait
                    self.control.wait(_IDLE_READ_SECONDS, messages=False)
                else:
                    self.control.wait(timeout)
                with self._cycle_lock:  # a waiter may be driving: it reads what woke us
                    if not status.running:
                        break
                    self._cycle()

    def _cycle(self) -> None:
        """One turn: read the control plane, take the queue, negotiate, execute (the cycle lock is held)."""
        messages, closed = self.control.poll(0.0)
        timeline = self.executor.timeline
        if timeline is not None and timeline.mark_cycles:
            timeline.mark("CYCLE_START")
        self.queue.take(self.cycle_s, self.executor.on_waiter)
        self.negotiation.cycle(messages, closed)

    def _outstanding(self) -> bool:
        """Whether the engine thread has anything to do or watch (the status lock is held)."""
        return (self.queue.has_work() or bool(self.executor.backlog) or self.negotiation.busy()
                or not self.status.running)

    def _timeout(self) -> Optional[float]:
        """How long poll may block: a cycle while active, else until the next announcement or
        relay or stall deadline, else forever."""
        now = time.monotonic()
        deadlines = self.queue.deadlines(now, self.cycle_s)
        deadline = self.negotiation.deadline()
        if deadline is not None:
            deadlines.append(deadline)
        return poll_timeout(min(deadlines), now) if deadlines else None

    def _set_changed(self, response) -> None:
        """An agreed process-set change, before the executor builds or frees its data plane."""
        self.negotiation.set_changed(response)
