"""How the engine fails: every collective in flight gets the error, once, whichever thread found it (the engine
thread, a waiter driving a cycle, the control plane's watch, the backend's watchdog)."""

from __future__ import annotations

import logging
from typing import Callable, Protocol

from .. import metrics as _metrics
from ..control.liveness import PeerLost
from ..core.errors import HvpsError
from .engine_status import EngineStatus

log = logging.getLogger("hvps")


class FarewellPlane(Protocol):
    """What failing needs of the control plane (``ControlPlane``)."""

    def farewell(self, lost: dict) -> None: ...

    def wake(self) -> None: ...


class EngineFailures:
    """Turns an exception of a cycle, or ranks lost, into the engine's failure and every handle's error."""

    def __init__(self, rank: int, status: EngineStatus, control: FarewellPlane, in_flight: Callable[[], list],
                 on_engine_thread: Callable[[], bool]) -> None:
        """``in_flight()`` takes out every entry queued, pending or running; ``on_engine_thread()`` says whether
        the calling thread is the engine's (an interrupt of any other goes on up it)."""
        self.rank = rank
        self._status = status
        self._control = control
        self._in_flight = in_flight
        self._on_engine_thread = on_engine_thread
        self._stop_the_engine = _StopTheEngine(self.failed, on_engine_thread)

    def stop_the_engine(self) -> "_StopTheEngine":
        """A context in which any exception is the engine's failure, surfaced on every handle; an interrupt of a
        driving user thread (Ctrl-C) also goes on up that thread.

        Returns:
            The context manager (one per engine: it holds no state; a class, as a generator's context manager
            cost every synchronous call ~2 us).
        """
        return self._stop_the_engine

    def failed(self, exc: BaseException) -> None:
        """A cycle raised ``exc`` (on the engine thread or a driving waiter): fail everything, once."""
        status = self._status
        with status.lock:
            first, status.failure = status.failure is None, status.failure or exc
        if not first:
            return  # a rank died meanwhile (peers_lost): this is a consequence, already reported
        if isinstance(exc, HvpsError):
            log.error("hvps rank %d: %s", self.rank, exc)
            reason = str(exc)
        else:  # a fault of hvps itself: its type, which an empty message would not even name, and where to look
            log.exception("hvps engine failed on rank %d", self.rank)
            reason = f"{type(exc).__name__}: {exc} (an internal error; its traceback is in rank {self.rank}'s log)"
        _metrics.on_engine_failure()
        self.fail_all(HvpsError(f"the hvps engine stopped on rank {self.rank} after: {reason}"))

    def peers_lost(self, lost: dict) -> None:
        """Ranks died (the control plane's watch, or this thread's poll) or stopped (a roll call): fail every
        collective in flight at once, naming them, and stop. Rank 0 passes the word on to the other ranks."""
        error = PeerLost(lost)
        status = self._status
        with status.lock:
            if not status.running:
                return
            status.failure = error
        log.error("hvps rank %d: %s", self.rank, error)
        self._control.farewell(error.lost)
        self.fail_all(lambda entry: error.for_collective(entry.request.kind, entry.request.name))
        status.lost.set()  # after the handles have their errors (LostRankFinder.find waits for it)
        self._control.wake()

    def left_alone(self, closed: list) -> None:
        """Peers that said goodbye before every rank agreed to stop have left the job: it cannot go on."""
        if closed and not self._status.stopping:
            self.peers_lost({rank: "it shut its control connection down alone (its hvps engine stopped)"
                             for rank in closed})

    def fail_all(self, error) -> None:
        """Fail every collective in flight with ``error``, or with ``error(entry)`` (one per collective)."""
        for entry in self._in_flight():
            if entry.handle.finished:
                continue
            if isinstance(error, BaseException):
                entry.handle.set_error(error)
            else:
                failure = error(entry)
                _metrics.on_collective_error(str(failure), True)
                entry.handle.set_error(failure)


class _StopTheEngine:
    """``EngineFailures.stop_the_engine``'s context: ``failed(exc)`` for any exception, which goes on up unless it
    is an ``Exception`` or ``on_engine_thread()`` (an interrupt of a driving waiter goes on up it)."""

    __slots__ = ("_failed", "_on_engine_thread")

    def __init__(self, failed: Callable[[BaseException], None], on_engine_thread: Callable[[], bool]) -> None:
        self._failed, self._on_engine_thread = failed, on_engine_thread

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, traceback: object) -> bool:
        if exc is None:
            return False
        self._failed(exc)
        return isinstance(exc, Exception) or self._on_engine_thread()
