"""A write-back cache of hot rows in front of a tier (HugeCTR's embedding cache, in miniature).

The cache holds whole records (embedding + optimizer state) in the compute device's memory
(a separate small tensor on CPU, standing in for the fast tier).  A lookup admits its
missing rows, evicting the least recently used ones (or the least frequently used, with
ties broken by age) that the same lookup has not touched; dirty victims are written back to
the tier.  When one batch needs more rows than the cache holds, the excess is read from and
written to the tier directly ("bypass"), so correctness never depends on the cache size.

Eviction frees lines in batches of at least 1/64 of the cache: finding victims scans every
line (a top-k over the recency or frequency keys), so it runs once per batch of admissions
instead of on every lookup, at the price of a few rows leaving a little early.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch

from .tiers import Tier

POLICIES = ("lru", "lfu")
#: eviction frees at least this fraction of the lines at a time (see the module docstring)
_EVICTION_BATCH = 1 / 64
#: the recency stamp of a freed line: later than any lookup, so never an eviction candidate
_FREE = torch.iinfo(torch.int64).max


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
        self.filled = 0  # lines below this have held a row (lines are reused only by eviction)
        self.free = torch.empty(0, dtype=torch.int64)  # evicted lines not yet reused
        self.stats = CacheStats()
        self._record_bytes = tier.width * 4

    @property
    def nbytes(self) -> int:
        """Bytes of the cached records (the fast tier)."""
        return self.data.numel() * 4

    def fetch(self, slots: torch.Tensor, count: bool = True) -> torch.Tensor:
        """The records of ``slots`` (distinct tier slots), admitting misses into the cache.

        ``count=False``: not a lookup (the owner re-reading rows to update them); the
        hit and miss counters stay as they are.
        """
        self.tick += 1
        lines = self.slot_of[slots].to(torch.int64)
        missing = (lines < 0).nonzero().view(-1)  # positions (index tensors: cheaper than boolean masks)
        if count:
            self.stats.hits += slots.numel() - missing.numel()
            self.stats.misses += missing.numel()
        present = lines[lines >= 0] if missing.numel() else lines
        self.last[present] = self.tick
        self.freq[present] += 1
        if missing.numel():
            self._admit(slots[missing])
            lines[missing] = self.slot_of[slots[missing]].to(torch.int64)
            bypass = missing[lines[missing] < 0]  # more rows than the cache can take at once
            if bypass.numel():
                out = self.data.index_select(0, lines.clamp(min=0))
                out[bypass] = self.tier.read(slots[bypass]).to(self.device)
                self.stats.bytes_bypass += int(bypass.numel()) * self._record_bytes
                return out
        return self.data.index_select(0, lines)

    def store(self, slots: torch.Tensor, records: torch.Tensor) -> None:
        """Write updated records: into their cache lines (marked dirty) or, if not cached, the tier."""
        lines = self.slot_of[slots].to(torch.int64)
        rest = (lines < 0).nonzero().view(-1)
        if rest.numel():
            cached = (lines >= 0).nonzero().view(-1)
            self.tier.write(slots[rest], records[rest].cpu())
            self.stats.bytes_bypass += int(rest.numel()) * self._record_bytes
            lines, records = lines[cached], records[cached]
        self.data.index_copy_(0, lines, records.to(self.device))
        self.dirty[lines] = True

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

    def _evict(self, count: int) -> torch.Tensor:
        """Free ``count`` lines or more (a batch) not touched by the current lookup; returns them."""
        untouched = self.last < self.tick
        count = min(max(count, int(self.capacity * _EVICTION_BATCH)), int(untouched.sum()))
        if count <= 0:
            return self.row_of.new_empty(0)
        if self.policy == "lru":  # touched lines hold the largest stamp: never among the smallest
            key = self.last
        else:
            key = torch.where(untouched, self.freq * (1 << 40) + self.last, _FREE)
        victims = torch.topk(key, count, largest=False, sorted=False).indices
        self._write_back(victims)
        self.slot_of[self.row_of[victims]] = -1
        self.row_of[victims] = -1
        self.last[victims] = _FREE  # never a candidate again until reused
        self.stats.evictions += count
        return victims

    def _admit(self, missing: torch.Tensor) -> None:
        """Load ``missing`` rows into never-used lines, then freed ones, then evicted ones, as far as they go."""
        fresh = min(missing.numel(), self.capacity - self.filled)
        lines = torch.arange(self.filled, self.filled + fresh)
        self.filled += fresh
        self.last[lines] = self.tick  # taken by this lookup: not eviction candidates
        wanted = missing.numel() - fresh  # lines to take from the freed ones
        if self.free.numel() < wanted:
            self.free = torch.cat([self.free, self._evict(wanted - self.free.numel())])
        lines = torch.cat([lines, self.free[:wanted]])
        self.free = self.free[wanted:]
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
