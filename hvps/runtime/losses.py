"""Naming the ranks behind a collective that failed in the data plane (issue 38; ``control/liveness.py``)."""

from __future__ import annotations

import time
from typing import Callable, Protocol

from ..control.liveness import SILENT
from .engine_status import EngineStatus

#: after a collective failed in the data plane, how long the engine waits for the control plane to
#: tell which rank died (it knows within milliseconds of the kernel closing the dead rank's sockets), and
#: how long rank 0's roll call waits for the ranks' answers (a stopped rank keeps its sockets open; the live
#: ranks stuck in the same transfer leave it at about the same time, each after its own stall timeout)
LOSS_GRACE_SECONDS = 1.0


class LivenessPlane(Protocol):
    """What the finder needs of the control plane (``ControlPlane``)."""

    stalled: set

    def report_failure(self, what: str, stall: bool) -> None: ...

    def poll(self, timeout): ...

    def roll_call(self, seconds: float, stop) -> tuple: ...


class LostRankFinder:
    """Lets the control plane name the ranks that died or stopped when a transfer failed: a worker reports its
    failure to rank 0, and rank 0 calls the roll (once) after a stall."""

    def __init__(self, rank: int, control: LivenessPlane, status: EngineStatus,
                 peers_lost: Callable[[dict], None], grace_seconds: float = LOSS_GRACE_SECONDS) -> None:
        """``peers_lost({rank: why})`` fails every handle naming the lost ranks and sets ``status.lost``."""
        self.rank = rank
        self._control = control
        self._status = status
        self._peers_lost = peers_lost
        self.grace_seconds = grace_seconds
        #: whether rank 0 has called the roll after a collective failed in a data plane (once: ``roll_call``)
        self.roll_called = False

    def find(self, what: str, stall: bool) -> None:
        """``what`` (a collective and its error) failed in this rank's data plane, by a ``stall`` or not: let the
        control plane name the ranks that died or stopped (``peers_lost``, which fails every handle with their
        names), for up to about the grace. A dead rank's connections close, and the watch tells at
        once. A stopped one's stay open, and a stalled data plane can only name the neighbours that stopped
        sending, which may be waiting for it themselves: so a worker reports its failure to rank 0, and after a
        stall (its own, or one reported) rank 0 calls the roll (``roll_call``); its notice reaches the
        workers through their watch, as a dead rank's does. Without a word, the data plane's error stands."""
        lost = self._status.lost
        if self.rank != 0:
            self._control.report_failure(what, stall)
            # rank 0 stalls at about the same time as this rank (or it is idle and reads the report at once);
            # then its roll call takes up to a grace
            lost.wait(2 * self.grace_seconds if stall else self.grace_seconds)
            return
        # An error of rank 0's own calls no roll: the ranks waiting for it have not stalled yet. Unless a worker
        # reports a stall meanwhile (on shared memory, the rank that stalls ends the others' wait with an error).
        deadline = time.monotonic() + self.grace_seconds
        while not stall and not lost.is_set() and time.monotonic() < deadline:
            self._control.poll(min(0.05, deadline - time.monotonic()))  # the engine stops: what else it reads can go
            stall = bool(self._control.stalled)
        if stall and not lost.is_set():
            self.roll_call()

    def roll_call(self) -> tuple:
        """Rank 0, once, after a transfer stalled: probe the other ranks (``ControlPlane.roll_call``); those that
        neither answer nor report a failed transfer within the grace are lost (``SILENT``): the live
        ranks stuck in the same transfer stalled at about the same time and report it. Returns what the control
        plane said meanwhile, ``(messages, closed)``, for the cycle to handle."""
        if self.roll_called:
            return [], []
        self.roll_called = True
        silent, messages, closed = self._control.roll_call(self.grace_seconds, self._status.lost)
        if silent and not self._status.lost.is_set():
            self._peers_lost({rank: SILENT for rank in silent})
        return messages, closed
