"""Which rank owns which row: a partition maps a table's row ids onto the members of a set.

Every partition is a bijection between ``[0, num_rows)`` and pairs ``(owner, slot)``, where
``slot`` indexes the owner's shard, so a shard is a dense array of ``shard_rows(owner)`` rows
and re-sharding on load only needs :meth:`Partition.global_ids` (no lookup tables, so the
memory per rank stays at table / ranks).

``hash`` (the default: a row's owner is ``hash(id) % owners``) spreads neighbouring ids, which
are often the hot ones, over all owners: ids are first permuted by multiplicative hashing
``(a * id) mod num_rows`` with ``a`` coprime to ``num_rows`` (a bijection), then dealt
round-robin.  ``range`` gives each owner one contiguous block, as TorchRec's row-wise
sharding does.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

GOLDEN = 0.6180339887498949


class Partition(ABC):
    """Maps row ids of a ``num_rows`` table onto ``parts`` owners."""

    kind = ""

    def __init__(self, num_rows: int, parts: int) -> None:
        if num_rows < 1 or parts < 1:
            raise ValueError(f"a partition needs num_rows >= 1 and parts >= 1, got {num_rows}, {parts}")
        self.num_rows = int(num_rows)
        self.parts = int(parts)

    @abstractmethod
    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        """The owning member (index in the set) of each id."""

    @abstractmethod
    def slot(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's row index within its owner's shard."""

    @abstractmethod
    def global_ids(self, owner: int, slots: torch.Tensor) -> torch.Tensor:
        """The ids stored at ``slots`` of ``owner``'s shard (inverse of owner/slot)."""

    @abstractmethod
    def shard_rows(self, owner: int) -> int:
        """How many rows ``owner`` holds."""

    def describe(self) -> dict:
        """A JSON-able description (compared across ranks and stored in checkpoints)."""
        return {"kind": self.kind, "num_rows": self.num_rows, "parts": self.parts}


class HashPartition(Partition):
    """Multiplicative hashing, then round-robin: owner = h(id) % parts, slot = h(id) // parts."""

    kind = "hash"

    def __init__(self, num_rows: int, parts: int) -> None:
        super().__init__(num_rows, parts)
        a = max(1, int(num_rows * GOLDEN)) | 1
        while math.gcd(a, num_rows) != 1:
            a += 1
        self.multiplier = a % num_rows if num_rows > 1 else 0
        self._inverse = pow(self.multiplier, -1, num_rows) if num_rows > 1 else 0

    def _hash(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids.to(torch.int64) * self.multiplier) % self.num_rows

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        return self._hash(ids) % self.parts

    def slot(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.div(self._hash(ids), self.parts, rounding_mode="floor")

    def global_ids(self, owner: int, slots: torch.Tensor) -> torch.Tensor:
        hashed = slots.to(torch.int64) * self.parts + owner
        return (hashed * self._inverse) % self.num_rows

    def shard_rows(self, owner: int) -> int:
        return max(0, -(-(self.num_rows - owner) // self.parts))


class RangePartition(Partition):
    """Contiguous blocks of ``ceil(num_rows / parts)`` rows per owner."""

    kind = "range"

    def __init__(self, num_rows: int, parts: int) -> None:
        super().__init__(num_rows, parts)
        self.block = -(-num_rows // parts)

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.div(ids.to(torch.int64), self.block, rounding_mode="floor")

    def slot(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.to(torch.int64) % self.block

    def global_ids(self, owner: int, slots: torch.Tensor) -> torch.Tensor:
        return slots.to(torch.int64) + owner * self.block

    def shard_rows(self, owner: int) -> int:
        return max(0, min(self.block, self.num_rows - owner * self.block))


PARTITIONS = {"hash": HashPartition, "range": RangePartition}


def make_partition(kind: str, num_rows: int, parts: int) -> Partition:
    """The partition named ``kind`` ("hash" or "range").

    Args:
        kind: ``"hash"`` (:class:`HashPartition`) or ``"range"`` (:class:`RangePartition`).
        num_rows: the table's rows.
        parts: the members the rows are split over.

    Returns:
        The partition.

    Raises:
        ValueError: an unknown ``kind``.
    """
    try:
        return PARTITIONS[kind](num_rows, parts)
    except KeyError:
        raise ValueError(f"unknown partition {kind!r}; choose one of {sorted(PARTITIONS)}") from None
