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
with ``pwrite``/``preadv`` outside HDF5, while SHA-256 runs in a second thread;
``compress=True`` uses chunked lzf datasets read and written through h5py instead.

This module only knows about one file.  Versions, retention, atomic renames and
broadcasting live in :mod:`hvps.checkpoint`.
"""

from __future__ import annotations

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

from .errors import HvpsError
from .version import __version__

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


def _flatten(tree: Mapping, prefix: str, where: str, leaves: list, groups: dict) -> None:
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
            _flatten(value, child, label, leaves, groups)
        else:
            attrs[key] = to_json(value, label)


@dataclass
class Entry:
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
    entries: list  # [Entry]
    groups: dict  # HDF5 group path -> {attr: json value}
    total_bytes: int = 0  # size of the flat buffer, alignment included

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


def _layout(entries: list) -> int:
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
def _sha256(array: np.ndarray) -> str:
    return hashlib.sha256(memoryview(array).cast("B")).hexdigest() if array.nbytes else hashlib.sha256(b"").hexdigest()


def write_file(path: os.PathLike, sections: Mapping[str, Mapping], root_attrs: Mapping[str, Any],
               compress: bool = False, fsync: bool = True) -> Header:
    """Write one complete checkpoint file at ``path`` (the caller picks a temporary name).

    ``sections`` maps a section name (see SECTIONS) to a nested mapping of arrays and
    JSON-able values.  Hashes run in a second thread while the bytes are written; the file
    is fsynced before returning when ``fsync`` is true.
    """
    import h5py
    from h5py import h5d, h5p, h5s, h5t

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
        _flatten(tree, f"/{name}", name, leaves, groups)
    attrs = {k: to_json(v, f"root attribute {k}") for k, v in root_attrs.items()}

    pool = ThreadPoolExecutor(1, thread_name_prefix="hvps-ckpt-sha")
    try:
        digests = [pool.submit(_sha256, leaf.array) for leaf in leaves]
        entries = []
        with h5py.File(path, "w", locking=False) as f:
            dcpl = h5p.create(h5p.DATASET_CREATE)
            if not compress:
                # Space for the bytes is reserved now and never pre-filled: we write it ourselves.
                dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
                dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
            lcpl = h5p.create(h5p.LINK_CREATE)
            lcpl.set_create_intermediate_group(True)
            for gpath, gattrs in groups.items():
                g = f.require_group(gpath)
                for k, v in gattrs.items():
                    g.attrs[k] = _dumps(v)
            raw_writes = []
            for leaf in leaves:
                arr = leaf.array
                if compress and arr.ndim and arr.size:
                    ds = f.create_dataset(leaf.path, data=arr, compression="lzf", chunks=True)
                else:
                    space = h5s.create_simple(arr.shape) if arr.ndim else h5s.create(h5s.SCALAR)
                    dsid = h5d.create(f.id, leaf.path.encode(), h5t.py_create(arr.dtype), space, dcpl=dcpl, lcpl=lcpl)
                    offset = dsid.get_offset() if arr.nbytes else None
                    if offset is None:
                        if arr.nbytes:
                            dsid.write(h5s.ALL, h5s.ALL, arr)
                    else:
                        raw_writes.append((offset, arr))
                    ds = None
                if leaf.dtype != arr.dtype.name:
                    (ds if ds is not None else f[leaf.path]).attrs["dtype"] = leaf.dtype
            # The raw bytes go through our own descriptor (GIL released, hashing overlaps).
            fd = os.open(path, os.O_WRONLY)
            try:
                for offset, arr in raw_writes:
                    _pwrite_all(fd, arr, offset)
            finally:
                os.close(fd)
            for leaf, fut in zip(leaves, digests):
                arr = leaf.array
                entries.append(Entry(leaf.path, leaf.dtype, arr.dtype.str, tuple(arr.shape), int(arr.nbytes), fut.result()))
            manifest = {"format_version": FORMAT_VERSION, "root": attrs,
                        "datasets": [e.as_json() for e in entries], "groups": groups}
            blob = np.frombuffer(_dumps(manifest).encode(), dtype=np.uint8)
            f.create_dataset(MANIFEST, data=blob)
            for k, v in attrs.items():
                f.attrs[k] = v if isinstance(v, (int, float, str)) and not isinstance(v, bool) else _dumps(v)
            f.attrs["manifest_sha256"] = hashlib.sha256(blob.tobytes()).hexdigest()
        if fsync:
            fsync_path(path)
    finally:
        pool.shutdown(wait=True)
    header = Header(path, attrs, entries, groups)
    header.total_bytes = _layout(entries)
    return header


def _pwrite_all(fd: int, arr: np.ndarray, offset: int) -> None:
    view = memoryview(arr).cast("B")
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes")
        done += n


def fsync_path(path: os.PathLike, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- reading
def _root_value(v: Any) -> Any:
    if isinstance(v, bytes):
        v = v.decode()
    if isinstance(v, np.generic):
        v = v.item()
    return v


def read_header(path: os.PathLike) -> Header:
    """Open ``path``, check format name and version, read and authenticate the manifest
    against ``manifest_sha256`` and compare it with the file's structure.  Reads no tensor
    data.  Raises CheckpointError naming the file."""
    import h5py

    path = Path(path)
    try:
        with h5py.File(path, "r", locking=False) as f:
            return _read_header(path, f)
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError("no such checkpoint file", path) from None
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        size = path.stat().st_size if path.exists() else 0
        raise CheckpointError(f"unreadable HDF5 file ({size} bytes; truncated or not a checkpoint): {exc}", path) from exc


def _read_header(path: Path, f) -> Header:
    import h5py

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
    blob = f[MANIFEST][()]
    digest = hashlib.sha256(blob.tobytes()).hexdigest()
    if digest != root["manifest_sha256"]:
        raise CheckpointError(f"manifest checksum mismatch (sha256 {digest} != {root['manifest_sha256']})", path)
    manifest = json.loads(blob.tobytes().decode())
    attrs = manifest["root"]
    problems = []
    for k, v in attrs.items():
        got = root.get(k)
        if isinstance(got, str) and not isinstance(v, str):
            got = json.loads(got)
        if got != v and not (isinstance(v, float) and math.isnan(v)):
            problems.append(f"root attribute {k}: file says {got!r}, manifest says {v!r}")
    entries = [Entry(d["path"], d["dtype"], d["storage"], tuple(d["shape"]), int(d["nbytes"]), d["sha256"])
               for d in manifest["datasets"]]
    listed = {e.path for e in entries}
    found = {}

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset) and name != MANIFEST:
            found["/" + name] = obj

    f.visititems(visit)
    for p in sorted(set(found) - listed):
        problems.append(f"dataset {p} is in the file but not in the manifest")
    for p in sorted(listed - set(found)):
        problems.append(f"dataset {p} is listed in the manifest but missing from the file")
    for e in entries:
        ds = found.get(e.path)
        if ds is not None and (ds.dtype.str != e.storage or tuple(ds.shape) != e.shape):
            problems.append(f"dataset {e.path}: file has {ds.dtype.str}{tuple(ds.shape)}, "
                            f"manifest says {e.storage}{e.shape}")
    for gpath, gattrs in manifest["groups"].items():
        have = f.get(gpath)
        for k, v in gattrs.items():
            raw = None if have is None else have.attrs.get(k)
            if raw is None or _root_value(raw) != _dumps(v):  # text compare: NaN != NaN
                problems.append(f"group {gpath}: attribute {k} differs from the manifest")
    if problems:
        raise CheckpointError("file contents do not match its manifest", path, problems)
    header = Header(path, attrs, entries, manifest["groups"])
    header.total_bytes = _layout(entries)
    return header


class Reader:
    """Reads a checkpoint's tensors into one flat, aligned uint8 buffer and verifies them.

    ``read()`` returns the buffer at once; ``verify()`` then waits for the SHA-256 of every
    dataset (computed in a background thread while reading) and raises CheckpointError
    listing each dataset whose bytes do not match.  Callers may ship the buffer elsewhere
    (e.g. broadcast it) between the two calls, but must not use it before ``verify()``.
    """

    def __init__(self, path: os.PathLike, header: Optional[Header] = None) -> None:
        self.path = Path(path)
        self.header = header if header is not None else read_header(self.path)
        self._pool: Optional[ThreadPoolExecutor] = None
        self._digests: list = []

    def read(self, buffer: Optional[np.ndarray] = None) -> np.ndarray:
        import h5py
        from h5py import h5d

        header = self.header
        buf = aligned_empty(header.total_bytes) if buffer is None else buffer
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hvps-ckpt-sha")
        self._digests = []
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"cannot open: {exc}", self.path) from exc
        try:
            file_size = os.fstat(fd).st_size
            with h5py.File(self.path, "r", locking=False) as f:
                for e in header.entries:
                    dst = buf[e.start:e.start + e.nbytes]
                    if e.nbytes:
                        dsid = f[e.path].id
                        offset = dsid.get_offset()
                        if offset is not None and dsid.get_create_plist().get_layout() == h5d.CONTIGUOUS:
                            if offset + e.nbytes > file_size:
                                raise CheckpointError(
                                    f"truncated: dataset {e.path} needs bytes {offset}..{offset + e.nbytes} "
                                    f"but the file has {file_size}", self.path)
                            _pread_all(fd, dst, offset, self.path, e.path)
                        else:
                            target = dst.view(np.dtype(e.storage)).reshape(e.shape)
                            f[e.path].read_direct(target)
                    self._digests.append((e, self._pool.submit(_sha256, dst)))
        except CheckpointError:
            self._close()
            raise
        except (OSError, KeyError, ValueError, RuntimeError) as exc:
            self._close()
            raise CheckpointError(f"unreadable data (truncated or damaged file): {exc}", self.path) from exc
        finally:
            os.close(fd)
        return buf

    def verify(self) -> None:
        try:
            bad = [f"dataset {e.path}: sha256 {fut.result()} != manifest {e.sha256}"
                   for e, fut in self._digests if fut.result() != e.sha256]
        finally:
            self._close()
        if bad:
            raise CheckpointError("checksum mismatch (the data was damaged after it was written)", self.path, bad)

    def _close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _pread_all(fd: int, dst: np.ndarray, offset: int, path: Path, name: str) -> None:
    view = memoryview(dst).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"truncated: dataset {name} ended after {done} of {len(view)} bytes", path)
        done += n


def read_verified(path: os.PathLike) -> tuple:
    """(header, buffer) of a fully verified checkpoint; CheckpointError otherwise."""
    reader = Reader(path)
    buf = reader.read()
    reader.verify()
    return reader.header, buf


def verify_file(path: os.PathLike) -> Header:
    """Check everything about ``path`` (structure, manifest, every dataset's SHA-256)."""
    header, _ = read_verified(path)
    return header


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


__all__ = ["CheckpointError", "IncompatibleCheckpointError", "FORMAT_VERSION", "Header", "Reader", "write_file", "read_header",
           "read_verified", "verify_file", "build_trees", "aligned_empty", "root_attributes"]
