"""The shape of the control plane: a tree of ranks in which every subtree is a block of consecutive ranks.

Rank 0 is the root. The ranks below a rank ``r`` (``r + 1`` up to its subtree's end) are split into at most
``fanout`` blocks of near-equal size; the first rank of each block is a child of ``r`` and the root of
that block. With ``size - 1 <= fanout`` this is a star (every rank talks to rank 0 alone), which is what
small jobs get. Above it, rank 0 hears from ``fanout`` children instead of every rank, each of which
passes on its block's announcements merged (``relay.py``): the coordinator's work per step grows with
the fan-out, not with the job (``HVPS_CONTROL_FANOUT``).

Because a block is consecutive, "every rank of my subtree" is one ``range``, and the ranks an
``mpirun --map-by slot`` job places on one host sit together in the low levels of the tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Position:
    """One rank's place in the tree."""

    rank: int
    #: the rank it announces to and hears responses from (None: rank 0)
    parent: Optional[int]
    #: the subtrees of the ranks that announce to it (each child is its block's first rank), in order
    blocks: tuple
    #: the ranks of its subtree, itself first
    subtree: range

    @property
    def children(self) -> tuple:
        return tuple(block.start for block in self.blocks)

    @property
    def is_relay(self) -> bool:
        """Whether this rank passes other ranks' messages on (a rank with both a parent and children)."""
        return self.parent is not None and bool(self.blocks)


def _blocks(first: int, end: int, fanout: int) -> list:
    """``range(first, end)`` cut into at most ``fanout`` consecutive blocks, sizes differing by at most one."""
    count = min(fanout, end - first)
    if count <= 0:
        return []
    base, extra = divmod(end - first, count)
    blocks, low = [], first
    for index in range(count):
        high = low + base + (index < extra)
        blocks.append(range(low, high))
        low = high
    return blocks


def position(rank: int, size: int, fanout: int) -> Position:
    """Where ``rank`` of a ``size``-rank job sits in the tree of the given ``fanout`` (>= 1)."""
    if fanout < 1:
        raise ValueError(f"the control plane's fan-out must be at least 1, not {fanout}")
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a job of {size} ranks")
    node, block, parent = 0, range(0, size), None
    while node != rank:
        for child in _blocks(node + 1, block.stop, fanout):
            if rank in child:
                parent, node, block = node, child.start, child
                break
    return Position(rank, parent, tuple(_blocks(rank + 1, block.stop, fanout)), block)
