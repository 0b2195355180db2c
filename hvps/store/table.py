"""One rank's part of a sharded table: its shard (a tier, optionally cached) and the optimizer.

The owner side of the store: it serves lookups of its rows and applies combined gradients
to them.  Which rows it holds is the partition's business; how requests reach it is the
exchange's.

A row cache is built only where it can pay: in front of the disk tier, or on a GPU.  In
front of the host tier on the CPU it would hold copies of rows in the very memory they live
in, and each lookup would copy them once more (at 2 ranks, 4M x 64 rows, a 5% LRU cache cost
~1.6 ms of CPU a step and saved nothing; benchmarks/RESULTS.md, issue 42 item 5), so there the
table reads and writes its shard directly and ``stats()["cache"]`` says ``"bypassed: host tier"``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from .cache import RowCache
from .init import default_bound, hash_uniform
from .optim import RowOptimizer
from .partition import Partition, make_partition
from .tiers import Tier, discard_tier, make_tier

Initializer = Callable[[torch.Tensor, int], torch.Tensor]  # (global ids, dim) -> [n, dim]
log = logging.getLogger("hvps")
#: what ``stats()["cache"]`` says of a table built with a cache that the table does not build
CACHE_BYPASSED = "bypassed: host tier"


@dataclass
class StoreOptions:
    """Where a table's shard lives, how it is cached and synchronised (the same on every member: checked)."""

    partition: str = "hash"
    tier: str = "host"  # "host" or "disk"
    disk_dir: Optional[Union[str, os.PathLike]] = None
    cache_rows: int = 0  # 0: no cache (lookups go to the tier)
    cache_bytes: int = 0  # alternative to cache_rows
    cache_policy: str = "lru"
    staleness: int = 0
    combine: str = "local"  # "local": each member pre-combines its rows; "ordered": global batch order
    seed: int = 0
    device: Optional[str] = None  # the cache's device; default cuda when available

    def describe(self) -> dict:
        out = {k: v for k, v in vars(self).items() if k not in ("disk_dir", "device")}
        return out


class ShardedTable:
    """The local shard of table ``name``: rows ``partition.slot`` of the ids this member owns."""

    def __init__(self, name: str, num_embeddings: int, embedding_dim: int, optimizer: RowOptimizer,
                 options: StoreOptions, member: int, members: int,
                 initializer: Optional[Initializer] = None) -> None:
        self.name = name
        self.num_embeddings = int(num_embeddings)
        self.dim = int(embedding_dim)
        self.optimizer = optimizer
        self.options = options
        self.member = member
        self.partition: Partition = make_partition(options.partition, self.num_embeddings, members)
        self.width = self.dim * (1 + optimizer.state_width)
        rows = self.partition.shard_rows(member)
        path = None
        if options.tier == "disk":
            base = Path(options.disk_dir or ".")
            path = base / f"{name}.shard{member}-of-{members}.{os.getpid()}.f32"
        self.tier: Tier = make_tier(options.tier, rows, self.width, path)
        self.tier.fill(self._initial_records(initializer))
        capacity = options.cache_rows or options.cache_bytes // (self.width * 4)
        self.cache: Optional[RowCache] = None
        self.cache_state = "none"  # stats()["cache"]: "none", CACHE_BYPASSED, or the cache's policy
        if capacity > 0:
            device = torch.device(options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
            if self.tier.kind == "host" and device.type == "cpu":
                # the cache would sit in the same memory as the shard: it could only copy rows
                self.cache_state = CACHE_BYPASSED
                log.info("hvps: table %r: no row cache: the shard is in host memory, the memory the cache "
                         "would use (a cache pays in front of tier='disk' or on a GPU device)", name)
            else:
                self.cache = RowCache(self.tier, capacity, options.cache_policy, device)
                self.cache_state = options.cache_policy

    def _initial_records(self, initializer: Optional[Initializer]) -> Callable[[int, int], torch.Tensor]:
        bound = default_bound(self.num_embeddings)

        def init(start: int, stop: int) -> torch.Tensor:
            ids = self.partition.global_ids(self.member, torch.arange(start, stop))
            if initializer is None:
                weight = hash_uniform(ids, self.dim, self.options.seed, -bound, bound)
            else:
                weight = initializer(ids, self.dim).to(torch.float32)
            state = torch.zeros(stop - start, self.width - self.dim)
            return torch.cat([weight, state], dim=1)

        return init

    # -------------------------------------------------------------- owner-side operations
    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Records of distinct ``slots`` (through the cache when there is one)."""
        return self.cache.fetch(slots) if self.cache is not None else self.tier.read(slots)

    def write(self, slots: torch.Tensor, records: torch.Tensor) -> None:
        if self.cache is not None:
            self.cache.store(slots, records)
        else:
            self.tier.write(slots, records.cpu())

    def lookup(self, slots: torch.Tensor) -> torch.Tensor:
        """Embeddings of ``slots`` (any order, repeats allowed)."""
        return self.records_of(slots)[:, : self.dim]

    def records_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Whole records (embedding and optimizer state) of ``slots`` (any order, repeats allowed)."""
        if self.cache is None:  # a tier reads repeated slots as they come
            return self.tier.read(slots)
        distinct, inverse = torch.unique(slots, return_inverse=True)  # the cache admits distinct rows
        return self.read(distinct)[inverse]

    def apply(self, slots: torch.Tensor, grads: torch.Tensor) -> None:
        """One optimizer step on distinct ``slots`` with their combined gradients."""
        self.optimizer.begin_step()
        if not slots.numel():
            return
        records = self.tier.read(slots) if self.cache is None else self.cache.fetch(slots, count=False)
        self.write(slots, self.optimizer.step(records, grads.to(records.device), self.dim))

    # -------------------------------------------------------------- whole-shard access
    def flush(self) -> None:
        """Write cached dirty rows back so the tier holds the current values."""
        if self.cache is not None:
            self.cache.flush()

    def records(self, start: int, stop: int) -> torch.Tensor:
        """Current records ``start:stop`` of the shard (after :meth:`flush`)."""
        return self.tier.view(start, stop)

    def drop_cache(self) -> None:
        """Forget cached rows without writing them back (before the tier is overwritten)."""
        if self.cache is not None:
            stats = self.cache.stats
            self.cache = RowCache(self.tier, self.cache.capacity, self.cache.policy, self.cache.device)
            self.cache.stats = stats

    def overwrite(self, slots: torch.Tensor, records: torch.Tensor) -> None:
        """Replace records in the tier (call :meth:`drop_cache` first)."""
        self.tier.write(slots, records)

    def spare_tier(self) -> Tier:
        """A new tier of this shard's kind and size, for a checkpoint load to fill before
        :meth:`install` makes it the shard (so a load that fails leaves the shard as it was)."""
        path = None
        if self.options.tier == "disk":
            base = Path(self.options.disk_dir or ".")
            path = base / f"{self.name}.shard{self.member}-of-{self.partition.parts}.{os.getpid()}.load.f32"
        return make_tier(self.options.tier, self.tier.rows, self.width, path, zeroed=False)

    def install(self, tier: Tier) -> None:
        """Make ``tier`` (from :meth:`spare_tier`) the shard: cached rows are forgotten, the old tier freed."""
        old, self.tier = self.tier, tier
        self.drop_cache()
        discard_tier(old)

    def memory(self) -> dict:
        """Bytes held: the tier (host or disk) and the cache."""
        return {"tier": self.tier.kind, "tier_bytes": self.tier.nbytes,
                "cache_bytes": self.cache.nbytes if self.cache is not None else 0}

    def describe(self) -> dict:
        return {"name": self.name, "num_embeddings": self.num_embeddings, "embedding_dim": self.dim,
                "optimizer": self.optimizer.name, "hyper": repr(sorted(self.optimizer.hyperparameters().items())),
                "partition": self.partition.describe(), "options": self.options.describe()}
