"""Per-rank shard files beside the versioned checkpoints: folders, retention, inspection, verified range reads.

State too large to funnel through rank 0 (a sharded embedding store, a sharded optimizer) is saved by
every rank into a folder of its own per version, ``<prefix>-epoch-NNNNNN/``, one file of the dense
checkpoint format (:mod:`hvps.checkpoint.format`) per rank, written atomically. A manifest records each
shard's manifest digest, and the dense checkpoint of that epoch (written last) commits the manifest; a
version counts only when all of it is there. This module holds what those savers share:

* :func:`shard_folder` and :func:`tidy_shard_folders` (a version's folder; dropping the folders of
  versions retention removed, or that never committed);
* :func:`inspect_shard` (a shard is untrusted input: a regular file, its HDF5 structure inspected in
  the sandboxed helper of :mod:`hvps.checkpoint.inspect`, and the very file the manifest lists);
* :func:`block_digests` and :func:`read_verified_range` (SHA-256 per fixed-size block, so that a rank
  that needs only part of a dataset reads and checks only the blocks covering it);
* :func:`agree`, :func:`describe_problem`, :func:`short` (every rank learns every rank's problems, so
  that a defect anywhere skips the version everywhere).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from .. import api
from ..core.atomic_files import remove_temporaries
from .format import CheckpointError, Header, open_regular, pread_all
from .inspect import inspect_header

#: bytes per block of :func:`block_digests`
BLOCK_BYTES = 1 << 20


def shard_folder(directory: os.PathLike, prefix: str, epoch: int) -> Path:
    """The folder of the shards of version ``epoch``.

    Args:
        directory: the checkpoint directory.
        prefix: what the shards are (``store``, ``optim``).
        epoch: the version.

    Returns:
        ``directory/<prefix>-epoch-NNNNNN``.
    """
    return Path(directory) / f"{prefix}-epoch-{int(epoch):06d}"


def tidy_shard_folders(manager: Any, epoch: int, folder_re: re.Pattern) -> None:
    """After committing ``epoch``: drop the shard folders (``folder_re``, group 1 the epoch) of versions
    up to it that retention removed or that never committed, and the temporaries of dead writers in the
    ones kept. Other names are left alone, and so are later epochs' folders (the next save may be
    writing one).

    Args:
        manager: the ``CheckpointManager`` (its ``list()`` and ``directory``).
        epoch: the version just committed.
        folder_re: matches the folder names of one kind of shard.
    """
    kept = {v.epoch for v in manager.list()}
    for path in Path(manager.directory).iterdir():
        match = folder_re.match(path.name)
        if match is None or int(match.group(1)) > epoch or path.is_symlink() or not path.is_dir():
            continue
        if int(match.group(1)) not in kept:
            shutil.rmtree(path, ignore_errors=True)
            continue
        remove_temporaries(path)


def short(value: Any, limit: int = 160) -> str:
    """``repr(value)`` cut to ``limit`` characters (values from a file go into messages escaped and bounded)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def describe_problem(exc: Exception) -> str:
    """One line for ``exc``; anything but a CheckpointError (a bug, out of memory) names its type."""
    text = str(exc).replace("\n", " ")
    return text if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {text}"


def agree(problems: list, name: str) -> list:
    """Every rank's problems (collective when hvps runs on several ranks), each once, in rank order.

    Args:
        problems: this rank's problems (strings).
        name: the collective's name.

    Returns:
        The union, in rank order.
    """
    everyone = api.allgather_object(problems, name=name) if api.is_initialized() and api.size() > 1 else [problems]
    out: list = []
    for rank_problems in everyone:
        out.extend(p for p in rank_problems if p not in out)
    return out


def inspect_shard(path: Path, expected_sha256: str) -> tuple:
    """The inspected header of shard ``path``, which must be the file its manifest lists.

    Args:
        path: the shard file (a symlink, a FIFO or a device is refused before libhdf5 sees it).
        expected_sha256: the shard's manifest digest, as the manifest records it.

    Returns:
        ``(header, identity)``: the header checked by the sandboxed helper, and ``(st_dev, st_ino)`` of the
        file inspected (pass it to :func:`open_same`).

    Raises:
        CheckpointError: the file is missing, unsafe, damaged, or not the one listed.
    """
    fd = open_regular(path, follow_links=False)
    try:
        before = os.fstat(fd)
    finally:
        os.close(fd)
    header = inspect_header(path)
    if header.manifest_sha256 != expected_sha256:
        raise CheckpointError("is not the shard the manifest lists (its manifest's SHA-256 differs)", path)
    return header, (before.st_dev, before.st_ino)


def open_same(path: Path, identity: tuple) -> int:
    """A read descriptor of ``path``, refused unless it is still the file :func:`inspect_shard` saw.

    Raises:
        CheckpointError: the file is gone, unsafe, or was replaced.
    """
    fd = open_regular(path, follow_links=False)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != identity:
        os.close(fd)
        raise CheckpointError("was replaced while it was being loaded", path)
    return fd


def block_digests(array: np.ndarray, block_bytes: int = BLOCK_BYTES) -> list:
    """SHA-256 (hex) of each ``block_bytes`` block of ``array``'s bytes (the last block may be shorter).

    Args:
        array: a C-contiguous array.
        block_bytes: the block size.

    Returns:
        One digest per block; none for an empty array.
    """
    view = memoryview(np.ascontiguousarray(array)).cast("B")
    return [hashlib.sha256(view[at:at + block_bytes]).hexdigest() for at in range(0, len(view), block_bytes)]


def read_verified_range(fd: int, header: Header, dataset: str, digests: list, first: int, last: int,
                        block_bytes: int = BLOCK_BYTES) -> np.ndarray:
    """Bytes ``[first, last)`` of contiguous ``dataset``, each block that covers them read and checked.

    Args, Raises: as :func:`read_verified_blocks`.

    Returns:
        A uint8 array of ``last - first`` bytes.
    """
    start, data = read_verified_blocks(fd, header, dataset, digests, first, last, block_bytes)
    return data[first - start:last - start]


def read_verified_blocks(fd: int, header: Header, dataset: str, digests: list, first: int, last: int,
                         block_bytes: int = BLOCK_BYTES, entry: Any = None) -> tuple:
    """The whole blocks of contiguous ``dataset`` that cover bytes ``[first, last)``, each block checked.

    Args:
        fd: a descriptor of the shard (:func:`open_same`).
        header: its inspected header (offsets and byte counts).
        dataset: the dataset's path in the file.
        digests: its :func:`block_digests`, from the file's digest-covered attributes.
        first: the first byte wanted.
        last: one past the last byte wanted.
        block_bytes: the block size the digests were taken with.
        entry: the dataset's entry in ``header.entries``, when the caller has it at hand (else it is looked up).

    Returns:
        ``(first byte of the span, uint8 array of the span)``; the span is empty when ``first == last``.

    Raises:
        CheckpointError: the dataset is not stored contiguously, the range is out of it, the file is
            truncated, or a block's digest differs.
    """
    entry = entry if entry is not None else next((e for e in header.entries if e.path == dataset), None)
    offset = (header.offsets or {}).get(dataset)
    if entry is None or (entry.nbytes and offset is None):
        raise CheckpointError(f"dataset {dataset} is missing or not stored contiguously", header.path)
    if not 0 <= first <= last <= entry.nbytes:
        raise CheckpointError(f"dataset {dataset}: bytes {first}..{last} are outside its {entry.nbytes}", header.path)
    if len(digests) != -(-entry.nbytes // block_bytes):
        raise CheckpointError(f"dataset {dataset}: {len(digests)} block digests for {entry.nbytes} bytes",
                              header.path)
    if first == last:
        return first, np.empty(0, np.uint8)
    lo_block, hi_block = first // block_bytes, -(-last // block_bytes)
    start, stop = lo_block * block_bytes, min(hi_block * block_bytes, entry.nbytes)
    data = np.empty(stop - start, np.uint8)
    pread_all(fd, data, offset + start, header.path, dataset)
    for k in range(lo_block, hi_block):
        block = data[(k - lo_block) * block_bytes:(k - lo_block + 1) * block_bytes]
        if hashlib.sha256(memoryview(block)).hexdigest() != digests[k]:
            raise CheckpointError(f"checksum mismatch of {dataset} block {k} (the data was damaged or edited)",
                                  header.path)
    return start, data


__all__ = ["BLOCK_BYTES", "shard_folder", "tidy_shard_folders", "short", "describe_problem", "agree",
           "inspect_shard", "open_same", "block_digests", "read_verified_range", "read_verified_blocks"]
