"""The one layout of every sharded state in hvps (ZeRO stages 1-3, their checkpoints): tensors laid one after
another in a flat buffer, padded to a multiple of the rank count and split into equal contiguous blocks, rank r
holding elements ``[r * s, (r + 1) * s)`` with ``s = ceil(numel / size)``. Pure arithmetic on element counts: the
torch and Keras sharded optimizers, ``fully_shard`` and the re-sharding checkpoint loader all read it from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

__all__ = ["FlatLayout", "shard_numel", "shard_bounds", "param_pieces"]


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


def param_pieces(params: list, lo: int, hi: int) -> list:
    """The parts of the tensors laid out one after another in a flat buffer that fall in ``[lo, hi)``.

    Args:
        params: ``[(tensor id, start in the buffer, numel)]``.
        lo: the block's first element.
        hi: one past its last element.

    Returns:
        ``[(tensor id, offset in the tensor, offset in the block, length)]`` in buffer order, empty parts left out.
    """
    pieces = []
    for ident, begin, n in params:
        first, last = max(begin, lo), min(begin + n, hi)
        if first < last:
            pieces.append((ident, first - begin, first - lo, last - first))
    return pieces


@dataclass(frozen=True)
class FlatLayout:
    """Tensors of ``sizes`` elements, in that order, in one flat buffer split evenly over ``size`` ranks."""

    sizes: tuple
    size: int

    @cached_property
    def slices(self) -> list:
        """``(start, numel)`` of each tensor in the flat buffer."""
        starts, at = [], 0
        for n in self.sizes:
            starts.append((at, n))
            at += n
        return starts

    @property
    def numel(self) -> int:
        """The buffer's elements, without padding."""
        return sum(self.sizes)

    @property
    def shard_numel(self) -> int:
        """Elements of each rank's block (padding included)."""
        return shard_numel(self.numel, self.size)

    @property
    def padded(self) -> int:
        """The buffer's elements with padding: ``size`` blocks."""
        return self.shard_numel * self.size

    def block(self, rank: int) -> tuple:
        """``[lo, hi)`` of ``rank``'s block (see :func:`shard_bounds`)."""
        return shard_bounds(self.numel, self.size, rank)

    def pieces(self, rank: int) -> list:
        """``[(tensor index, offset in the tensor, offset in the block, length)]`` of ``rank``'s block, in order
        (tensors with no element there left out)."""
        lo, hi = self.block(rank)
        return param_pieces([(i, start, n) for i, (start, n) in enumerate(self.slices)], lo, hi)
