"""Rank 0's side of the negotiation: it feeds every rank's announcements to the coordinator
(``control/negotiation.py``), sends the responses it returns to every rank in order, and hands them to its own
executor. It also holds the shutdown rule's last step (a rank late to shut down is ended only if it still
answers a roll call) and sends ``HVPS_AUTOTUNE``'s settings to the other ranks with the responses."""

from __future__ import annotations

import time
from typing import Callable, Optional, Protocol

from ..control.liveness import SILENT
from ..control.negotiation import SHUTDOWN, Coordinator
from .engine_status import EngineStatus, NegotiationClock
from .losses import LOSS_GRACE_SECONDS


class RankZeroPlane(Protocol):
    """What rank 0's role needs of the control plane (``ControlPlane``)."""

    stalled: set

    def send_down(self, message: dict) -> None: ...

    def roll_call(self, seconds: float, stop) -> tuple: ...


class RollCaller(Protocol):
    """What rank 0's role needs of the lost-rank finder (``LostRankFinder``)."""

    roll_called: bool

    def roll_call(self) -> tuple: ...


class RankZeroCoordinator:
    """Rank 0's negotiation cycle: match the announcements, answer every rank, execute the answers."""

    def __init__(self, size: int, coordinator: Coordinator, control: RankZeroPlane, cache, status: EngineStatus,
                 finder: RollCaller, announcements: Callable[[], list], execute: Callable[[list], None],
                 left_alone: Callable[[list], None], peers_lost: Callable[[dict], None],
                 apply_tuning: Callable[[dict], None], clock: NegotiationClock,
                 grace_seconds: float = LOSS_GRACE_SECONDS) -> None:
        """``cache``: the response cache (``ResponseCache``); ``announcements()``: this rank's requests due now;
        ``execute(responses)``: the executor's; ``left_alone(closed)``: what to do about peers that said goodbye
        alone; ``peers_lost({rank: why})``: fail the engine naming lost ranks; ``apply_tuning(tuning)``: put
        autotuned settings in force on this rank."""
        self.size = size
        self.coordinator = coordinator
        self._control = control
        self._cache = cache
        self._status = status
        self._finder = finder
        self._announcements = announcements
        self._execute = execute
        self._left_alone = left_alone
        self._peers_lost = peers_lost
        self._apply_tuning = apply_tuning
        self._clock = clock
        self._grace_seconds = grace_seconds
        #: autotuned settings not yet sent to the other ranks (guarded by the status lock)
        self._tuning: Optional[dict] = None
        #: a relay keeps the engine listening while it holds nothing; rank 0 is no relay
        self.listens_always = False
        #: the node's fast lane (``fast_lane.FastLane``), whose undecided posts this rank settles; or None
        self.lane = None

    def deadline(self) -> Optional[float]:
        """When the oldest pending collective, or a shutdown some ranks asked for, stalls; or None."""
        return self.coordinator.next_deadline()

    def busy(self) -> bool:
        """Whether the coordinator waits for other ranks (its stall checks must keep running)."""
        return self.coordinator.next_deadline() is not None

    def set_changed(self, response) -> None:
        """An agreed process-set change: the coordinator tracked it when it agreed (``Coordinator.poll``)."""

    def cycle(self, messages: list, closed: list) -> None:
        """One turn on ``messages`` (``(rank, message)`` pairs the control plane read) and the ranks whose
        connections ``closed``: match, answer every rank, execute."""
        mark = self._clock.start()
        if self._control.stalled and not self._finder.roll_called:  # a worker's transfer stalled: did a rank stop?
            more, gone = self._finder.roll_call()
            messages, closed = messages + more, closed + gone
            if self._status.failure is not None:
                return
        now = time.monotonic()
        own = self._cache.canonical(self._announcements())
        self.coordinator.submit(0, own, now)
        for source, message in messages:
            self.coordinator.submit_pairs(self._cache.resolve(source, message), now)
        if self.lane is not None:  # other ranks' posts in the fast lane wait for nothing once rank 0 is busy here
            self.lane.settle(bool(own or messages) or self.coordinator.next_deadline() is not None)
        self._left_alone(closed)
        if self._status.failure is not None:
            return
        responses = self.coordinator.poll(time.monotonic())
        if not self.late_ranks_answer(responses):
            return
        if responses and self.size > 1:  # alone, rank 0 has no one to tell (nor a cache to keep)
            wire = {"responses": self._cache.encode_responses(responses)}
            if self._tuning is not None:
                with self._status.lock:
                    wire["tuning"], self._tuning = self._tuning, None
            self._control.send_down(wire)
        self._clock.stop(mark)
        self._execute(responses)

    def late_ranks_answer(self, responses: list) -> bool:
        """Whether the ranks that did not ask for a shutdown among ``responses`` (the coordinator ends hvps
        everywhere once the first rank asked a stall time ago) are alive: rank 0 calls the roll first. A late rank
        busy in its own code answers, and the shutdown goes on (its collectives then fail, saying why). One that
        is stopped or hung answers nothing: it is lost (``SILENT``), this engine fails, and the job is aborted
        rather than left waiting for it in MPI_Finalize for ever. Always true when no shutdown is early."""
        early = next((r for r in responses if r.kind == SHUTDOWN and len(r.asked) < self.size), None)
        if early is None:
            return True
        late = set(range(self.size)) - set(early.asked)
        silent, messages, closed = self._control.roll_call(self._grace_seconds, self._status.lost)
        for source, message in messages:  # what else arrived meanwhile: the next poll's
            self.coordinator.submit_pairs(self._cache.resolve(source, message), time.monotonic())
        self._left_alone(closed)
        lost = {rank: SILENT for rank in silent if rank in late}
        if lost and self._status.failure is None:
            self._peers_lost(lost)
        return self._status.failure is None

    def tune(self, fusion_threshold: int, cycle_time_ms: float) -> None:
        """Put autotuned settings in force here and send them to the other ranks with the next responses."""
        self.coordinator.fusion_threshold = fusion_threshold
        tuning = {"fusion_threshold": fusion_threshold, "cycle_time_ms": cycle_time_ms}
        self._apply_tuning(tuning)
        with self._status.lock:
            self._tuning = tuning
