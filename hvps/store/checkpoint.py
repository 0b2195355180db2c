"""Store shards in the versioned checkpoints, written by every member, committed by the dense file.

A reasoned exception to "only rank 0 writes": a table may be larger than any one rank's
memory, so funnelling it through rank 0 is not an option.  Saving epoch N:

1. every member writes its shard of each table to ``store-epoch-N/<table>.<member>-of-<members>.h5``
   (temporary name, fsync, rename), with the rows' global ids and SHA-256 digests;
2. rank 0 gathers the digests and writes ``store-epoch-N/MANIFEST.json`` the same way;
3. the dense checkpoint of epoch N (``CheckpointManager.save``) is written last and records the
   manifest's digest.  A version therefore counts only when every shard and the manifest
   are there: the dense file is the commit record.

Loading tries versions newest first and rejects (with a warning) one whose dense file,
manifest or any shard is missing or fails its digest, falling back to the previous one.
Shards saved by a different number of members are re-sharded: every member reads every
saved shard and keeps the rows its new partition gives it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional

import h5py
import numpy as np
import torch

from hvps import api
from hvps.checkpoint.format import CheckpointError, fsync_path

from .module import _ShardedBase

MANIFEST = "MANIFEST.json"
EXTRA_KEY = "hvps_store_manifest"
CHUNK_ROWS = 1 << 16


def store_dir(directory: os.PathLike, epoch: int) -> Path:
    return Path(directory) / f"store-epoch-{int(epoch):06d}"


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent, directory=True)
    finally:
        tmp.unlink(missing_ok=True)


def _write_shard(path: Path, module: _ShardedBase) -> dict:
    module.synchronize()
    table = module.table
    table.flush()
    rows, width = table.tier.rows, table.width
    digest = hashlib.sha256()

    def write(tmp: Path) -> None:
        with h5py.File(tmp, "w") as f:
            ids = f.create_dataset("ids", (rows,), dtype="i8")
            records = f.create_dataset("records", (rows, width), dtype="f4")
            for start in range(0, rows, CHUNK_ROWS):
                stop = min(rows, start + CHUNK_ROWS)
                chunk_ids = table.partition.global_ids(table.member, torch.arange(start, stop)).numpy()
                chunk = np.ascontiguousarray(table.records(start, stop).numpy())
                ids[start:stop], records[start:stop] = chunk_ids, chunk
                digest.update(chunk_ids.tobytes())
                digest.update(chunk.tobytes())
            f.attrs["sha256"] = digest.hexdigest()
            f.attrs["optimizer"] = json.dumps(table.optimizer.state_dict())

    _atomic_write(path, write)
    return {"file": path.name, "member": table.member, "rows": rows, "sha256": digest.hexdigest()}


def _modules(stores: Any) -> list:
    modules = list(stores.values()) if isinstance(stores, Mapping) else list(stores)
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"store tables must have distinct names, got {names}")
    return modules


def save_stores(manager: Any, epoch: int, stores: Any, extra: Optional[Mapping] = None, **dense: Any) -> Any:
    """Save every member's shards of ``stores``, then the dense checkpoint of ``epoch`` (collective).

    ``manager`` is an ``hvps.checkpoint.CheckpointManager`` (or the torch adapter's); ``dense``
    and ``extra`` are passed to its ``save``.  Returns what ``save`` returns.
    """
    modules = _modules(stores)
    folder = store_dir(manager.directory, epoch)
    folder.mkdir(parents=True, exist_ok=True)
    mine = {}
    for m in modules:
        parts = m.table.partition.parts
        entry = _write_shard(folder / f"{m.name}.{m.table.member:05d}-of-{parts:05d}.h5", m)
        mine[m.name] = dict(entry, table=m.table.describe(), members=parts)
    gathered = api.allgather_object(mine, name=f"store.ckpt.save.{epoch}")
    manifest = {"epoch": int(epoch), "tables": {}}
    for per_rank in gathered:
        for name, entry in per_rank.items():
            table = manifest["tables"].setdefault(name, {"table": entry["table"], "members": entry["members"],
                                                          "shards": []})
            table["shards"].append({k: entry[k] for k in ("file", "member", "rows", "sha256")})
    text = json.dumps(manifest, sort_keys=True)
    if api.rank() == 0:
        _atomic_write(folder / MANIFEST, lambda tmp: tmp.write_text(text))
    api.barrier()
    extra = dict(extra or {}, **{EXTRA_KEY: hashlib.sha256(text.encode()).hexdigest()})
    result = manager.save(epoch, extra=extra, **dense)
    if api.rank() == 0:
        _remove_orphans(manager)
    return result


def _remove_orphans(manager: Any) -> None:
    """Drop store folders whose dense version retention removed (or that never committed)."""
    kept = {v.epoch for v in manager.list()}
    for path in Path(manager.directory).glob("store-epoch-*"):
        epoch = int(path.name.rsplit("-", 1)[1])
        if epoch not in kept:
            shutil.rmtree(path, ignore_errors=True)


def _check_shard(path: Path, expected: dict) -> Optional[str]:
    """Why the shard file at ``path`` is not the one the manifest lists (None when it is)."""
    try:
        digest = hashlib.sha256()
        with h5py.File(path, "r") as f:
            ids, records = f["ids"], f["records"]
            if ids.shape[0] != expected["rows"] or records.shape[0] != expected["rows"]:
                return f"{path.name}: {ids.shape[0]} rows, the manifest says {expected['rows']}"
            for start in range(0, expected["rows"], CHUNK_ROWS):
                stop = min(expected["rows"], start + CHUNK_ROWS)
                digest.update(np.ascontiguousarray(ids[start:stop]).tobytes())
                digest.update(np.ascontiguousarray(records[start:stop]).tobytes())
    except (OSError, KeyError, ValueError) as exc:
        return f"{path.name}: unreadable ({exc})"
    if digest.hexdigest() != expected["sha256"]:
        return f"{path.name}: SHA-256 mismatch"
    return None


def _version_problems(manager: Any, epoch: int, modules: list) -> list:
    """Problems with version ``epoch`` found by this rank (its share of the shard files)."""
    folder = store_dir(manager.directory, epoch)
    try:
        text = (folder / MANIFEST).read_text()
        manifest = json.loads(text)
    except (OSError, ValueError) as exc:
        return [f"epoch {epoch}: no readable store manifest ({exc})"]
    problems = []
    if api.rank() == 0:
        try:
            manager.verify(epoch)
        except CheckpointError as exc:
            problems.append(f"epoch {epoch}: dense checkpoint: {exc}")
    for m in modules:
        if m.name not in manifest["tables"]:
            problems.append(f"epoch {epoch}: table {m.name!r} is not in the manifest")
    shards = []
    for name, table in manifest["tables"].items():
        if len(table["shards"]) != table["members"]:
            problems.append(f"epoch {epoch}: table {name!r} has {len(table['shards'])} of {table['members']} shards")
        shards.extend(table["shards"])
    for k, shard in enumerate(sorted(shards, key=lambda s: s["file"])):
        if k % api.size() == api.rank():
            problem = _check_shard(folder / shard["file"], shard)
            if problem:
                problems.append(f"epoch {epoch}: {problem}")
    return problems


def _load_table(folder: Path, module: _ShardedBase, saved: dict) -> None:
    module.synchronize()
    table = module.table
    table.drop_cache()
    if saved["table"]["embedding_dim"] != table.dim or saved["table"]["num_embeddings"] != table.num_embeddings:
        raise CheckpointError(f"table {module.name!r}: saved shape differs from the module's")
    for shard in saved["shards"]:
        with h5py.File(folder / shard["file"], "r") as f:
            ids, records = f["ids"], f["records"]
            if records.shape[1] != table.width:
                raise CheckpointError(f"table {module.name!r}: saved with another optimizer's state")
            optimizer = json.loads(f.attrs["optimizer"])
            for start in range(0, shard["rows"], CHUNK_ROWS):
                stop = min(shard["rows"], start + CHUNK_ROWS)
                chunk_ids = torch.from_numpy(np.asarray(ids[start:stop]))
                mine = table.partition.owner(chunk_ids) == table.member
                if bool(mine.any()):
                    rows = torch.from_numpy(np.asarray(records[start:stop]))[mine]
                    table.overwrite(table.partition.slot(chunk_ids[mine]), rows)
    table.optimizer.load_state_dict(optimizer)


def load_stores(manager: Any, stores: Any, **dense: Any) -> int:
    """Load the newest complete version into ``stores`` and ``manager`` (collective).

    Returns the epoch to resume from (0 when no complete version exists); ``dense`` goes to
    ``manager.load`` (e.g. ``model=``, ``optimizer=`` for the torch adapter's manager).
    """
    modules = _modules(stores)
    for version in reversed(manager.list()):
        problems = _version_problems(manager, version.epoch, modules)
        everyone = [p for rank_problems in api.allgather_object(problems, name=f"store.ckpt.check.{version.epoch}")
                    for p in rank_problems]
        if everyone:
            warnings.warn(f"skipping checkpoint epoch {version.epoch}: {'; '.join(everyone)}", RuntimeWarning,
                          stacklevel=2)
            continue
        start = manager.load(version.epoch, **dense)
        expected = hashlib.sha256((store_dir(manager.directory, version.epoch) / MANIFEST).read_bytes()).hexdigest()
        if manager.loaded.extra.get(EXTRA_KEY) != expected:
            warnings.warn(f"skipping checkpoint epoch {version.epoch}: its manifest is not the one it committed",
                          RuntimeWarning, stacklevel=2)
            continue
        manifest = json.loads((store_dir(manager.directory, version.epoch) / MANIFEST).read_text())
        for m in modules:
            _load_table(store_dir(manager.directory, version.epoch), m, manifest["tables"][m.name])
        api.barrier()
        return start
    return 0
