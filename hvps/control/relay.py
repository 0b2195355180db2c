"""A relay's merge of its subtree's announcements, so that its parent hears one entry per request for the block.

A rank with both a parent and children in the control-plane tree (``tree.py``) collects what its subtree
announces: its own requests and its children's messages. Announcements of the same response-cache bit
merge into one entry listing the ranks as spans ``[low, high)``, and the relay holds a bit until every
rank of its subtree that the request's process set includes has announced it: then the entry is one span
however large the subtree, and rank 0 does one step of matching for the whole block. Holding costs no
latency, since the collective cannot run before those ranks announce it anyway. A bit some of them never
announce in time (a rank that joined, a mismatch, a stall) goes up as it is after ``hold_s``, so rank 0
still names the missing ranks. Full requests (uncached: a first step, join, shutdown, a failure) go up at
once and unmerged, one per rank, so that rank 0 compares every rank's arguments as in a star.

Upward messages are ``{"whole": [bit, ...], "batch": [[item, [[low, high], ...]], ...], "epoch": e}``:
``whole`` lists the bits every rank of the subtree announced (the steady state: one integer per request
for the whole block), ``batch`` the rest by spans. ``e`` is at most every epoch the subtree reported
with what is in the buffer or after it, a safe bound for rank 0's pruning of evicted bits
(``response_cache.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from ..core.errors import HvpsError


@dataclass
class _Held:
    """One bit's announcements so far."""

    since: float
    epoch: int
    spans: list = field(default_factory=list)
    count: int = 0


class RelayBuffer:
    """Announcements of the ranks ``subtree`` not yet sent up."""

    def __init__(self, subtree: range, blocks: tuple, hold_s: float,
                 expected: Optional[Callable[[int], int]] = None) -> None:
        """``blocks``: the children's subtrees; ``expected(bit)``: how many of the subtree's ranks announce
        that bit (default: all of them)."""
        self.subtree = subtree
        self._blocks = {block.start: block for block in blocks}
        self.hold_s = hold_s
        self._expected = expected or (lambda bit: len(subtree))
        #: each child -> the epoch its subtree last reported (0 until then: a safe bound)
        self._epochs = dict.fromkeys(self._blocks, 0)
        self._held: dict[int, _Held] = {}
        #: full requests, passed up at once: [item, spans, epoch]
        self._passing: list = []

    def __bool__(self) -> bool:
        return bool(self._held or self._passing)

    def add(self, source: int, message: dict, now: float) -> None:
        """Take a message from ``source``: this rank, with its own announcement, or a child."""
        try:
            epoch = int(message.get("epoch", 0))
            if source in self._epochs:
                self._epochs[source] = epoch
            for item in message.get("requests", ()):
                self._add(item, [[source, source + 1]], epoch, now)
            for item, spans in message.get("batch", ()):
                self._add(item, [[int(low), int(high)] for low, high in spans], epoch, now)
            whole = message.get("whole", ())
            if whole:
                block = self._blocks[source]
                for item in whole:
                    self._add(item, [[block.start, block.stop]], epoch, now)
        except (TypeError, ValueError, KeyError) as exc:
            raise HvpsError(f"rank {source} sent the control-plane relay a malformed announcement: {exc!r}") from None

    def _add(self, item: object, spans: list, epoch: int, now: float) -> None:
        if not isinstance(item, int) or isinstance(item, bool):
            if not isinstance(item, dict):
                raise TypeError(f"{item!r} is neither a bit nor a request")
            self._passing.append([item, spans, epoch])
            return
        held = self._held.get(item)
        if held is None:
            held = self._held[item] = _Held(now, epoch)
        held.spans.extend(spans)
        held.count += sum(high - low for low, high in spans)
        held.epoch = min(held.epoch, epoch)

    def deadline(self) -> Optional[float]:
        """When something must go up even if parts of the subtree are still missing (None: nothing held)."""
        if self._passing:
            return 0.0
        if not self._held:
            return None
        return min(held.since for held in self._held.values()) + self.hold_s

    def take(self, now: float, epoch_now: int) -> Optional[dict]:
        """The upward message of what is due now (None: nothing is), spans merged where they touch.
        ``epoch_now``: this rank's response-cache epoch."""
        due = [bit for bit, held in self._held.items()
               if held.count >= self._expected(bit) or now >= held.since + self.hold_s]
        if not due and not self._passing:
            return None
        epoch = min(epoch_now, *self._epochs.values(), *(h.epoch for h in self._held.values()),
                    *(epoch for _, _, epoch in self._passing))
        batch = [[item, spans] for item, spans, _ in self._passing]
        whole, everyone = [], [[self.subtree.start, self.subtree.stop]]
        for bit in due:
            spans = _coalesce(self._held.pop(bit).spans)
            if spans == everyone:
                whole.append(bit)
            else:
                batch.append([bit, spans])
        self._passing = []
        message: dict = {"epoch": epoch}
        if whole:
            message["whole"] = whole
        if batch:
            message["batch"] = batch
        return message


def _coalesce(spans: list) -> list:
    """``[low, high)`` spans sorted, and merged where one ends where the next begins."""
    merged: list = []
    for low, high in sorted(spans):
        if merged and merged[-1][1] == low:
            merged[-1][1] = high
        else:
            merged.append([low, high])
    return merged
