"""A write-back cache of hot rows in front of a tier (HugeCTR's embedding cache, in miniature).

The cache holds whole records (embedding + optimizer state) in the compute device's memory
(a separate small tensor on CPU, standing in for the fast tier).  A lookup admits its
missing rows, evicting the least recently used ones (or the least frequently used, with
ties broken by age) that the same lookup has not touched; dirty victims are written back to
the tier.  When one batch needs more rows than the cache holds, the excess is read from and
written to the tier directly ("bypass"), so correctness never depends on the cache size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch

from .tiers import Tier

POLICIES = ("lru", "lfu")


@dataclass
class CacheStats:
    """Counters since construction (or :meth:`reset`); bytes are record bytes moved between tiers."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_to_cache: int = 0
    bytes_to_tier: int = 0
    bytes_bypass: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def as_dict(self) -> dict:
        return dict(asdict(self), hit_rate=self.hit_rate)

    def reset(self) -> None:
        for key in asdict(self):
            setattr(self, key, 0)


class RowCache:
    """``capacity`` records of ``tier`` kept on ``device``; write-back, LRU or LFU eviction."""

    def __init__(self, tier: Tier, capacity: int, policy: str = "lru",
                 device: Optional[torch.device] = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; choose one of {POLICIES}")
        if capacity < 1:
            raise ValueError(f"cache capacity must be >= 1 row, got {capacity}")
        self.tier = tier
        self.policy = policy
        self.capacity = int(min(capacity, max(1, tier.rows)))
        self.device = torch.device(device or "cpu")
        self.data = torch.zeros(self.capacity, tier.width, device=self.device)
        self.slot_of = torch.full((tier.rows,), -1, dtype=torch.int32)  # tier slot -> cache line
        self.row_of = torch.full((self.capacity,), -1, dtype=torch.int64)  # cache line -> tier slot
        self.last = torch.zeros(self.capacity, dtype=torch.int64)
        self.freq = torch.zeros(self.capacity, dtype=torch.int64)
        self.dirty = torch.zeros(self.capacity, dtype=torch.bool)
        self.tick = 0
        self.stats = CacheStats()
        self._record_bytes = tier.width * 4

    @property
    def nbytes(self) -> int:
        """Bytes of the cached records (the fast tier)."""
        return self.data.numel() * 4

    def fetch(self, slots: torch.Tensor) -> torch.Tensor:
        """The records of ``slots`` (distinct tier slots), admitting misses into the cache."""
        self.tick += 1
        lines = self.slot_of[slots].to(torch.int64)
        hit = lines >= 0
        hit_lines = lines[hit]
        self.last[hit_lines] = self.tick
        self.freq[hit_lines] += 1
        self.stats.hits += int(hit_lines.numel())
        missing = slots[~hit]
        self.stats.misses += int(missing.numel())
        if missing.numel():
            self._admit(missing)
            lines = self.slot_of[slots].to(torch.int64)
        out = torch.empty(slots.numel(), self.tier.width, device=self.device)
        cached = lines >= 0
        out[cached] = self.data[lines[cached]]
        if not bool(cached.all()):
            rest = slots[~cached]
            out[~cached] = self.tier.read(rest).to(self.device)
            self.stats.bytes_bypass += int(rest.numel()) * self._record_bytes
        return out

    def store(self, slots: torch.Tensor, records: torch.Tensor) -> None:
        """Write updated records: into their cache lines (marked dirty) or, if not cached, the tier."""
        lines = self.slot_of[slots].to(torch.int64)
        cached = lines >= 0
        self.data[lines[cached]] = records[cached].to(self.device)
        self.dirty[lines[cached]] = True
        if not bool(cached.all()):
            rest = slots[~cached]
            self.tier.write(rest, records[~cached].cpu())
            self.stats.bytes_bypass += int(rest.numel()) * self._record_bytes

    def flush(self) -> None:
        """Write every dirty line back to the tier (the cache keeps its contents)."""
        lines = self.dirty.nonzero().flatten()
        self._write_back(lines)

    def _write_back(self, lines: torch.Tensor) -> None:
        lines = lines[self.dirty[lines]]
        if lines.numel():
            self.tier.write(self.row_of[lines], self.data[lines].cpu())
            self.dirty[lines] = False
            self.stats.bytes_to_tier += int(lines.numel()) * self._record_bytes

    def _evict(self, count: int) -> None:
        used = self.row_of >= 0
        evictable = used & (self.last < self.tick)
        count = min(count, int(evictable.sum()))
        if count <= 0:
            return
        key = self.last if self.policy == "lru" else self.freq * (1 << 40) + self.last
        key = torch.where(evictable, key, torch.iinfo(torch.int64).max)
        victims = torch.topk(key, count, largest=False).indices
        self._write_back(victims)
        self.slot_of[self.row_of[victims]] = -1
        self.row_of[victims] = -1
        self.stats.evictions += count

    def _admit(self, missing: torch.Tensor) -> None:
        free = (self.row_of < 0).nonzero().flatten()
        if free.numel() < missing.numel():
            self._evict(int(missing.numel() - free.numel()))
            free = (self.row_of < 0).nonzero().flatten()
        lines = free[: missing.numel()]
        rows = missing[: lines.numel()]
        if not rows.numel():
            return
        self.data[lines] = self.tier.read(rows).to(self.device)
        self.slot_of[rows] = lines.to(torch.int32)
        self.row_of[lines] = rows
        self.last[lines] = self.tick
        self.freq[lines] = 1
        self.dirty[lines] = False
        self.stats.bytes_to_cache += int(rows.numel()) * self._record_bytes
