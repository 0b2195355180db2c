"""The hvps checkpoint file format (one HDF5 file per version) and its verification.

Layout of format version 1 (``ckpt-epoch-000007.h5``)::

    /                       root attributes: hvps_format, format_version, epoch, step,
                            world_size, framework, framework_version, hvps_version,
                            created, manifest_sha256
    /model/<name>           one dataset per tensor
    /optimizer/...          ``param_groups`` etc. as JSON attributes, per-parameter tensors
                            as datasets (``/optimizer/state/0/momentum_buffer``)
    /compression/rank_00001/<name>   per-rank state (e.g. error-feedback residuals)
    /rng/rank_00001/...     per-rank random-number-generator states
    /extra/...              user extras: arrays as datasets, JSON-able values as attributes
    /_hvps_manifest         uint8 dataset: UTF-8 JSON listing every dataset with its
                            dtype, shape, byte count and SHA-256, every group's JSON
                            attributes and a copy of the root attributes

``manifest_sha256`` (a root attribute) is the SHA-256 of the manifest's bytes, so the
chain root attribute -> manifest -> every dataset's bytes covers all data: a flipped
byte, a missing or an extra dataset, or an edited attribute is detected.

Nothing is ever unpickled: values are numeric/bool arrays or JSON (tuples are tagged so
that they come back as tuples).  Datasets are contiguous and uncompressed by default, so
their bytes sit at one offset in the file (``H5Dget_offset``) and are written and read
with ``pwrite``/``preadv`` outside HDF5, while SHA-256 runs in HASH_THREADS other threads;
``compress=True`` uses chunked lzf datasets read and written through h5py instead.

This module only knows about one file.  Versions, retention, atomic renames and
broadcasting live in :mod:`hvps.checkpoint.manager`.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import numpy as np

from ..core.errors import HvpsError
from ..core.files import RefusedFile, open_untrusted
from ..version import __version__
from .safety import (
    MAX_MANIFEST_BYTES,
    SIGNATURE_ATTR,
    Defect,
    check_manifest,
    check_signature,
    check_storage,
    checkpoint_key,
    sign,
)

FORMAT_NAME = "hvps-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "_hvps_manifest"
ALIGN = 64  # byte alignment of every tensor inside a flat buffer
SECTIONS = ("model", "optimizer", "compression", "rng", "extra")
ROOT_KEYS = ("hvps_format", "format_version", "epoch", "step", "world_size", "framework",
             "framework_version", "hvps_version", "created")
_TUPLE_TAG = "__hvps_tuple__"


class CheckpointError(HvpsError):
    """A checkpoint is missing, unreadable, corrupt, incompatible or does not fit the model.

    The message names the file (``path``) and, where there are several, lists every problem
    (``problems``).
    """

    def __init__(self, message: str, path: Optional[os.PathLike] = None, problems: Optional[list] = None) -> None:
        self.path = Path(path) if path is not None else None
        self.problems = list(problems or [])
        self.reason = message
        text = f"{path}: {message}" if path is not None else message
        if self.problems:
            text += "\n  " + "\n  ".join(str(p) for p in self.problems)
        super().__init__(text)


class IncompatibleCheckpointError(CheckpointError):
    """The checkpoint is intact but cannot be used here (a newer format version, per-rank
    state from another world size).  ``load("latest")`` raises it instead of silently
    falling back to an older version."""


# ----------------------------------------------------------------------------- names and JSON
def escape(name: str) -> str:
    """An HDF5 link name for ``name`` ('/' separates groups; '.' alone is reserved)."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"checkpoint keys must be non-empty strings; got {name!r}")
    out = name.replace("%", "%25").replace("/", "%2F")
    return "%2E" if out == "." else out


def unescape(name: str) -> str:
    return "." if name == "%2E" else name.replace("%2F", "/").replace("%25", "%")


def to_json(value: Any, where: str) -> Any:
    """``value`` as plain JSON data (tuples tagged); TypeError for anything else."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)  # plain str, also for subclasses such as torch's TorchVersion
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, tuple):
        return {_TUPLE_TAG: [to_json(v, where) for v in value]}
    if isinstance(value, list):
        return [to_json(v, where) for v in value]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise CheckpointError(f"{where}: dictionary key {k!r} is not a string; JSON attributes need string keys")
            if k == _TUPLE_TAG:
                raise CheckpointError(f"{where}: the key {_TUPLE_TAG!r} is reserved")
            out[k] = to_json(v, f"{where}.{k}")
        return out
    raise CheckpointError(
        f"{where}: a value of type {type(value).__name__} can be stored neither as an array nor as JSON "
        "(use numbers, strings, bools, None, lists, tuples, dicts with string keys, or numpy arrays)")


def from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TUPLE_TAG}:
            return tuple(from_json(v) for v in value[_TUPLE_TAG])
        return {k: from_json(v) for k, v in value.items()}
    return value


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=False, separators=(",", ":"), allow_nan=True)


# ----------------------------------------------------------------------------- dtypes
_NATIVE_KINDS = "biuf"  # bool, signed, unsigned, float: stored as themselves


def storage_dtype(dtype: np.dtype, where: str) -> np.dtype:
    """The dtype the bytes are stored as: the dtype itself, or for ml_dtypes types such as
    bfloat16 (which HDF5 does not know) the signed integer of the same width."""
    dtype = np.dtype(dtype)
    if dtype.kind in _NATIVE_KINDS and dtype.fields is None and dtype.type.__module__ == "numpy":
        return dtype.newbyteorder("=") if dtype.byteorder not in "=|" else dtype
    if dtype.kind == "c":
        return dtype
    if dtype.kind == "V" and dtype.fields is None and dtype.itemsize in (1, 2, 4, 8) and _ml_dtype(dtype.name):
        return np.dtype(f"<i{dtype.itemsize}")
    raise CheckpointError(f"{where}: arrays of dtype {dtype} cannot be stored (numeric, bool or ml_dtypes types only)")


def _ml_dtype(name: str) -> Optional[np.dtype]:
    try:
        import ml_dtypes
    except ImportError:
        return None
    t = getattr(ml_dtypes, name, None)
    return np.dtype(t) if t is not None else None


def logical_dtype(name: str, where: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        found = _ml_dtype(name)
        if found is None:
            raise CheckpointError(f"{where}: unknown dtype {name!r} (install ml_dtypes?)") from None
        return found


# ----------------------------------------------------------------------------- trees
@dataclass
class _Leaf:
    path: str  # HDF5 path, e.g. /model/conv1.weight
    array: np.ndarray  # C-contiguous, storage dtype
    dtype: str  # logical dtype name


def flatten_tree(tree: Mapping, prefix: str, where: str, leaves: list, groups: dict) -> None:
    """Walk a nested mapping: arrays become leaves, mappings groups, anything else JSON attributes."""
    attrs = {}
    groups[prefix] = attrs
    for key, value in tree.items():
        child = f"{prefix}/{escape(key)}"
        label = f"{where}.{key}" if where else str(key)
        if isinstance(value, np.ndarray) or (hasattr(value, "__array_interface__") and not isinstance(value, Mapping)):
            arr = np.asarray(value)
            if arr.dtype.hasobject:
                raise CheckpointError(f"{label}: object arrays cannot be stored")
            store = storage_dtype(arr.dtype, label)
            arr = arr if arr.flags.c_contiguous else arr.copy(order="C")
            if arr.dtype.kind == "V" or arr.dtype != store:
                arr = arr.view(store) if arr.dtype.itemsize == store.itemsize and arr.dtype.kind == "V" else arr.astype(store)
            leaves.append(_Leaf(child, arr, np.dtype(value.dtype).name))
        elif isinstance(value, Mapping):
            flatten_tree(value, child, label, leaves, groups)
        else:
            attrs[key] = to_json(value, label)


@dataclass
class DatasetEntry:
    """One dataset as listed in the manifest, and where its bytes sit in a flat buffer."""

    path: str
    dtype: str
    storage: str
    shape: tuple
    nbytes: int
    sha256: str
    start: int = 0  # offset inside the flat buffer

    def as_json(self) -> dict:
        return {"path": self.path, "dtype": self.dtype, "storage": self.storage, "shape": list(self.shape),
                "nbytes": self.nbytes, "sha256": self.sha256}


@dataclass
class Header:
    """What a checkpoint says about itself, before its data is read."""

    path: Path
    attrs: dict  # root attributes (without manifest_sha256)
    entries: list  # [DatasetEntry]
    groups: dict  # HDF5 group path -> {attr: json value}
    total_bytes: int = 0  # size of the flat buffer, alignment included
    offsets: Optional[dict] = None  # path -> file offset of a contiguous dataset's bytes, else None
    manifest_sha256: str = ""  # the manifest's SHA-256 (the root of the file's digest chain)

    @property
    def epoch(self) -> int:
        return int(self.attrs["epoch"])

    def summary(self) -> dict:
        sections: dict = {}
        for e in self.entries:
            sec = e.path.split("/")[1]
            s = sections.setdefault(sec, {"datasets": 0, "bytes": 0})
            s["datasets"] += 1
            s["bytes"] += e.nbytes
        return {"path": str(self.path), **self.attrs, "datasets": len(self.entries),
                "data_bytes": sum(e.nbytes for e in self.entries), "sections": sections}


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def is_per_rank_compression(path: str) -> bool:
    return path.startswith("/compression/")


def place_in_buffer(entries: list) -> int:
    """Assign each entry its place in a flat buffer: shared sections first, then the
    per-rank compression state rank after rank (so a rank's part is one slice)."""
    pos = 0
    for e in [e for e in entries if not is_per_rank_compression(e.path)] + \
             [e for e in entries if is_per_rank_compression(e.path)]:
        e.start = pos
        pos += padded(e.nbytes)
    return pos


def build_trees(header: Header, buffer: np.ndarray, only: Optional[callable] = None) -> dict:
    """Nested dicts (section -> ...) of numpy views into ``buffer`` plus group JSON attributes."""
    root: dict = {}

    def node(path: str) -> dict:
        cur = root
        for part in path.strip("/").split("/"):
            if part:
                cur = cur.setdefault(unescape(part), {})
        return cur

    for gpath, attrs in header.groups.items():
        if only is None or only(gpath):
            node(gpath).update({k: from_json(v) for k, v in attrs.items()})
    for e in header.entries:
        if only is not None and not only(e.path):
            continue
        parent, _, name = e.path.rpartition("/")
        raw = buffer[e.start:e.start + e.nbytes]
        arr = raw.view(np.dtype(e.storage)).reshape(e.shape)
        if e.dtype != np.dtype(e.storage).name:
            arr = arr.view(logical_dtype(e.dtype, e.path))
        node(parent)[unescape(name)] = arr
    return root


def aligned_empty(nbytes: int) -> np.ndarray:
    """A uint8 buffer of ``nbytes`` whose start is ALIGN-aligned."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    skip = (-raw.ctypes.data) % ALIGN
    return raw[skip:skip + nbytes]


# ----------------------------------------------------------------------------- writing
_WRITEBACK_BYTES = 32 << 20  # start the kernel's writeback after this many bytes (Linux)


HASH_THREADS = 2  # SHA-256 of one dataset is sequential; different datasets hash in parallel
_HASH_BATCH = 4 << 20  # consecutive small datasets are hashed as one task


def _sha256(array: np.ndarray) -> str:
    return hashlib.sha256(memoryview(array).cast("B")).hexdigest() if array.nbytes else hashlib.sha256(b"").hexdigest()


def _sha256_all(arrays: list) -> list:
    return [_sha256(a) for a in arrays]


def _hash_batches(pool: ThreadPoolExecutor, arrays: list) -> list:
    """Futures, each for a list of digests of consecutive ``arrays`` (in order)."""
    futures, batch, size = [], [], 0
    for a in arrays:
        batch.append(a)
        size += a.nbytes
        if size >= _HASH_BATCH:
            futures.append(pool.submit(_sha256_all, batch))
            batch, size = [], 0
    if batch:
        futures.append(pool.submit(_sha256_all, batch))
    return futures


def _sync_file_range():
    """libc's ``sync_file_range`` (Linux) or None: starts writeback of dirty pages without
    waiting, so the disk works while later bytes are still being copied in and the final
    fsync has little left to do.  ctypes releases the GIL during the call."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SFR = _sync_file_range()
_SFR_WRITE = 2  # SYNC_FILE_RANGE_WRITE


def _write_all(fd: int, jobs: list, early_writeback: bool) -> None:
    """pwrite every (offset, array) of ``jobs`` (the GIL is released in each call)."""
    pending = 0
    for offset, arr in jobs:
        _pwrite_all(fd, arr, offset)
        pending += arr.nbytes
        if early_writeback and _SFR is not None and pending >= _WRITEBACK_BYTES:
            _SFR(fd, 0, 0, _SFR_WRITE)  # a hint: errors surface in the final fsync
            pending = 0


def write_file(path: os.PathLike, sections: Mapping[str, Mapping], root_attrs: Mapping[str, Any],
               compress: bool = False, fsync: bool = True) -> Header:
    """Write one complete checkpoint file at ``path`` (the caller picks a temporary name).

    ``sections`` maps a section name (see SECTIONS) to a nested mapping of arrays and
    JSON-able values.  First this thread creates every HDF5 object (contiguous datasets,
    space allocated, never filled), alone: that work holds the GIL, and threads waiting for
    the GIL beside it would slow it down several times.  Then the bytes go out with
    ``pwrite`` at each dataset's offset while HASH_THREADS threads compute the SHA-256s;
    both release the GIL, so they run in parallel.  Every 32 MiB the kernel is told to
    start writing back (``sync_file_range``), so that the final fsync (when ``fsync``)
    has little left to wait for.
    """
    import h5py
    from h5py import h5d, h5g, h5p, h5s, h5t

    path = Path(path)
    leaves: list = []
    groups: dict = {}
    for name, tree in sections.items():
        if name not in SECTIONS:
            raise CheckpointError(f"unknown section {name!r}; use one of {SECTIONS}")
        if tree is None:
            continue
        if not isinstance(tree, Mapping):
            raise CheckpointError(f"section {name!r} must be a mapping, got {type(tree).__name__}")
        flatten_tree(tree, f"/{name}", name, leaves, groups)
    attrs = {k: to_json(v, f"root attribute {k}") for k, v in root_attrs.items()}

    pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="hvps-ckpt-sha")
    jobs: list = []
    fd = -1
    try:
        with h5py.File(path, "w", locking=False) as f:
            dcpl = h5p.create(h5p.DATASET_CREATE)
            if not compress:
                # Space for the bytes is reserved now and never pre-filled: we write it ourselves.
                dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
                dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
            lcpl = h5p.create(h5p.LINK_CREATE)
            lcpl.set_create_intermediate_group(True)
            types: dict = {}
            existing = {""}
            for leaf in leaves:
                arr = leaf.array
                parent = leaf.path.rpartition("/")[0]
                while parent not in existing:
                    existing.add(parent)
                    parent = parent.rpartition("/")[0]
                if compress and arr.ndim and arr.size:
                    dsid = f.create_dataset(leaf.path, data=arr, compression="lzf", chunks=True).id
                else:
                    htype = types.get(arr.dtype)
                    if htype is None:
                        htype = types[arr.dtype] = h5t.py_create(arr.dtype)
                    space = h5s.create_simple(arr.shape) if arr.ndim else h5s.create(h5s.SCALAR)
                    dsid = h5d.create(f.id, leaf.path.encode(), htype, space, dcpl=dcpl, lcpl=lcpl)
                    offset = dsid.get_offset() if arr.nbytes else None
                    if offset is not None:
                        jobs.append((offset, arr))
                    elif arr.nbytes:
                        dsid.write(h5s.ALL, h5s.ALL, arr)
                if leaf.dtype != arr.dtype.name:
                    h5py.Dataset(dsid).attrs["dtype"] = leaf.dtype
            for gpath in sorted(groups, key=lambda g: g.count("/")):  # parents first
                if gpath not in existing:
                    h5g.create(f.id, gpath.encode()).close()
                    existing.add(gpath)
                if groups[gpath]:
                    g = f[gpath]
                    for k, v in groups[gpath].items():
                        g.attrs[k] = _dumps(v)
            hashes = _hash_batches(pool, [leaf.array for leaf in leaves])
            fd = os.open(path, os.O_WRONLY)
            _write_all(fd, jobs, fsync)  # raises OSError (e.g. ENOSPC)
            entries = [DatasetEntry(leaf.path, leaf.dtype, leaf.array.dtype.str, tuple(leaf.array.shape),
                             int(leaf.array.nbytes), digest)
                       for leaf, digest in zip(leaves, [d for fut in hashes for d in fut.result()])]
            manifest = {"format_version": FORMAT_VERSION, "root": attrs,
                        "datasets": [e.as_json() for e in entries], "groups": groups}
            blob = np.frombuffer(_dumps(manifest).encode(), dtype=np.uint8)
            f.create_dataset(MANIFEST, data=blob)
            for k, v in attrs.items():
                f.attrs[k] = v if isinstance(v, (int, float, str)) and not isinstance(v, bool) else _dumps(v)
            manifest_digest = f.attrs["manifest_sha256"] = hashlib.sha256(blob.tobytes()).hexdigest()
            signature = sign(blob.tobytes(), checkpoint_key())
            if signature is not None:
                f.attrs[SIGNATURE_ATTR] = signature
        if fsync:
            os.fsync(fd)  # HDF5 wrote its metadata through its own descriptor, now closed
    finally:
        if fd >= 0:
            os.close(fd)
        pool.shutdown(wait=True, cancel_futures=True)
    header = Header(path, attrs, entries, groups, manifest_sha256=manifest_digest)
    header.total_bytes = place_in_buffer(entries)
    return header


def _pwrite_all(fd: int, arr: np.ndarray, offset: int) -> None:
    view = memoryview(arr).cast("B")
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes")
        done += n


# ----------------------------------------------------------------------------- reading
def _root_value(v: Any) -> Any:
    if isinstance(v, bytes):
        v = v.decode()
    if isinstance(v, np.generic):
        v = v.item()
    return v


def read_header_local(path: os.PathLike) -> Header:
    """:func:`read_header` in this process, without a deadline (the helper process runs it)."""
    import h5py

    path = Path(path)
    try:
        with h5py.File(path, "r", locking=False) as f:
            return _read_header(path, f)
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError("no such checkpoint file", path) from None
    except Defect as exc:
        raise CheckpointError(str(exc), path) from None
    except (OSError, KeyError, ValueError, RuntimeError, TypeError, AttributeError, RecursionError) as exc:
        size = path.stat().st_size if path.exists() else 0
        raise CheckpointError(f"unreadable HDF5 file ({size} bytes; truncated or not a checkpoint): {exc}", path) from exc


def _read_header(path: Path, f) -> Header:
    from h5py import h5d, h5o

    root = {k: _root_value(v) for k, v in f.attrs.items()}
    if root.get("hvps_format") != FORMAT_NAME:
        raise CheckpointError(f"not an hvps checkpoint (hvps_format={root.get('hvps_format')!r})", path)
    version = root.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise IncompatibleCheckpointError(
            f"checkpoint format version {version} is not supported by hvps {__version__} "
            f"(it reads versions 1..{FORMAT_VERSION}); it was written by hvps {root.get('hvps_version')}: "
            "upgrade hvps to load it", path)
    if MANIFEST not in f or "manifest_sha256" not in root:
        raise CheckpointError("the manifest is missing (file incomplete)", path)
    file_size = path.stat().st_size
    blob = _read_manifest(f[MANIFEST], file_size)
    digest = hashlib.sha256(blob).hexdigest()
    if digest != root["manifest_sha256"]:
        raise CheckpointError(f"manifest checksum mismatch (sha256 {digest} != {root['manifest_sha256']})", path)
    check_signature(blob, root.get(SIGNATURE_ATTR), checkpoint_key())
    try:
        manifest = json.loads(blob.decode())
    except (ValueError, RecursionError) as exc:
        raise Defect(f"the manifest is not JSON: {exc}") from None
    check_manifest(manifest, version)
    attrs = manifest["root"]
    problems = []
    for k, v in attrs.items():
        got = root.get(k)
        if isinstance(got, str) and not isinstance(v, str):
            got = json.loads(got)
        if got != v and not (isinstance(v, float) and math.isnan(v)):
            problems.append(f"root attribute {k}: file says {got!r}, manifest says {v!r}")
    entries = [DatasetEntry(d["path"], d["dtype"], d["storage"], tuple(d["shape"]), int(d["nbytes"]), d["sha256"])
               for d in manifest["datasets"]]
    listed = {e.path for e in entries}
    found = set()

    def visit(name, info):  # low-level: no h5py object per item
        if info.type == h5o.TYPE_DATASET and name != MANIFEST.encode():
            found.add("/" + name.decode())

    h5o.visit(f.id, visit, info=True)
    for p in sorted(found - listed):
        problems.append(f"dataset {p} is in the file but not in the manifest")
    for p in sorted(listed - found):
        problems.append(f"dataset {p} is listed in the manifest but missing from the file")
    offsets = {}
    for e in entries:
        if e.path not in found:
            continue
        dsid = h5d.open(f.id, e.path.encode())
        try:
            if dsid.dtype.str != e.storage or tuple(dsid.shape) != e.shape:
                problems.append(f"dataset {e.path}: file has {dsid.dtype.str}{tuple(dsid.shape)}, "
                                f"manifest says {e.storage}{e.shape}")
            offsets[e.path] = check_storage(dsid, e.nbytes, file_size)
        except Defect as exc:
            problems.append(f"dataset {e.path} {exc}")
        finally:
            dsid.close()
    for gpath, gattrs in manifest["groups"].items():
        if not gattrs:
            continue
        have = f.get(gpath)
        for k, v in gattrs.items():
            raw = None if have is None else have.attrs.get(k)
            if raw is None or _root_value(raw) != _dumps(v):  # text compare: NaN != NaN
                problems.append(f"group {gpath}: attribute {k} differs from the manifest")
    if problems:
        raise CheckpointError("file contents do not match its manifest", path, problems)
    header = Header(path, attrs, entries, manifest["groups"], offsets=offsets, manifest_sha256=digest)
    header.total_bytes = place_in_buffer(entries)
    return header


def _read_manifest(dataset, file_size: int) -> bytes:
    """The manifest's bytes, once its dataset proves to be a modest uint8 vector stored in this file."""
    import h5py

    if not isinstance(dataset, h5py.Dataset) or dataset.dtype != np.uint8 or dataset.ndim != 1:
        raise Defect("the manifest is not a uint8 vector")
    if dataset.size > MAX_MANIFEST_BYTES:
        raise Defect(f"the manifest declares {dataset.size} bytes (more than {MAX_MANIFEST_BYTES})")
    check_storage(dataset.id, int(dataset.size), file_size)
    return dataset[()].tobytes()


def chunk_bounds(entries: list, chunk_bytes: int) -> list:
    """Byte offsets that cut the flat buffer of ``entries`` (laid out from 0 in order) into
    pieces of about ``chunk_bytes`` at dataset boundaries; the last one is the end."""
    bounds, last = [], 0
    for e in entries:
        end = e.start + padded(e.nbytes)
        if end - last >= chunk_bytes:
            bounds.append(end)
            last = end
    total = max((e.start + padded(e.nbytes) for e in entries), default=0)
    if total > last:
        bounds.append(total)
    return bounds


class Reader:
    """Reads a checkpoint's tensors into one flat, aligned uint8 buffer and verifies them.

    ``read()`` returns the buffer at once; ``verify()`` then waits for the SHA-256 of every
    dataset (computed in a background thread while reading) and raises CheckpointError
    listing each dataset whose bytes do not match.  Callers may ship the buffer elsewhere
    (e.g. broadcast it) between the two calls, but must not use it before ``verify()``.
    ``read(bounds=[...], ready=fn)`` calls ``fn(k)`` as soon as the buffer's bytes up to
    ``bounds[k]`` are in (so a broadcast of that piece can start while the rest is read).
    """

    def __init__(self, path: os.PathLike, header: Header) -> None:
        self.path = Path(path)
        self.header = header
        self._pool: Optional[ThreadPoolExecutor] = None
        self._digests: list = []

    def read(self, buffer: Optional[np.ndarray] = None, bounds: Optional[list] = None,
             ready: Optional[callable] = None) -> np.ndarray:
        import h5py
        from h5py import h5d

        header = self.header
        buf = aligned_empty(header.total_bytes) if buffer is None else buffer
        self._pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="hvps-ckpt-sha")
        self._digests = []
        batch, batch_bytes = [], 0
        bounds = list(bounds or [])
        nxt = 0
        fd = open_regular(self.path)  # swapped for a FIFO after the inspection: refused, not a hang
        try:
            file_size = os.fstat(fd).st_size
            known = header.offsets or {}
            # HDF5 is opened only for datasets whose offset the header does not give
            # (chunked ones): a plain file is read with preadv alone.
            needs_h5 = any(e.nbytes and known.get(e.path) is None for e in header.entries)
            with h5py.File(self.path, "r", locking=False) if needs_h5 else contextlib.nullcontext() as f:
                # Where each dataset's bytes are: one pass over the metadata first.
                plan = []
                for e in sorted(header.entries, key=lambda e: e.start):
                    offset = None
                    if e.nbytes and e.path in known:
                        offset = known[e.path]
                    elif e.nbytes:
                        dsid = f[e.path].id
                        offset = dsid.get_offset()
                        if offset is not None and dsid.get_create_plist().get_layout() != h5d.CONTIGUOUS:
                            offset = None
                    if e.nbytes:
                        if offset is not None and offset + e.nbytes > file_size:
                            raise CheckpointError(
                                f"truncated: dataset {e.path} needs bytes {offset}..{offset + e.nbytes} "
                                f"but the file has {file_size}", self.path)
                    plan.append((e, offset))
                for e, offset in plan:
                    dst = buf[e.start:e.start + e.nbytes]
                    if e.nbytes:
                        if offset is not None:
                            pread_all(fd, dst, offset, self.path, e.path)
                        else:
                            target = dst.view(np.dtype(e.storage)).reshape(e.shape)
                            f[e.path].read_direct(target)
                    batch.append((e, dst))
                    batch_bytes += e.nbytes
                    if batch_bytes >= _HASH_BATCH or e is plan[-1][0]:
                        self._digests.append(([b[0] for b in batch], self._pool.submit(
                            _sha256_all, [b[1] for b in batch])))
                        batch, batch_bytes = [], 0
                    done = e.start + padded(e.nbytes)
                    while nxt < len(bounds) and bounds[nxt] <= done:
                        ready(nxt)
                        nxt += 1
        except CheckpointError:
            self._close()
            raise
        except (OSError, KeyError, ValueError, RuntimeError, TypeError) as exc:
            self._close()
            raise CheckpointError(f"unreadable data (truncated or damaged file): {exc}", self.path) from exc
        finally:
            os.close(fd)
        while nxt < len(bounds):  # bounds past the last dataset (nothing to wait for)
            ready(nxt)
            nxt += 1
        return buf

    def verify(self) -> None:
        try:
            bad = [f"dataset {e.path}: sha256 {digest} != manifest {e.sha256}"
                   for batch, fut in self._digests for e, digest in zip(batch, fut.result()) if digest != e.sha256]
        finally:
            self._close()
        if bad:
            raise CheckpointError("checksum mismatch (the data was damaged after it was written)", self.path, bad)

    def _close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def open_regular(path: os.PathLike, follow_links: bool = True) -> int:
    """A read descriptor of ``path``, which must be a regular file (not a FIFO, a device or a
    directory): opened without blocking, then checked (``core/files.py``'s rule); with
    ``follow_links=False`` a symlink is refused too. CheckpointError otherwise."""
    try:
        return open_untrusted(path, follow_links=follow_links)
    except RefusedFile as exc:
        raise CheckpointError("missing" if exc.missing else exc.reason, path) from None


def pread_all(fd: int, dst: np.ndarray, offset: int, path: Path, name: str) -> None:
    view = memoryview(dst).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"truncated: dataset {name} ended after {done} of {len(view)} bytes", path)
        done += n


def root_attributes(epoch: int, step: Optional[int], world_size: int, framework: str,
                    framework_version: str) -> dict:
    now = time.time()
    return {
        "hvps_format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "epoch": int(epoch),
        "step": -1 if step is None else int(step),
        "world_size": int(world_size),
        "framework": framework,
        "framework_version": framework_version,
        "hvps_version": __version__,
        "created": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(timespec="milliseconds"),
        "created_unix": now,
    }


def iter_leaves(tree: Mapping, prefix: str = "") -> Iterator[tuple]:
    """(dotted key, array) for every array in a nested mapping."""
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            yield from iter_leaves(v, key)
        elif isinstance(v, np.ndarray):
            yield key, v


__all__ = ["CheckpointError", "IncompatibleCheckpointError", "FORMAT_VERSION", "Header", "Reader", "write_file",
           "read_header_local", "build_trees", "aligned_empty", "root_attributes"]
