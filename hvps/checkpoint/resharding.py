"""The arithmetic of re-sharding a flat buffer saved by N ranks for M ranks (pure, no I/O).

A flat buffer of ``numel`` elements is split over ``size`` ranks in equal contiguous blocks of
``shard_numel(numel, size) = ceil(numel / size)`` elements (the last ones padded): rank r holds
elements ``[r * s, (r + 1) * s)``. This is the layout of :class:`hvps.adapters.torch.ShardedOptimizer`'s
buckets. A rank of another job that needs the elements ``[lo, hi)`` reads them from the saved ranks that
hold them: :func:`source_pieces` lists which ranks, and where.
"""

from __future__ import annotations

__all__ = ["shard_numel", "shard_bounds", "source_pieces", "param_pieces"]


def shard_numel(numel: int, size: int) -> int:
    """Elements per rank when ``numel`` elements are split evenly over ``size`` ranks (padding included).

    Args:
        numel: the buffer's elements (without padding).
        size: the number of ranks.

    Returns:
        ``ceil(numel / size)``.

    Raises:
        ValueError: a negative ``numel`` or a ``size`` below 1.
    """
    if numel < 0 or size < 1:
        raise ValueError(f"cannot split {numel} elements over {size} ranks")
    return -(-numel // size)


def shard_bounds(numel: int, size: int, rank: int) -> tuple:
    """The elements ``[lo, hi)`` of the flat buffer that ``rank`` holds (may reach into the padding).

    Args:
        numel: the buffer's elements.
        size: the number of ranks.
        rank: the rank, in ``0..size-1``.

    Returns:
        ``(rank * s, (rank + 1) * s)`` with ``s = shard_numel(numel, size)``.

    Raises:
        ValueError: ``rank`` out of range.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in 0..{size - 1}")
    s = shard_numel(numel, size)
    return rank * s, (rank + 1) * s


def source_pieces(lo: int, hi: int, numel: int, saved_size: int) -> list:
    """Where the elements ``[lo, hi)`` of a buffer saved by ``saved_size`` ranks lie.

    Padding (elements at or past ``numel``) is in no piece: the caller fills it with zeros.

    Args:
        lo: the first element wanted.
        hi: one past the last element wanted.
        numel: the buffer's elements (without padding).
        saved_size: how many ranks saved it.

    Returns:
        ``[(saved rank, offset in its shard, offset in [lo, hi), length)]`` in order, covering
        ``[lo, min(hi, numel))`` exactly once.

    Raises:
        ValueError: a negative or reversed range.
    """
    if lo < 0 or hi < lo:
        raise ValueError(f"bad element range [{lo}, {hi})")
    s = shard_numel(numel, saved_size)
    end = min(hi, numel)
    pieces, at = [], lo
    while at < end:
        rank = at // s
        stop = min(end, (rank + 1) * s)
        pieces.append((rank, at - rank * s, at - lo, stop - at))
        at = stop
    return pieces


def param_pieces(params: list, lo: int, hi: int) -> list:
    """The parts of the parameters laid out one after another in a flat buffer that fall in ``[lo, hi)``.

    Args:
        params: ``[(parameter id, start in the buffer, numel)]``.
        lo: the block's first element.
        hi: one past its last element.

    Returns:
        ``[(parameter id, offset in the parameter, offset in the block, length)]`` in buffer order.
    """
    pieces = []
    for ident, begin, n in params:
        first, last = max(begin, lo), min(begin + n, hi)
        if first < last:
            pieces.append((ident, first - begin, first - lo, last - first))
    return pieces
