"""Where a sharded state's blocks come back from after the world changes (pure arithmetic, no I/O).

In elastic mode each rank of a sharded state keeps its own block of the flat layout
(:mod:`hvps.core.flat_shards`) and a copy of another rank's: rank r of N holds blocks r and (r - s) mod N,
where the *stride* s is 1 on one host and the ranks per host on several (:func:`copy_stride`), so that the copy
of a block lives on the next host: Horovod's driver (and hvpsrun's) blacklists the whole host of a failed
worker, so the ranks of one host leave together. When the world becomes M ranks (some died, some joined), the
survivors together still hold every old block unless a block's owner and its copy's keeper are both gone. :func:`block_providers` says which new rank gives
each old block, and from which of its two copies; :func:`transfers` lists the element ranges each of them
sends to each new rank, so that new rank j ends up with its block of the M-rank layout. The element
ranges are the re-sharding loader's (:func:`hvps.checkpoint.resharding.source_pieces`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..checkpoint.resharding import shard_bounds, source_pieces
from ..core.errors import HvpsError

__all__ = ["copy_stride", "copied_block", "block_providers", "Transfer", "transfers"]


def copy_stride(size: int, local_size: int, cross_size: int) -> int:
    """How far from its owner a block's copy is kept: the ranks per host when the job spans several hosts with
    the same number of ranks each (ranks are laid out host by host, so rank r + local_size is the same local
    rank on the next host), else 1 (one host, or hosts of different sizes: the next rank).

    Args:
        size: the ranks of the world.
        local_size: the ranks on this rank's host.
        cross_size: the hosts.

    Returns:
        The stride, ``1 <= stride < size`` (1 for a world of one rank).
    """
    if cross_size > 1 and local_size * cross_size == size:
        return local_size
    return 1


def copied_block(old_rank: int, old_size: int, stride: int = 1) -> int:
    """The block whose copy ``old_rank`` keeps: ``(old_rank - stride) mod old_size``.

    Args:
        old_rank: the rank that keeps the copy.
        old_size: the ranks of the world the blocks were laid out for.
        stride: the save's :func:`copy_stride`.

    Returns:
        The rank in that world whose block it is.
    """
    return (old_rank - stride) % old_size


def block_providers(holders: Sequence[Optional[tuple]], old_size: int, stride: int = 1) -> dict:
    """Which new rank gives each block of the old layout, preferring a rank's own block to a copy.

    Args:
        holders: for each new rank, ``(old rank, whether its neighbour copy is valid)`` when it holds the
            saved state, or None (a worker that joined, or one whose save is not the one restored).
        old_size: the ranks of the old layout.
        stride: the save's :func:`copy_stride`.

    Returns:
        ``{old block: (new rank, from its neighbour copy)}`` for every block ``0..old_size-1``.

    Raises:
        HvpsError: two new ranks claim one old rank, or a block's owner and the keeper of its copy (its
            rank ``stride`` further on) are both gone: that shard is lost, and only a checkpoint can bring it back.
    """
    owners: dict = {}
    for new_rank, held in enumerate(holders):
        if held is None:
            continue
        old_rank = held[0]
        if not 0 <= old_rank < old_size or old_rank in owners:
            raise HvpsError(f"new rank {new_rank} claims old rank {old_rank} of {old_size}, which is out of range "
                            "or claimed twice: the survivors do not agree on the sharded state they saved")
        owners[old_rank] = new_rank
    copies = {copied_block(held[0], old_size, stride): new_rank for new_rank, held in enumerate(holders)
              if held is not None and held[1]}
    providers = {}
    for block in range(old_size):
        if block in owners:
            providers[block] = (owners[block], False)
        elif block in copies:
            providers[block] = (copies[block], True)
        else:
            keeper = (block + stride) % old_size
            raise HvpsError(f"the shard of old rank {block} (of {old_size}) is lost: rank {block} and rank {keeper}, "
                            "which kept its copy, are both gone (both died between two commits). "
                            "The sharded state cannot be rebuilt in memory; restart from your checkpoint "
                            "(hvd.CheckpointManager), which re-shards to any rank count")
    return providers


@dataclass(frozen=True)
class Transfer:
    """``length`` elements of old block ``old_block`` (from ``offset`` on), sent by new rank ``source`` (from
    its neighbour copy when ``from_copy``) to new rank ``dest``, where they go at ``at`` in its new block."""

    source: int
    from_copy: bool
    old_block: int
    offset: int
    dest: int
    at: int
    length: int


def transfers(numel: int, old_size: int, new_size: int, providers: dict) -> list:
    """What moves where so that every new rank holds its block of the ``new_size`` layout.

    Args:
        numel: the flat buffer's elements (without padding; padding is never sent: it stays zero).
        old_size: the ranks of the old layout.
        new_size: the ranks of the new one.
        providers: :func:`block_providers`'s answer.

    Returns:
        The :class:`Transfer` list, by destination and then by position in its block: together they cover
        ``[0, numel)`` exactly once.
    """
    moves = []
    for dest in range(new_size):
        lo, hi = shard_bounds(numel, new_size, dest)
        for block, offset, at, length in source_pieces(lo, hi, numel, old_size):
            source, from_copy = providers[block]
            moves.append(Transfer(source, from_copy, block, offset, dest, at, length))
    return moves
