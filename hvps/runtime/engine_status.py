"""What the engine's roles share: whether it still runs (``EngineStatus``) and the time it spent negotiating
(``NegotiationClock``). The roles themselves are ``submission.py`` (the queue and the waiter fast path),
``coordinator.py`` (rank 0), ``worker.py`` (the other ranks and the control-plane tree's relays),
``execution.py`` (running the agreed responses) and ``losses.py`` (naming the ranks lost); ``engine.py``
composes them around the engine thread.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

from ..core.errors import HvpsError


class EngineStatus:
    """Whether the engine runs, stops, failed or was ended by other ranks; ``lock`` guards it together with
    the submission queue (``SubmissionQueue``), so that a submission and a failure never cross."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: why the engine failed (a cycle raised, or ranks were lost): every handle has had its error
        self.failure: Optional[BaseException] = None
        #: set once every rank agreed to stop (or this rank's shutdown began)
        self.stopping = False
        #: set when other ranks' shutdown ended this engine (``Executor.ended_by_others``): what its collectives raise
        self.ended: Optional[HvpsError] = None
        #: set once ranks were found dead (``EngineFailures.peers_lost``); a collective in flight then gives up
        self.lost = threading.Event()

    @property
    def running(self) -> bool:
        """Whether the engine neither stops nor failed."""
        return not self.stopping and self.failure is None


class NegotiationClock:
    """The time this rank's engine spent negotiating (announcing, matching, encoding, decoding)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        #: when set (a benchmark does), the CPU time of the same (thread_time costs 0.6 us a call, so off)
        self.count_cpu = False
        self.cpu_seconds = 0.0

    def start(self) -> tuple:
        """A mark to pass to ``stop``: the wall clock and, when counted, the thread's CPU time now."""
        return time.perf_counter(), time.thread_time() if self.count_cpu else None

    def stop(self, mark: tuple) -> None:
        """Count the time since ``mark`` (``start``'s)."""
        started, cpu = mark
        self.seconds += time.perf_counter() - started
        if cpu is not None:
            self.cpu_seconds += time.thread_time() - cpu
