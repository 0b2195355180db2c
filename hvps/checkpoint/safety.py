"""Checks that make a checkpoint from elsewhere safe to read.

A checkpoint file is input from someone else: it may point a dataset at another file
(HDF5 *external storage*, virtual datasets), declare gigabytes it never stored, carry
dtypes no tensor has, or hold a manifest that hashes correctly but has the wrong shape.
Everything here turns such a file into a :class:`CheckpointError` naming the defect,
before any tensor byte is read or any buffer allocated.

With ``HVPS_CHECKPOINT_KEY`` set, the manifest also carries an HMAC-SHA256
(``manifest_hmac``), so an edited file is detected; without a key the SHA-256 chain is a
checksum against damage, not proof of who wrote the file.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from typing import Any, Optional

import numpy as np

from ..core.settings import env_text

KEY_ENV = "HVPS_CHECKPOINT_KEY"
SIGNATURE_ATTR = "manifest_hmac"
#: storage dtypes a dataset may have (numeric and bool; ml_dtypes are stored as signed ints)
ALLOWED_STORAGE = frozenset(f"{order}{code}" for order in "<>|" for code in
                            ("b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8",
                             "f2", "f4", "f8", "f16", "c8", "c16", "c32"))
MAX_MANIFEST_BYTES = 64 << 20
MAX_RANK = 32  # dimensions of one tensor
_COMPACT_LIMIT = 64 << 10  # HDF5 caps compact datasets at 64 KiB
_LZF = 32000  # the only filter hvps writes (compress=True)
_LZF_MAX_RATIO = 128  # lzf expands at most ~100x: more is a decompression bomb
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_SECTION_PATH = re.compile(r"^/(model|optimizer|compression|rng|extra)(/[^/]+)+$")


class Defect(ValueError):
    """One reason a checkpoint cannot be trusted (turned into CheckpointError by the caller)."""


def checkpoint_key() -> Optional[bytes]:
    """The key from ``HVPS_CHECKPOINT_KEY``, or None."""
    text = env_text(KEY_ENV)
    return text.encode() if text else None


def sign(blob: bytes, key: Optional[bytes]) -> Optional[str]:
    """The manifest's HMAC-SHA256 under ``key`` (hex), or None without a key."""
    return None if key is None else hmac.new(key, blob, hashlib.sha256).hexdigest()


def check_signature(blob: bytes, stored: Any, key: Optional[bytes]) -> None:
    """With a key, the file must carry the manifest's HMAC under it."""
    if key is None:
        return
    if not isinstance(stored, str):
        raise Defect(f"{KEY_ENV} is set but the file carries no manifest signature (unsigned or stripped)")
    if not hmac.compare_digest(stored.encode(), sign(blob, key).encode()):
        raise Defect(f"manifest signature does not match {KEY_ENV} (the file was edited, or signed with another key)")


# ----------------------------------------------------------------------------- dtypes
def logical_allowed(name: str, storage: str) -> bool:
    """Whether a tensor may be declared as dtype ``name`` stored as ``storage``."""
    if storage not in ALLOWED_STORAGE:
        return False
    stored = np.dtype(storage)
    if name == stored.name:
        return True
    try:
        import ml_dtypes
    except ImportError:
        return False
    # only ml_dtypes' public types: a name from the file such as "__dict__" must not reach np.dtype
    found = None if name.startswith("_") else getattr(ml_dtypes, name, None)
    if not isinstance(found, type):
        return False
    try:
        dtype = np.dtype(found)
    except (TypeError, ValueError):
        return False
    return dtype.kind == "V" and stored.kind == "i" and dtype.itemsize == stored.itemsize


# ----------------------------------------------------------------------------- manifest schema
def need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise Defect(f"manifest {where}: {what}")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_dataset(i: int, d: Any) -> None:
    where = f"datasets[{i}]"
    need(isinstance(d, dict), where, "must be an object")
    need(set(d) == {"path", "dtype", "storage", "shape", "nbytes", "sha256"}, where,
          f"keys must be path, dtype, storage, shape, nbytes, sha256 (got {sorted(map(str, d))[:8]})")
    path = d["path"]
    need(isinstance(path, str) and _SECTION_PATH.match(path) is not None and len(path) < 4096, where,
          f"path {str(path)[:80]!r} is not /<section>/<name> in a known section")
    need(isinstance(d["storage"], str) and d["storage"] in ALLOWED_STORAGE, where,
          f"storage dtype {str(d['storage'])[:40]!r} is not an allowed numeric type")
    need(isinstance(d["dtype"], str) and logical_allowed(d["dtype"], d["storage"]), where,
          f"dtype {str(d['dtype'])[:40]!r} is not allowed for storage {d['storage']}")
    shape = d["shape"]
    need(isinstance(shape, list) and len(shape) <= MAX_RANK and all(is_int(n) and n >= 0 for n in shape),
          where, f"shape must be a list of at most {MAX_RANK} non-negative integers")
    expected = math.prod(shape) * np.dtype(d["storage"]).itemsize
    need(is_int(d["nbytes"]) and d["nbytes"] == expected, where,
          f"nbytes {d['nbytes']!r} != shape x itemsize = {expected}")
    need(isinstance(d["sha256"], str) and SHA256_HEX.match(d["sha256"]) is not None, where,
         "sha256 must be 64 hex digits")


def check_manifest(manifest: Any, format_version: int) -> None:
    """Raise Defect unless ``manifest`` has the structure, types and ranges hvps writes."""
    need(isinstance(manifest, dict), "", "must be a JSON object")
    need(set(manifest) == {"format_version", "root", "datasets", "groups"}, "",
          f"keys must be format_version, root, datasets, groups (got {sorted(map(str, manifest))[:8]})")
    need(manifest["format_version"] == format_version and is_int(manifest["format_version"]),
          "format_version", f"{manifest['format_version']!r} != the file's {format_version}")
    root = manifest["root"]
    need(isinstance(root, dict), "root", "must be an object")
    for key in ("epoch", "world_size"):
        need(is_int(root.get(key)) and root[key] >= (1 if key == "world_size" else 0), f"root.{key}",
              f"{root.get(key)!r} is not a {'positive' if key == 'world_size' else 'non-negative'} integer")
    need(is_int(root.get("step", -1)) and root.get("step", -1) >= -1, "root.step", "must be an integer >= -1")
    datasets = manifest["datasets"]
    need(isinstance(datasets, list), "datasets", "must be a list")
    seen = set()
    for i, d in enumerate(datasets):
        _check_dataset(i, d)
        need(d["path"] not in seen, f"datasets[{i}]", f"path {d['path']} is listed twice")
        seen.add(d["path"])
    groups = manifest["groups"]
    need(isinstance(groups, dict), "groups", "must be an object")
    for g, attrs in groups.items():
        need(g.startswith("/") and isinstance(attrs, dict), f"groups[{g[:80]!r}]",
              "must map a group path to an object of attributes")


# ----------------------------------------------------------------------------- dataset storage
def check_storage(dsid, nbytes: int, file_size: int) -> Optional[int]:
    """Where a dataset's bytes lie (file offset; None when chunked), after refusing storage
    that reads elsewhere (external files, virtual datasets) or does not hold ``nbytes``."""
    from h5py import h5d

    dcpl = dsid.get_create_plist()
    if dcpl.get_external_count():
        raise Defect("uses external storage (its bytes would come from another file)")
    layout = dcpl.get_layout()
    if layout == h5d.VIRTUAL:
        raise Defect("is a virtual dataset (its bytes would come from other datasets or files)")
    stored = dsid.get_storage_size()
    if layout == h5d.CHUNKED:
        filters = [dcpl.get_filter(i)[0] for i in range(dcpl.get_nfilters())]
        if any(f != _LZF for f in filters):
            raise Defect(f"uses HDF5 filters {filters} (hvps writes lzf only)")
        if nbytes and (stored == 0 or stored > file_size or nbytes > stored * _LZF_MAX_RATIO):
            raise Defect(f"declares {nbytes} bytes but stores {stored} compressed")
        return None
    if layout == h5d.COMPACT and nbytes > _COMPACT_LIMIT:
        raise Defect(f"is compact but declares {nbytes} bytes")
    if stored != nbytes:
        raise Defect(f"declares {nbytes} bytes but the file stores {stored} for it")
    if layout != h5d.CONTIGUOUS or not nbytes:
        return None
    offset = dsid.get_offset()
    if offset is None or offset + nbytes > file_size:
        raise Defect(f"its bytes {offset}..{(offset or 0) + nbytes} lie beyond the end of the file ({file_size} bytes)")
    return offset
