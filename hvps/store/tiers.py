"""Where a shard's rows live: host memory or a memory-mapped file on local disk.

A tier stores one *record* per row: the embedding followed by the row's optimizer state,
so the cache above it and checkpoints move a row and its state together (HugeCTR's
hierarchical parameter server keeps the same split between a fast embedding cache and
host-memory / SSD databases behind it).
"""

from __future__ import annotations

import mmap
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
import torch

Init = Callable[[int, int], torch.Tensor]  # (start, stop) -> records of those slots


class Tier(ABC):
    """``rows`` records of ``width`` float32 values, read and written by slot."""

    kind = ""

    def __init__(self, rows: int, width: int) -> None:
        self.rows = int(rows)
        self.width = int(width)

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * 4

    @abstractmethod
    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """The records at ``slots`` (a new tensor)."""

    @abstractmethod
    def write(self, slots: torch.Tensor, records: torch.Tensor) -> None:
        """Overwrite the records at ``slots``."""

    @abstractmethod
    def view(self, start: int, stop: int) -> torch.Tensor:
        """Records ``start:stop`` (may alias the storage); for checkpoints and initialisation."""

    def fill(self, init: Init, chunk_rows: int = 1 << 16) -> None:
        """Initialise every record from ``init``, a chunk at a time."""
        for k, start in enumerate(range(0, self.rows, chunk_rows)):
            stop = min(self.rows, start + chunk_rows)
            self.view(start, stop).copy_(init(start, stop))
            self._filled(k, stop == self.rows)

    def _filled(self, chunk: int, last: bool) -> None:
        """Called after each chunk :meth:`fill` wrote."""

    def trim(self) -> None:
        """Give resident pages back to the OS where the tier can (disk tier only)."""


class HostTier(Tier):
    """The shard as one torch tensor in host memory."""

    kind = "host"

    def __init__(self, rows: int, width: int, zeroed: bool = True) -> None:
        super().__init__(rows, width)
        self.data = torch.zeros(self.rows, self.width) if zeroed else torch.empty(self.rows, self.width)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        return self.data.index_select(0, slots)

    def write(self, slots: torch.Tensor, records: torch.Tensor) -> None:
        self.data.index_copy_(0, slots, records)

    def view(self, start: int, stop: int) -> torch.Tensor:
        return self.data[start:stop]


class DiskTier(Tier):
    """The shard in a memory-mapped file (for shards larger than the memory budget).

    Pages are brought in by the kernel on access; :meth:`trim` drops this process's resident
    pages (dirty ones stay in the page cache and reach the file).  The file is unlinked as soon
    as it is mapped, so no shard file outlives its process (checkpoints are separate files).
    """

    kind = "disk"

    def __init__(self, rows: int, width: int, path: Union[str, os.PathLike]) -> None:
        super().__init__(rows, width)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        shape = (max(1, self.rows), self.width)
        self.array = np.memmap(self.path, dtype=np.float32, mode="w+", shape=shape)
        self.path.unlink()  # the mapping keeps the file alive; its blocks go when the process does
        self._advise(mmap.MADV_RANDOM)  # rows are read one by one: no read-ahead

    def _advise(self, option: int) -> None:
        mapped = getattr(self.array, "_mmap", None)
        if mapped is not None and hasattr(mapped, "madvise"):
            mapped.madvise(option)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.array[slots.numpy()])

    def write(self, slots: torch.Tensor, records: torch.Tensor) -> None:
        self.array[slots.numpy()] = records.numpy()

    def view(self, start: int, stop: int) -> torch.Tensor:
        return torch.from_numpy(self.array[start:stop])

    def _filled(self, chunk: int, last: bool) -> None:
        if last or chunk % 8 == 7:  # initialising must not make the whole shard resident
            self.trim()

    def trim(self) -> None:
        self.array.flush()
        self._advise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Unmap the (already unlinked) file, freeing its blocks."""
        del self.array


def make_tier(kind: str, rows: int, width: int, path: Optional[Union[str, os.PathLike]] = None,
              zeroed: bool = True) -> Tier:
    """A "host" or "disk" tier; "disk" needs ``path``.  ``zeroed=False``: a host tier's records
    start undefined (for a caller that writes every one)."""
    if kind == "host":
        return HostTier(rows, width, zeroed)
    if kind == "disk":
        if path is None:
            raise ValueError("the disk tier needs a file path (disk_dir=...)")
        return DiskTier(rows, width, path)
    raise ValueError(f"unknown tier {kind!r}; choose 'host' or 'disk'")


def discard_tier(tier: Tier) -> None:
    """Free a tier that is no longer used (a disk tier's mapping; a host tier goes with its last reference)."""
    close = getattr(tier, "close", None)
    if close is not None:
        close()
