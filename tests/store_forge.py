"""Make store checkpoints the way an attacker would: start from real ones (``save_stores``), change
a shard or the store manifest, and recompute whatever digests the change breaks, up the chain
shard manifest -> store manifest -> dense file, so that only a key (HVPS_CHECKPOINT_KEY) or the
store's own checks can tell.

Written for the shard layout of store format 2 (``/model/ids``, ``/model/records``, the dense
checkpoint format); the bare layout of format 1 (``/ids``, ``/records``, attributes ``sha256`` and
``optimizer``) is handled too, so that the tests can be shown to fail on the code before it.
"""

import hashlib
import json
from pathlib import Path

import h5py
import numpy as np
from ckpt_forge import rewrite_manifest

from hvps.checkpoint.format import MANIFEST as DENSE_MANIFEST
from hvps.checkpoint.manager import file_name

STORE_MANIFEST = "MANIFEST.json"
EXTRA_KEY = "hvps_store_manifest"


def folder_of(directory, epoch) -> Path:
    return Path(directory) / f"store-epoch-{int(epoch):06d}"


def shards(directory, epoch, table) -> list:
    return sorted(folder_of(directory, epoch).glob(f"{table}.*-of-*.h5"))


def dataset(f: h5py.File, name: str) -> str:
    """The path of ``ids`` or ``records`` in either layout."""
    return f"/model/{name}" if f"/model/{name}" in f else f"/{name}"


def _readable(ds) -> bool:
    dcpl = ds.id.get_create_plist()
    return dcpl.get_external_count() == 0 and ds.id.get_storage_size() == ds.size * ds.dtype.itemsize \
        and ds.size * ds.dtype.itemsize <= 1 << 24


def rebless_shard(path: Path) -> None:
    """Make a format-2 shard's manifest describe the file as it now is (shapes, digests of the
    bytes that can be read safely, group attributes); the old signature, if any, stays."""
    with h5py.File(path, "r+") as f:
        if DENSE_MANIFEST not in f:
            return

        def edit(m):
            for d in m["datasets"]:
                ds = f[d["path"]]
                d.update(shape=list(ds.shape), storage=ds.dtype.str, dtype=ds.dtype.name,
                         nbytes=int(np.prod(ds.shape, dtype=object)) * ds.dtype.itemsize)
                if _readable(ds):
                    d["sha256"] = hashlib.sha256(ds[()].tobytes()).hexdigest()
            for g, attrs in m["groups"].items():
                for k in attrs:
                    attrs[k] = json.loads(f[g].attrs[k])
            return m

        rewrite_manifest(f, edit)


def shard_digest(path: Path) -> str:
    """What the store manifest lists for a shard: its manifest's digest (format 2), or the digest
    of its ids and records (format 1, small shards only)."""
    with h5py.File(path, "r") as f:
        if DENSE_MANIFEST in f:
            return str(f.attrs["manifest_sha256"])
        ids, records = f["ids"], f["records"]
        if not (_readable(ids) and _readable(records)):
            return str(f.attrs["sha256"])
        return hashlib.sha256(ids[()].tobytes() + records[()].tobytes()).hexdigest()


def bless_dense(directory, epoch, digest: str) -> None:
    """Make dense version ``epoch`` commit a store manifest of SHA-256 ``digest``."""
    with h5py.File(Path(directory) / file_name(epoch), "r+") as f:
        f["/extra"].attrs[EXTRA_KEY] = json.dumps(digest, separators=(",", ":"))

        def edit(m):
            m["groups"]["/extra"][EXTRA_KEY] = digest
            return m

        rewrite_manifest(f, edit)


def write_store_manifest(directory, epoch, manifest) -> None:
    text = json.dumps(manifest, sort_keys=True)
    (folder_of(directory, epoch) / STORE_MANIFEST).write_text(text)
    bless_dense(directory, epoch, hashlib.sha256(text.encode()).hexdigest())


def store_manifest(directory, epoch) -> dict:
    return json.loads((folder_of(directory, epoch) / STORE_MANIFEST).read_text())


def rebless_store(directory, epoch, table) -> None:
    """After shards of ``table`` changed: fix their manifests, the store manifest's entries and the dense file."""
    m = store_manifest(directory, epoch)
    for shard in m["tables"][table]["shards"]:
        path = folder_of(directory, epoch) / shard["file"]
        rebless_shard(path)
        shard["sha256"] = shard_digest(path)
        if "/" not in shard["file"]:
            with h5py.File(path, "r") as f:
                shard["rows"] = int(f[dataset(f, "ids")].shape[0])
    write_store_manifest(directory, epoch, m)


def edit_store_manifest(directory, epoch, edit) -> None:
    """``edit(manifest) -> manifest``, then the dense file is made to commit it."""
    write_store_manifest(directory, epoch, edit(store_manifest(directory, epoch)))


def set_optimizer_attr(path: Path, key: str, value) -> None:
    """Set the row optimizer's ``key`` in a shard (either layout), digests untouched."""
    with h5py.File(path, "r+") as f:
        if "optimizer" in f.attrs:
            state = json.loads(f.attrs["optimizer"])
            state[key] = value
            f.attrs["optimizer"] = json.dumps(state)
        else:
            f["/optimizer"].attrs[key] = json.dumps(value, separators=(",", ":"))


def replace_records(path: Path, shape=None, ids_rows=None, **create) -> None:
    """Swap a shard's records for a new dataset (``create``: h5py keywords, e.g. ``external``),
    never written; ``ids_rows`` resizes the ids too (zeros)."""
    with h5py.File(path, "r+") as f:
        name = dataset(f, "records")
        old = f[name]
        shape, dtype = tuple(shape or old.shape), old.dtype
        del f[name]
        f.create_dataset(name, shape=shape, dtype=dtype, **create)
        if ids_rows is not None:
            ids = dataset(f, "ids")
            del f[ids]
            f.create_dataset(ids, data=np.arange(ids_rows, dtype=np.int64))
