"""A relay's merge of its subtree's announcements, so that its parent hears one message for the block.

A rank with children in the control-plane tree (``tree.py``) collects what its subtree announces: its
own requests and its children's messages. Identical announcements (the same response-cache bit) merge
into one entry that lists the ranks as spans ``[low, high)``: when every rank of the subtree announced
a bit, the entry is one span, however large the subtree. Uncached requests (full JSON) travel
unmerged, one entry per rank, so that the coordinator still compares every rank's arguments.

The merge goes up when every request in it has been announced by the whole subtree, or a cycle after
its oldest part arrived, whichever comes first: a synchronous collective waits for its slowest rank and
no longer, and a burst of gradients goes up at most once per cycle, as a rank's own announcements do.

Upward messages are ``{"batch": [[item, [[low, high], ...]], ...], "epoch": e}``; ``e`` is the lowest
response-cache epoch the subtree has reported, a safe bound for rank 0's pruning of evicted bits.
"""

from __future__ import annotations

from typing import Optional

from ..core.errors import HvpsError


class RelayBuffer:
    """Announcements of the subtree ``subtree`` (a range of ranks) not yet sent up."""

    def __init__(self, subtree: range, children: tuple) -> None:
        self.subtree = subtree
        #: each child -> the epoch its subtree last reported (0 until then: a safe bound)
        self._epochs = dict.fromkeys(children, 0)
        #: the epoch of this rank's own announcement in the buffer (None: none there)
        self._own_epoch: Optional[int] = None
        self._entries: list = []
        #: response-cache bit -> its entry (identical announcements merge)
        self._by_bit: dict = {}
        #: bit or name -> ranks that announced it so far
        self._counts: dict = {}
        self._since: Optional[float] = None

    def __bool__(self) -> bool:
        return bool(self._entries)

    def add(self, source: int, message: dict, now: float) -> None:
        """Take a message from ``source`` (this rank, with its own announcement, or a child)."""
        try:
            epoch = int(message.get("epoch", 0))
            if source in self._epochs:
                self._epochs[source] = epoch
            elif source == self.subtree.start and self._own_epoch is None:
                self._own_epoch = epoch
            for item in message.get("requests", ()):
                self._add(item, [[source, source + 1]])
            for item, spans in message.get("batch", ()):
                self._add(item, [[int(low), int(high)] for low, high in spans])
        except (TypeError, ValueError, KeyError) as exc:
            raise HvpsError(f"rank {source} sent the control-plane relay a malformed announcement: {exc!r}") from None
        if self._since is None and self._entries:
            self._since = now

    def _add(self, item: object, spans: list) -> None:
        bit = isinstance(item, int) and not isinstance(item, bool)
        key = item if bit else item["name"]
        self._counts[key] = self._counts.get(key, 0) + sum(high - low for low, high in spans)
        entry = self._by_bit.get(item) if bit else None
        if entry is None:
            entry = [item, []]
            self._entries.append(entry)
            if bit:
                self._by_bit[item] = entry
        entry[1].extend(spans)

    def deadline(self, cycle_s: float) -> Optional[float]:
        """When the merge must go up even if parts of the subtree are still missing."""
        return None if self._since is None else self._since + cycle_s

    def due(self, now: float, cycle_s: float) -> bool:
        """Whether to send the merge up now: the whole subtree announced all of it, or it waited a cycle."""
        if not self._entries:
            return False
        if now >= self._since + cycle_s:
            return True
        whole = len(self.subtree)
        return all(count >= whole for count in self._counts.values())

    def take(self, epoch_now: int) -> dict:
        """The upward message, spans merged where they touch; the buffer starts over. ``epoch_now``: this
        rank's response-cache epoch (its own announcement in the buffer may be older)."""
        batch = [[item, _coalesce(spans)] for item, spans in self._entries]
        own = epoch_now if self._own_epoch is None else self._own_epoch
        epoch = min(own, *self._epochs.values())
        self._entries, self._by_bit, self._counts, self._since, self._own_epoch = [], {}, {}, None, None
        return {"batch": batch, "epoch": epoch}


def _coalesce(spans: list) -> list:
    """``[low, high)`` spans sorted, and merged where one ends where the next begins."""
    merged: list = []
    for low, high in sorted(spans):
        if merged and merged[-1][1] == low:
            merged[-1][1] = high
        else:
            merged.append([low, high])
    return merged
