"""The arithmetic of re-sharding a flat buffer saved by N ranks for M ranks (pure, no I/O).

The layout is ``hvps.core.flat_shards``'s (re-exported here): rank r of ``size`` holds elements
``[r * s, (r + 1) * s)`` of the flat buffer, ``s = ceil(numel / size)``. A rank of another job that needs the elements ``[lo, hi)`` reads them from the saved ranks that
hold them: :func:`source_pieces` lists which ranks, and where.
"""

from __future__ import annotations

from ..core.flat_shards import param_pieces, shard_bounds, shard_numel

__all__ = ["shard_numel", "shard_bounds", "source_pieces", "param_pieces"]


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
