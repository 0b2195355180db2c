"""Make checkpoints the way an attacker would: start from a real one, change it with
h5py and recompute the manifest's SHA-256 so that the checksum still holds."""

import hashlib
import json
from pathlib import Path

import h5py
import numpy as np

from hvps.checkpoint.format import MANIFEST
from hvps.checkpoint.manager import CheckpointManager, file_name


def make_versions(directory: Path, epochs=(1, 2)) -> CheckpointManager:
    """Save small, valid versions for ``epochs``."""
    mgr = CheckpointManager(directory)
    for epoch in epochs:
        mgr.save(epoch, model={"w": np.arange(64, dtype=np.float32) + epoch, "b": np.ones(3, np.int64)},
                 extra={"note": "ok"})
    mgr.wait_for_retention()
    return mgr


def path_of(directory: Path, epoch: int) -> Path:
    return Path(directory) / file_name(epoch)


def rewrite_manifest(f: h5py.File, edit) -> None:
    """Apply ``edit(manifest) -> manifest`` and store it with a matching SHA-256."""
    manifest = json.loads(f[MANIFEST][()].tobytes().decode())
    blob = json.dumps(edit(manifest)).encode()
    del f[MANIFEST]
    f.create_dataset(MANIFEST, data=np.frombuffer(blob, np.uint8))
    f.attrs["manifest_sha256"] = hashlib.sha256(blob).hexdigest()


def entry(manifest: dict, path: str) -> dict:
    return next(d for d in manifest["datasets"] if d["path"] == path)


def replace_dataset(path: Path, name: str, shape, dtype, **create) -> None:
    """Swap dataset ``name`` for a new one made with ``create`` keywords; fix the manifest."""
    with h5py.File(path, "r+") as f:
        del f[name]
        f.create_dataset(name, shape=shape, dtype=dtype, **create)

        def edit(m):
            e = entry(m, name)
            e.update(shape=list(shape), storage=np.dtype(dtype).str, dtype=np.dtype(dtype).name,
                     nbytes=int(np.prod(shape)) * np.dtype(dtype).itemsize)
            return m

        rewrite_manifest(f, edit)


def corrupt_global_heap(path: Path) -> None:
    """Make libhdf5 loop forever reading ``path``'s string attributes: the free-space
    object (index 0) of its global heap (GCOL) gets size 0, so the heap parser never
    advances (H5HG cache deserialize; found by the fuzzer, HDF5 1.14)."""
    data = bytearray(Path(path).read_bytes())
    heap = data.find(b"GCOL")
    assert heap >= 0, "no global heap (no variable-length string attribute)"
    size = int.from_bytes(data[heap + 8:heap + 16], "little")
    at = heap + 16
    while at + 16 <= heap + size:
        index, nbytes = int.from_bytes(data[at:at + 2], "little"), int.from_bytes(data[at + 8:at + 16], "little")
        if index == 0:
            data[at + 8:at + 16] = bytes(8)
            Path(path).write_bytes(data)
            return
        at += 16 + (nbytes + 7) // 8 * 8
    raise AssertionError("global heap has no free-space object")
