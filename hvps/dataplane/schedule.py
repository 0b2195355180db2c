"""The one schedule of hvps's bandwidth-optimal allreduce, shared by every data plane that runs it.

``ring.py`` (MPI point-to-point messages), ``backends/shm.py`` (a node's shared-memory segment) and
``backends/sealed.py`` (sealed messages) only move bytes; what moves where, in which order, and in
which order contributions are folded is decided here, once:

- **partition**: the buffer is cut into one block per rank (:func:`segments`, or
  :func:`bounds_of_counts` for a reducescatter's or allgather's own counts); rank ``t`` owns block ``t``;
- **chunk windows**: every block is walked in rounds of ``width`` elements; round ``k`` of block
  ``t`` is :meth:`Schedule.window` ``(t, k)``, possibly empty. Every rank runs the same number of
  rounds (:attr:`Schedule.rounds`, those of the longest block), zero-length windows included, so
  uneven and empty blocks never leave one rank waiting for a message another never sends;
- **reduce-scatter by pairwise exchange** (:func:`pairwise_exchanges`): at step ``s = 1 .. n-1``
  rank ``r`` sends block ``r+s`` to its owner and receives its own block from rank ``r-s``;
  the owner folds the ``n`` contributions **in rank order** (:func:`fold_in_rank_order`), so every
  plane, chunk size and buffer layout gives the same bits;
- **ring allgather** (:func:`ring_gather_steps`): at step ``s = 0 .. n-2`` rank ``r`` sends block
  ``r-s`` (its own at step 0, then the one it received the step before) to ``r+1`` and receives
  block ``r-s-1`` from ``r-1``.

All ranks are taken modulo ``n``. Everything here is pure arithmetic: no communication, no state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..core.dtypes import quiet_arithmetic

Bound = tuple  # (start, stop) of one block, in elements


def segments(count: int, parts: int) -> list:
    """Bounds of ``parts`` nearly equal blocks of ``count`` elements, the first ones one longer.

    Args:
        count: elements in the whole buffer.
        parts: number of blocks (ranks).

    Returns:
        ``parts`` ``(start, stop)`` pairs that tile ``[0, count)`` in order.
    """
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def bounds_of_counts(counts: Sequence[int]) -> list:
    """Bounds of consecutive blocks of ``counts[i]`` elements each.

    Args:
        counts: the length of each rank's block, in rank order.

    Returns:
        One ``(start, stop)`` pair per count, tiling ``[0, sum(counts))`` in order.
    """
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + int(count)))
        start += int(count)
    return bounds


def window(bound: Bound, offset: int, width: int) -> slice:
    """The part of block ``bound`` from ``offset`` elements into it, at most ``width`` long (possibly empty).

    Args:
        bound: ``(start, stop)`` of the block.
        offset: elements from the block's start.
        width: most elements in the window.

    Returns:
        A slice of the whole buffer, clipped to the block.
    """
    lo, hi = bound
    return slice(min(lo + offset, hi), min(lo + offset + width, hi))


@dataclass(frozen=True)
class Exchange:
    """One step of the pairwise reduce-scatter: send block ``to`` to rank ``to``, receive one's own block
    from rank ``source``."""

    step: int
    to: int
    source: int


@dataclass(frozen=True)
class GatherStep:
    """One step of the ring allgather: send block ``send_block`` to the right neighbour, receive block
    ``recv_block`` from the left one."""

    step: int
    send_block: int
    recv_block: int


def pairwise_exchanges(rank: int, size: int) -> list:
    """The reduce-scatter's steps for ``rank`` of ``size``: step ``s`` sends to ``rank+s``, receives from ``rank-s``.

    Args:
        rank: this rank.
        size: ranks in the communicator.

    Returns:
        ``size - 1`` :class:`Exchange` entries, steps 1 .. size-1 (none at one rank).
    """
    return [Exchange(step, (rank + step) % size, (rank - step) % size) for step in range(1, size)]


def ring_gather_steps(rank: int, size: int) -> list:
    """The ring allgather's steps for ``rank`` of ``size``: step ``s`` forwards block ``rank-s`` to the right
    and receives block ``rank-s-1`` from the left.

    Args:
        rank: this rank.
        size: ranks in the communicator.

    Returns:
        ``size - 1`` :class:`GatherStep` entries, steps 0 .. size-2 (none at one rank).
    """
    return [GatherStep(step, (rank - step) % size, (rank - step - 1) % size) for step in range(size - 1)]


def ring_neighbours(rank: int, size: int) -> tuple:
    """The ring allgather's neighbours of ``rank`` of ``size``.

    Args:
        rank: this rank.
        size: ranks in the communicator.

    Returns:
        ``(right, left)``: the rank blocks are sent to and the rank they are received from.
    """
    return (rank + 1) % size, (rank - 1) % size


def fold_in_rank_order(ufunc: Callable, terms: Sequence, out) -> None:
    """``out = (((terms[0] op terms[1]) op terms[2]) ...)``: the contributions folded in rank order.

    ``out`` may be the memory of ``terms[0]`` or ``terms[1]`` (an element-wise ufunc reads each element
    before it writes it), not of any later term: that one would be read after being overwritten.

    Args:
        ufunc: ``ufunc(a, b, out=)``, the reduction of two contributions.
        terms: every rank's contribution, in rank order, all of ``out``'s length.
        out: where the result goes.
    """
    if len(terms) == 1:
        out[...] = terms[0]
        return
    with quiet_arithmetic():
        ufunc(terms[0], terms[1], out=out)
        for term in terms[2:]:
            ufunc(out, term, out=out)


class Schedule:
    """The allreduce's schedule for ``rank`` of ``size`` over blocks ``bounds``, in windows of ``width``
    elements (clipped to the longest block, at least 1).

    Args:
        rank: this rank.
        size: ranks in the communicator.
        bounds: ``(start, stop)`` of each rank's block, in rank order.
        width: most elements per chunk window.
    """

    def __init__(self, rank: int, size: int, bounds: Sequence[Bound], width: int) -> None:
        self.rank, self.size = rank, size
        self.bounds = [tuple(bound) for bound in bounds]
        longest = max((hi - lo for lo, hi in self.bounds), default=0)
        self.width = max(1, min(width, longest))
        #: chunk rounds every rank runs: those of the longest block (0 when every block is empty)
        self.rounds = -(-longest // self.width)
        #: the ring allgather's neighbours
        self.right, self.left = ring_neighbours(rank, size)

    @property
    def mine(self) -> Bound:
        """This rank's block."""
        return self.bounds[self.rank]

    def window(self, block: int, round_: int) -> slice:
        """Round ``round_``'s window of block ``block`` (a slice of the whole buffer; possibly empty)."""
        return window(self.bounds[block], round_ * self.width, self.width)

    def exchanges(self) -> list:
        """The reduce-scatter's steps (:func:`pairwise_exchanges`)."""
        return pairwise_exchanges(self.rank, self.size)

    def gather_steps(self) -> list:
        """The ring allgather's steps (:func:`ring_gather_steps`)."""
        return ring_gather_steps(self.rank, self.size)
