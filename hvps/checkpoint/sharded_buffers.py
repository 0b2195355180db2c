"""Flat buffers saved by N ranks as one shard file each, and read back range by range at any rank count.

What the sharded checkpoints (a ``ShardedOptimizer``'s state, a ``fully_shard`` model's parameters and state)
share, below their manifests: each rank writes its block of every flat buffer (the layout of
:mod:`hvps.core.flat_shards`) as a 1-D dataset of a file of the dense checkpoint format, atomically, with the
SHA-256 of every block of :data:`~hvps.checkpoint.shards.BLOCK_BYTES` in its ``/extra/blocks`` (so a reader of
part of a dataset checks what it reads); the ranks then learn each other's problems and manifest digests
(:func:`save_rank_shards`), which the caller's manifest records. A loader opens the saved shards it needs through
:class:`SavedShards`: each is untrusted input, inspected in the sandboxed helper, the very file the manifest lists,
and checked against what the manifest says it holds before a byte of it is read; :meth:`SavedShards.read_flat`
then gathers any element range of a saved buffer from the saved ranks that hold it (numpy only: the framework
adapters convert).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from .. import api
from ..core.atomic_files import atomic_publish
from .format import CheckpointError, logical_dtype, write_file
from .resharding import shard_numel, source_pieces
from .safety import SHA256_HEX, Defect, is_int, need
from .shards import block_digests, describe_problem, inspect_shard, open_same, read_verified_blocks, short

#: the largest world size a manifest may name
MAX_RANKS = 1 << 20
#: names of per-parameter state (``exp_avg``, ``step``, ...): they name datasets and attributes
STATE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,99}$")
#: the dtypes a manifest may name
DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
                    "bool", "complex64", "complex128"})

__all__ = ["MAX_RANKS", "STATE_KEY", "DTYPES", "shard_file_name", "params_fingerprint", "checked_manifest",
           "check_manifest_head", "check_params", "check_flat_buffer", "check_world_size", "check_shard_list",
           "scalar_ok", "numel_of", "write_rank_shard", "save_rank_shards", "SavedShards"]


def shard_file_name(stem: str, rank: int, size: int) -> str:
    """The file name of ``rank``'s shard when ``size`` ranks saved.

    Args:
        stem: what the shards hold (``optimizer``, ``model``).
        rank: the saving rank.
        size: how many ranks saved.

    Returns:
        ``<stem>.RRRRR-of-SSSSS.h5``.
    """
    return f"{stem}.{int(rank):05d}-of-{int(size):05d}.h5"


def numel_of(shape: list) -> int:
    """The elements of a tensor of ``shape``."""
    n = 1
    for d in shape:
        n *= d
    return n


def params_fingerprint(params: list) -> str:
    """SHA-256 of a manifest's ``[name, shape, dtype, requires_grad]`` list: which model the shards are of.

    Args:
        params: the list, JSON-able.

    Returns:
        64 hex digits.
    """
    return hashlib.sha256(json.dumps(params, separators=(",", ":")).encode()).hexdigest()


def checked_manifest(manifest: Any, check: Callable[[Any], None], what: str, path: Any) -> Any:
    """``manifest`` once ``check`` passed on it.

    Args:
        manifest: a manifest read from a checkpoint (untrusted).
        check: raises Defect (or TypeError) naming what is wrong.
        what: names the manifest in the error.
        path: the dense file, for the error.

    Returns:
        ``manifest``.

    Raises:
        CheckpointError: the manifest is malformed (a defect of the version).
    """
    try:
        check(manifest)
    except (Defect, RecursionError, TypeError) as exc:
        raise CheckpointError(f"bad {what} manifest: {exc}", path) from None
    return manifest


def check_manifest_head(manifest: Any, keys: set, fmt: str, version: int) -> None:
    """Raise Defect unless ``manifest`` is an object of exactly ``keys``, of format ``fmt`` at ``version``, whose
    ``world_size`` a manifest may name."""
    need(isinstance(manifest, dict), "", "must be an object")
    need(set(manifest) == keys, "", f"unexpected keys {short(sorted(map(str, manifest)))}")
    need(manifest["format"] == fmt, "format", f"{short(manifest['format'])} is not {fmt!r}")
    need(manifest["format_version"] == version and is_int(manifest["format_version"]), "format_version",
         f"{short(manifest['format_version'])}: this hvps reads version {version}")
    check_world_size(manifest["world_size"])


def check_params(params: Any, fingerprint: Any) -> None:
    """Raise Defect unless ``params`` is a list of ``[name, shape, dtype, requires_grad]`` whose
    :func:`params_fingerprint` is ``fingerprint``."""
    need(isinstance(params, list), "params", "must be a list")
    for i, p in enumerate(params):
        need(isinstance(p, list) and len(p) == 4 and isinstance(p[0], str) and isinstance(p[1], list)
             and all(is_int(n) and n >= 0 for n in p[1]) and p[2] in DTYPES and isinstance(p[3], bool),
             f"params[{i}]", "must be [name, shape, dtype, requires_grad]")
    need(fingerprint == params_fingerprint(params), "fingerprint", "is not the SHA-256 of params")


def check_flat_buffer(buffer: dict, at: str, size: int, params: list, seen: set) -> None:
    """Raise Defect unless ``buffer``'s ``numel``, ``shard_numel`` (at ``size`` ranks), ``params`` (``[index,
    start, numel]``, one after another, each of its parameter's size, none in ``seen``: they are added) and
    ``keys`` (state name -> dtype) are consistent.

    Args:
        buffer: a bucket or flat group of a manifest (an object: the caller checked its keys).
        at: where it is, for messages.
        size: the world size that saved.
        params: the manifest's checked parameter list.
        seen: the parameter indices of the buffers before it.
    """
    need(is_int(buffer["numel"]) and buffer["numel"] >= 0, f"{at}.numel", "must be an integer >= 0")
    need(buffer["shard_numel"] == shard_numel(buffer["numel"], size) and is_int(buffer["shard_numel"]),
         f"{at}.shard_numel", f"must be ceil(numel / {size})")
    start = 0
    for k, entry in enumerate(buffer["params"] if isinstance(buffer["params"], list) else [None]):
        need(isinstance(entry, list) and len(entry) == 3 and all(is_int(v) for v in entry), f"{at}.params[{k}]",
             "must be [index, start, numel]")
        index, begin, n = entry
        need(0 <= index < len(params) and index not in seen, f"{at}.params[{k}]", "index out of range or repeated")
        need(begin == start and n == numel_of(params[index][1]), f"{at}.params[{k}]",
             "does not follow the previous parameter or has the wrong size")
        seen.add(index)
        start += n
    need(start == buffer["numel"], at, "its parameters do not fill it")
    need(isinstance(buffer["keys"], dict) and all(isinstance(k, str) and STATE_KEY.match(k) and v in DTYPES
                                                  for k, v in buffer["keys"].items()),
         f"{at}.keys", "must map state names to dtypes")


def check_world_size(size: Any) -> None:
    """Raise Defect unless ``size`` is a world size a manifest may name."""
    need(is_int(size) and 1 <= size <= MAX_RANKS, "world_size", f"must be an integer in 1..{MAX_RANKS}")


def check_shard_list(shards: Any, size: int, stem: str) -> None:
    """Raise Defect unless ``shards`` lists ``size`` shards, ``{file, rank, sha256}`` each, in rank order.

    Args:
        shards: the manifest's list.
        size: the world size that saved.
        stem: the shards' file stem (:func:`shard_file_name`).
    """
    need(isinstance(shards, list) and len(shards) == size, "shards", f"must list {size} shards")
    for r, shard in enumerate(shards):
        need(isinstance(shard, dict) and shard == {"file": shard_file_name(stem, r, size), "rank": r,
                                                   "sha256": shard.get("sha256")}
             and isinstance(shard["sha256"], str) and SHA256_HEX.match(shard["sha256"]) is not None,
             f"shards[{r}]", f"must be {{file: {shard_file_name(stem, r, size)!r}, rank: {r}, sha256}}")


def scalar_ok(v: Any) -> bool:
    """Whether ``v`` is a scalar state value as the manifests encode it: ``{"value": v}`` or
    ``{"tensor": dtype, "value": v}`` with ``v`` None, a bool, an int or a float."""
    if not isinstance(v, dict) or "value" not in v or not set(v) <= {"tensor", "value"}:
        return False
    if "tensor" in v and v["tensor"] not in DTYPES:
        return False
    return v["value"] is None or isinstance(v["value"], (bool, int, float))


def write_rank_shard(path: Path, datasets: Mapping[str, tuple], extra: Mapping, attrs: Mapping,
                     fsync: bool) -> str:
    """Write one rank's shard file at ``path`` (temporary name, fsync, rename).

    Args:
        path: the final path.
        datasets: ``{dataset path: (1-D array, digest name)}``; the block digests of each go to
            ``/extra/blocks/<digest name>``.
        extra: the rest of ``/extra`` (rank, world size, fingerprint).
        attrs: the root attributes.
        fsync: fsync the file and the directory.

    Returns:
        The file's manifest SHA-256 (what the caller's manifest records).
    """
    sections: dict = {}
    blocks: dict = {}
    for dataset, (array, digest_name) in datasets.items():
        section, *inner, leaf = dataset.strip("/").split("/")
        node = sections.setdefault(section, {})
        for part in inner:
            node = node.setdefault(part, {})
        node[leaf] = array
        blocks[digest_name] = block_digests(array)
    sections["extra"] = dict(extra, blocks=blocks)
    with atomic_publish(path, fsync=fsync) as tmp:
        return write_file(tmp, sections, attrs, fsync=fsync).manifest_sha256


def save_rank_shards(write: Callable[[], str], rank: int, size: int, what: str, folder: Path, name: str) -> list:
    """Run this rank's ``write`` and learn every rank's outcome (collective over the job when ``size > 1``).

    Args:
        write: writes this rank's shard; returns its manifest digest.
        rank: this rank.
        size: the ranks that save (the job's).
        what: names the state in the error.
        folder: the version's shard folder, for the error.
        name: the collective's name.

    Returns:
        Every rank's manifest digest, in rank order.

    Raises:
        CheckpointError: on every rank, when a rank could not write its shard (earlier versions stay intact).
    """
    problems, digest = [], None
    try:
        digest = write()
    except Exception as exc:  # noqa: BLE001 - every rank learns every rank's problem below (none waits alone)
        problems.append(f"rank {rank}: {describe_problem(exc)}")
    gathered = api.allgather_object((problems, digest), name=name) if size > 1 else [(problems, digest)]
    everyone = [p for rank_problems, _ in gathered for p in rank_problems]
    if everyone:
        raise CheckpointError(f"saving {what} failed", folder, everyone)
    return [d for _, d in gathered]


class SavedShards:
    """The saved shards of one version that this rank opens, each inspected and checked against the manifest once.

    Args:
        folder: the version's shard folder.
        shards: the manifest's shard list (:func:`check_shard_list`).
        identity: what each shard's root attributes and ``/extra`` must say: ``{"framework", "epoch",
            "world_size", "fingerprint"}``.
        expected: ``{dataset path: (dtype name, elements, digest name)}``: exactly the datasets every shard holds.
    """

    def __init__(self, folder: Path, shards: list, identity: Mapping, expected: Mapping[str, tuple]) -> None:
        self.folder, self.shards, self.identity, self.expected = folder, shards, dict(identity), dict(expected)
        self.open: dict = {}  # rank -> (header, fd, blocks, {dataset: entry})
        self.spans: dict = {}  # (rank, dataset) -> (first byte, the verified blocks read last)

    def get(self, rank: int) -> tuple:
        """``(header, descriptor, block digests, {dataset: entry})`` of saved rank ``rank``'s shard (opened and
        checked once).

        Raises:
            CheckpointError: the shard is missing, unsafe, damaged, not the one listed or does not fit the manifest.
        """
        if rank not in self.open:
            shard = self.shards[rank]
            path = self.folder / shard["file"]
            header, identity = inspect_shard(path, shard["sha256"])
            blocks = self._check(path, header, rank)
            self.open[rank] = (header, open_same(path, identity), blocks, {e.path: e for e in header.entries})
        return self.open[rank]

    def _check(self, path: Path, header: Any, rank: int) -> dict:
        want, problems = self.identity, []
        attrs = header.attrs
        saved = (attrs.get("framework"), attrs.get("epoch"), attrs.get("world_size"))
        if saved != (want["framework"], want["epoch"], want["world_size"]):
            problems.append(f"root attributes framework={short(saved[0])} epoch={short(saved[1])} "
                            f"world_size={short(saved[2])}, expected {want['framework']!r}, {want['epoch']}, "
                            f"{want['world_size']}")
        extra = header.groups.get("/extra") or {}
        if extra.get("fingerprint") != want["fingerprint"]:
            problems.append("its model fingerprint is not the manifest's (a shard of another model)")
        if (extra.get("rank"), extra.get("world_size")) != (rank, want["world_size"]):
            problems.append(f"/extra says rank {short(extra.get('rank'))} of {short(extra.get('world_size'))}, "
                            f"expected {rank} of {want['world_size']}")
        found = {e.path: e for e in header.entries}
        if set(found) != set(self.expected):
            problems.append(f"datasets {short(sorted(found))}, the manifest lists {short(sorted(self.expected))}")
        blocks = header.groups.get("/extra/blocks") or {}
        for p, (dtype, n, digest_name) in self.expected.items():
            e = found.get(p)
            if e is None:
                continue
            if e.dtype != dtype or tuple(e.shape) != (n,):
                problems.append(f"dataset {p} is {e.dtype} {short(tuple(e.shape))}, the manifest says {dtype} ({n},)")
            digests = blocks.get(digest_name)
            if not (isinstance(digests, list) and all(isinstance(d, str) for d in digests)):
                problems.append(f"dataset {p} has no block digests")
        if problems:
            raise CheckpointError("shard does not fit its manifest", path, problems)
        return blocks

    def read(self, rank: int, dataset: str, lo: int, hi: int) -> np.ndarray:
        """Elements ``[lo, hi)`` of saved rank ``rank``'s ``dataset`` (verified; a new array).

        Raises:
            CheckpointError: as :meth:`get`, or a block read is truncated or damaged.
        """
        header, fd, blocks, entries = self.get(rank)
        entry = entries[dataset]
        item = np.dtype(entry.storage).itemsize
        first, last = lo * item, hi * item
        start, span = self.spans.get((rank, dataset), (0, np.empty(0, np.uint8)))
        if not start <= first <= last <= start + span.size:  # pieces come in order: most hit the last span
            start, span = read_verified_blocks(fd, header, dataset, blocks[self.expected[dataset][2]], first, last,
                                               entry=entry)
            self.spans[(rank, dataset)] = (start, span)
        array = span[first - start:last - start].view(np.dtype(entry.storage))
        if entry.dtype != np.dtype(entry.storage).name:
            array = array.view(logical_dtype(entry.dtype, dataset))
        return array.copy()

    def read_flat(self, dataset: str, numel: int, lo: int, n: int, out: np.ndarray) -> None:
        """Copy elements ``[lo, lo + n)`` of the saved flat buffer whose shards are ``dataset`` into ``out[:n]``
        (padding, at or past ``numel``, is left as ``out`` holds it).

        Args:
            dataset: the buffer's dataset in every shard.
            numel: the buffer's elements, without padding.
            lo: the first element wanted.
            n: how many.
            out: a 1-D array of the dataset's dtype.
        """
        for rank, offset, at, k in source_pieces(lo, lo + n, numel, self.identity["world_size"]):
            out[at:at + k] = self.read(rank, dataset, offset, offset + k)

    def close(self) -> None:
        """Close every shard opened."""
        for _, fd, _, _ in self.open.values():
            os.close(fd)
        self.open.clear()
        self.spans.clear()

    def __enter__(self) -> "SavedShards":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
