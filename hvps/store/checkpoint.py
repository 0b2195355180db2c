"""Store shards in the versioned checkpoints, written by every member, committed by the dense file.

A reasoned exception to "only rank 0 writes": a table may be larger than any one rank's
memory, so funnelling it through rank 0 is not an option.  Saving epoch N:

1. every member writes its shard of each table to ``store-epoch-N/<table>.<member>-of-<members>.h5``
   (temporary name, fsync, rename).  A shard is a file of the dense checkpoint format
   (:mod:`hvps.checkpoint.format`): datasets ``/model/ids`` (the rows' global ids) and
   ``/model/records`` (embedding and optimizer state per row), the row optimizer's state as
   ``/optimizer`` attributes, the table, member and member count as ``/extra`` attributes, all
   listed with their SHA-256 in the file's manifest (and signed with ``HVPS_CHECKPOINT_KEY``);
2. rank 0 gathers each shard's manifest digest and writes ``store-epoch-N/MANIFEST.json``;
3. the dense checkpoint of epoch N (``CheckpointManager.save``) is written last and records the
   store manifest's digest.  A version therefore counts only when every shard and the manifest
   are there: the dense file is the commit record, and its digest chain (dense file -> store
   manifest -> each shard's manifest -> each dataset and attribute) covers every byte a load uses.

Loading reads everything as untrusted input, with the dense checkpoint's defences: a shard
must be a regular file in its folder, named as the store manifest (schema-checked, at most
64 MiB) says, and its HDF5 structure is inspected in the sandboxed helper
(:mod:`hvps.checkpoint.inspect`: deadline, memory cap, :mod:`hvps.checkpoint.safety`'s checks
of storage, dtypes, manifest and signature), so a FIFO, external storage or a file declaring
more than it holds ends in a CheckpointError instead of a hang or an allocation.  The row
bytes are then read at the offsets the helper checked (``preadv``, no libhdf5 in this
process), hashed, and kept in a spare tier: the shard is replaced only after every member has
checked every byte of the version, so a defect found anywhere skips the whole version on
every rank (a warning naming it) and leaves every table as it was.  Versions are tried newest
first.  A member reads only its own shard when the table has the saved member count and
partition; otherwise the version is re-sharded: every member reads every saved shard and keeps
the rows its new partition gives it.  Store folders are written in format 2; those of format 1
(bare ``ids``/``records`` datasets) are refused like any other defect.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import numpy as np
import torch

from hvps import api
from hvps.core.atomic_files import atomic_publish
from hvps.core.user_warnings import warn
from hvps.checkpoint.format import CheckpointError, from_json, open_regular, pread_all, root_attributes, write_file
from hvps.checkpoint.inspect import prestart
from hvps.checkpoint.safety import MAX_MANIFEST_BYTES, SHA256_HEX, is_int, need
from hvps.checkpoint.shards import (agree, describe_problem, inspect_shard, shard_folder, short,
                                   tidy_shard_folders)

from .module import _ShardedBase
from .table import ShardedTable
from .tiers import Tier, discard_tier

MANIFEST = "MANIFEST.json"
EXTRA_KEY = "hvps_store_manifest"
STORE_FORMAT = "hvps-store"
STORE_FORMAT_VERSION = 2  # 1: shards with bare ids/records datasets (before the dense file format)
FRAMEWORK = "hvps.store"  # the shards' root attribute "framework"
CHUNK_BYTES = 16 << 20  # rows read (and hashed) at a time while loading
MAX_MEMBERS = 1 << 20
FOLDER_RE = re.compile(r"^store-epoch-(\d{6,})$")
_IDS, _RECORDS = "/model/ids", "/model/records"
_BAD_NAME = re.compile(r"[/\x00-\x1f\x7f]")


def store_dir(directory: os.PathLike, epoch: int) -> Path:
    return shard_folder(directory, "store", epoch)


def shard_name(table: str, member: int, members: int) -> str:
    return f"{table}.{int(member):05d}-of-{int(members):05d}.h5"


def _safe_name(name: Any) -> bool:
    """Whether ``name`` can name a table's files inside its folder (no path, no control characters)."""
    return (isinstance(name, str) and 0 < len(name) <= 200 and _BAD_NAME.search(name) is None
            and not name.startswith("."))


# ----------------------------------------------------------------------------- saving
def write_shard(path: Path, table: ShardedTable, epoch: int, fsync: bool = True) -> dict:
    """Write ``table``'s shard to ``path`` (atomically); its entry for the store manifest."""
    table.flush()
    rows = table.tier.rows
    ids = table.partition.global_ids(table.member, torch.arange(rows)).numpy()
    records = np.ascontiguousarray(table.records(0, rows).numpy())
    members = table.partition.parts
    sections = {"model": {"ids": ids, "records": records},
                "optimizer": table.optimizer.state_dict(),
                "extra": {"table": table.name, "member": table.member, "members": members}}
    attrs = root_attributes(epoch, None, members, FRAMEWORK, torch.__version__)
    with atomic_publish(path, fsync=fsync) as tmp:
        digest = write_file(tmp, sections, attrs, fsync=fsync).manifest_sha256
    return {"file": path.name, "member": table.member, "rows": rows, "sha256": digest}


def _modules(stores: Any) -> list:
    modules = list(stores.values()) if isinstance(stores, Mapping) else list(stores)
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"store tables must have distinct names, got {names}")
    return modules


def save_stores(manager: Any, epoch: int, stores: Any, extra: Optional[Mapping] = None, **dense: Any) -> Any:
    """Save every member's shards of ``stores``, then the dense checkpoint of ``epoch`` (collective).

    Args:
        manager: an ``hvps.checkpoint.CheckpointManager`` (or the torch adapter's).
        epoch: the epoch just finished.
        stores: the sharded modules (``ShardedEmbeddingBag``, ``ShardedEmbedding``), as a list or a mapping
            whose values they are; each table needs a distinct name.
        extra: passed to the manager's ``save``.
        **dense: passed to the manager's ``save`` (e.g. ``model=``, ``optimizer=``).

    Returns:
        What the manager's ``save`` returns (the dense file's path on rank 0).

    Raises:
        ValueError: two tables share a name, or a name cannot name a file.
        CheckpointError: the manager's ``save`` failed (see ``CheckpointManager.save``).
    """
    modules = _modules(stores)
    for m in modules:
        if not _safe_name(m.name):
            raise ValueError(f"store table name {m.name!r} cannot name its checkpoint files: use 1 to 200 "
                             "characters without '/', control characters or a leading '.'")
    fsync = getattr(manager, "fsync", True)
    folder = store_dir(manager.directory, epoch)
    folder.mkdir(parents=True, exist_ok=True)
    mine = {}
    for m in modules:
        m.synchronize()
        parts = m.table.partition.parts
        entry = write_shard(folder / shard_name(m.name, m.table.member, parts), m.table, epoch, fsync)
        mine[m.name] = dict(entry, table=m.table.describe(), members=parts)
    text = manifest_text(epoch, api.allgather_object(mine, name=f"store.ckpt.save.{epoch}"))
    if api.rank() == 0:
        with atomic_publish(folder / MANIFEST, fsync=fsync) as tmp:
            tmp.write_text(text)
    api.barrier()
    extra = dict(extra or {}, **{EXTRA_KEY: hashlib.sha256(text.encode()).hexdigest()})
    result = manager.save(epoch, extra=extra, **dense)
    if api.rank() == 0:
        _tidy(manager, int(epoch))
    return result


def manifest_text(epoch: int, gathered: list) -> str:
    """The store manifest of ``epoch`` from every rank's ``{table: shard entry + table, members}``."""
    manifest = {"format": STORE_FORMAT, "format_version": STORE_FORMAT_VERSION, "epoch": int(epoch), "tables": {}}
    for per_rank in gathered:
        for name, entry in per_rank.items():
            table = manifest["tables"].setdefault(name, {"table": entry["table"], "members": entry["members"],
                                                          "shards": []})
            table["shards"].append({k: entry[k] for k in ("file", "member", "rows", "sha256")})
    for table in manifest["tables"].values():
        table["shards"].sort(key=lambda s: s["member"])
    return json.dumps(manifest, sort_keys=True)


def _tidy(manager: Any, epoch: int) -> None:
    """After committing ``epoch``: :func:`hvps.checkpoint.shards.tidy_shard_folders` of the store folders."""
    tidy_shard_folders(manager, epoch, FOLDER_RE)


# ----------------------------------------------------------------------------- reading
def read_store_manifest(folder: Path, epoch: int) -> tuple:
    """``(bytes, manifest)`` of ``folder``'s store manifest after the schema check; CheckpointError otherwise."""
    path = folder / MANIFEST
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            raise CheckpointError("the store folder is not a directory", folder)
    except FileNotFoundError:
        raise CheckpointError("the store folder is missing", folder) from None
    fd = open_regular(path, follow_links=False)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"the store manifest has {size} bytes (more than {MAX_MANIFEST_BYTES})", path)
        parts, got = [], 0
        while got <= MAX_MANIFEST_BYTES:
            part = os.read(fd, 1 << 20)
            if not part:
                break
            parts.append(part)
            got += len(part)
        blob = b"".join(parts)
    finally:
        os.close(fd)
    try:
        manifest = json.loads(blob.decode())
        check_store_manifest(manifest, epoch)
    except (ValueError, RecursionError) as exc:  # Defect is a ValueError; so are JSON and UTF-8 errors
        raise CheckpointError(f"bad store manifest: {exc}", path) from None
    return blob, manifest


def check_store_manifest(manifest: Any, epoch: int) -> None:
    """Raise Defect unless ``manifest`` has the structure, types and ranges :func:`save_stores` writes."""
    need(isinstance(manifest, dict), "", "must be a JSON object")
    need(set(manifest) == {"format", "format_version", "epoch", "tables"}, "",
         f"keys must be format, format_version, epoch, tables (got {sorted(map(str, manifest))[:8]}; "
         "a store saved before store format 2 cannot be loaded)")
    need(manifest["format"] == STORE_FORMAT, "format", f"{str(manifest['format'])[:40]!r} is not {STORE_FORMAT!r}")
    need(manifest["format_version"] == STORE_FORMAT_VERSION and is_int(manifest["format_version"]),
         "format_version", f"{str(manifest['format_version'])[:40]!r}: this hvps reads store format "
                           f"{STORE_FORMAT_VERSION}")
    need(manifest["epoch"] == epoch and is_int(manifest["epoch"]), "epoch",
         f"{str(manifest['epoch'])[:40]!r} is not the folder's epoch {epoch}")
    tables = manifest["tables"]
    need(isinstance(tables, dict), "tables", "must be an object")
    for name, entry in tables.items():
        where = f"tables[{name[:80]!r}]"
        need(_safe_name(name), where, "is not a table name that can name files")
        need(isinstance(entry, dict) and set(entry) == {"table", "members", "shards"}, where,
             "must be an object with keys table, members, shards")
        described, members, shards = entry["table"], entry["members"], entry["shards"]
        need(isinstance(described, dict), f"{where}.table", "must be an object")
        for key in ("num_embeddings", "embedding_dim"):
            need(is_int(described.get(key)) and described[key] >= 1, f"{where}.table.{key}",
                 "must be a positive integer")
        need(isinstance(described.get("optimizer"), str), f"{where}.table.optimizer", "must be a string")
        need(is_int(members) and 1 <= members <= MAX_MEMBERS, f"{where}.members",
             f"must be an integer in 1..{MAX_MEMBERS}")
        need(isinstance(shards, list) and len(shards) == members, f"{where}.shards",
             f"must be a list of {members} shards")
        total = 0
        for k, shard in enumerate(shards):
            at = f"{where}.shards[{k}]"
            need(isinstance(shard, dict) and set(shard) == {"file", "member", "rows", "sha256"}, at,
                 "must be an object with keys file, member, rows, sha256")
            need(shard["member"] == k and is_int(shard["member"]), f"{at}.member", f"must be {k}")
            need(shard["file"] == shard_name(name, k, members), f"{at}.file",
                 f"{str(shard['file'])[:80]!r} is not {shard_name(name, k, members)!r} (shards are "
                 "files of their own folder)")
            need(is_int(shard["rows"]) and 0 <= shard["rows"] <= described["num_embeddings"], f"{at}.rows",
                 f"must be an integer in 0..{described['num_embeddings']}")
            need(isinstance(shard["sha256"], str) and SHA256_HEX.match(shard["sha256"]) is not None,
                 f"{at}.sha256", "must be 64 hex digits")
            total += shard["rows"]
        need(total == described["num_embeddings"], where,
             f"its shards hold {total} rows, the table has {described['num_embeddings']}")


@dataclass
class _Staged:
    """One table's rows of a version, checked and held in a spare tier until the version commits."""

    module: _ShardedBase
    tier: Tier
    steps: int


_short = short


def _shard_header(path: Path, expected: dict, table: ShardedTable, members: int, epoch: int):
    """The inspected header of shard ``path`` (sandboxed helper), checked against the store manifest
    and ``table``; the identity of the file inspected."""
    header, identity = inspect_shard(path, expected["sha256"])  # refuses FIFOs and links before libhdf5 sees them
    rows, problems = expected["rows"], []
    attrs = header.attrs
    if attrs.get("framework") != FRAMEWORK or attrs.get("epoch") != epoch or attrs.get("world_size") != members:
        problems.append(f"root attributes framework={_short(attrs.get('framework'))} "
                        f"epoch={_short(attrs.get('epoch'))} world_size={_short(attrs.get('world_size'))}, "
                        f"expected {FRAMEWORK!r}, {epoch}, {members}")
    owner = header.groups.get("/extra")
    if owner != {"table": table.name, "member": expected["member"], "members": members}:
        problems.append(f"/extra says {_short(owner)}, expected table {table.name!r}, member "
                        f"{expected['member']} of {members}")
    wanted = {_IDS: ("int64", np.dtype(np.int64).str, (rows,)),
              _RECORDS: ("float32", np.dtype(np.float32).str, (rows, table.width))}
    found = {e.path: e for e in header.entries}
    if set(found) != set(wanted):
        problems.append(f"datasets {_short(sorted(found))}, expected {sorted(wanted)}")
    for p, (dtype, storage, shape) in wanted.items():
        e = found.get(p)
        if e is not None and (e.dtype, e.storage, tuple(e.shape)) != (dtype, storage, shape):
            problems.append(f"dataset {p} is {e.dtype} ({e.storage}) {_short(tuple(e.shape))}, "
                            f"expected {dtype} {shape} "
                            f"({rows} rows in the store manifest, {table.width} values per record for this "
                            f"table's optimizer)")
        elif e is not None and e.nbytes and (header.offsets or {}).get(p) is None:
            problems.append(f"dataset {p} is not stored contiguously (store shards are never compressed)")
    state = from_json(header.groups.get("/optimizer"))
    if not (isinstance(state, dict) and state.get("name") == table.optimizer.name and is_int(state.get("steps"))
            and state["steps"] >= 0):
        problems.append(f"optimizer state {_short(state)} is not {table.optimizer.name!r} with a "
                        "non-negative integer 'steps'")
    if problems:
        raise CheckpointError("shard does not fit its store manifest and table", path, problems)
    return header, state["steps"], identity


def _read_rows(path: Path, rows: int, header, identity: tuple, table: ShardedTable, tier: Tier,
               seen: torch.Tensor, own: bool) -> None:
    """Read the ``rows`` rows of shard ``path`` (hashed against its manifest) and keep those
    ``table``'s member owns in ``tier``; ``seen`` marks the slots filled.  ``own``: the shard is
    this member's own (same partition), so every row in it must be one it owns."""
    offsets = header.offsets or {}
    digest = {p: hashlib.sha256() for p in (_IDS, _RECORDS)}
    expected = {e.path: e.sha256 for e in header.entries}
    width = table.width
    chunk = max(1, CHUNK_BYTES // (width * 4))
    hasher = ThreadPoolExecutor(1, thread_name_prefix="hvps-store-sha")  # in order, beside the reads
    fd = open_regular(path, follow_links=False)
    try:
        if (os.fstat(fd).st_dev, os.fstat(fd).st_ino) != identity:
            raise CheckpointError("was replaced while it was being loaded", path)
        for start in range(0, rows, chunk):
            n = min(rows, start + chunk) - start
            ids = np.empty(n, np.int64)
            records = np.empty((n, width), np.float32)
            pread_all(fd, ids, offsets[_IDS] + start * 8, path, _IDS)
            pread_all(fd, records, offsets[_RECORDS] + start * width * 4, path, _RECORDS)
            hasher.submit(digest[_IDS].update, ids)
            hasher.submit(digest[_RECORDS].update, records)
            if n and (int(ids.min()) < 0 or int(ids.max()) >= table.num_embeddings):
                raise CheckpointError(f"holds ids outside 0..{table.num_embeddings - 1}", path)
            chunk_ids = torch.from_numpy(ids)
            mine = table.partition.owner(chunk_ids) == table.member
            if own and not bool(mine.all()):
                raise CheckpointError(f"holds rows that member {table.member} does not own", path)
            if not bool(mine.any()):
                continue
            slots = table.partition.slot(chunk_ids[mine])
            if bool(seen[slots].any()) or torch.unique(slots).numel() != slots.numel():
                raise CheckpointError("lists a row twice (here or in another shard)", path)
            seen[slots] = True
            tier.write(slots, torch.from_numpy(records)[mine])
    finally:
        os.close(fd)
        hasher.shutdown(wait=True)
    bad = [p for p, h in digest.items() if h.hexdigest() != expected[p]]
    if bad:
        raise CheckpointError(f"checksum mismatch of {', '.join(bad)} (the data was damaged or edited)", path)


def stage_table(folder: Path, table: ShardedTable, saved: dict, epoch: int) -> tuple:
    """``(spare tier, optimizer steps)``: ``table``'s rows of the version in ``folder`` (``saved``
    is its entry in the checked store manifest), every byte checked; CheckpointError otherwise."""
    described = saved["table"]
    if (described["embedding_dim"], described["num_embeddings"]) != (table.dim, table.num_embeddings):
        raise CheckpointError(f"table {table.name!r}: saved as {described['num_embeddings']} x "
                              f"{described['embedding_dim']}, the module is {table.num_embeddings} x {table.dim}",
                              folder)
    if described["optimizer"] != table.optimizer.name:
        raise CheckpointError(f"table {table.name!r}: saved with optimizer {described['optimizer'][:40]!r}, "
                              f"the module uses {table.optimizer.name!r}", folder)
    members = saved["members"]
    # Saved by as many members with the same partition: this member's rows are all in its own
    # shard, the only one it reads.  Otherwise it reads every shard and keeps its rows.
    own = members == table.partition.parts and described.get("partition") == table.partition.describe()
    tier = table.spare_tier()
    seen = torch.zeros(tier.rows, dtype=torch.bool)
    steps = set()
    try:
        for shard in [saved["shards"][table.member]] if own else saved["shards"]:
            path = folder / shard["file"]
            header, shard_steps, identity = _shard_header(path, shard, table, members, epoch)
            steps.add(shard_steps)
            _read_rows(path, shard["rows"], header, identity, table, tier, seen, own)
        if len(steps) > 1:
            raise CheckpointError(f"table {table.name!r}: its shards disagree on the optimizer's step count "
                                  f"({sorted(steps)[:4]})", folder)
        missing = int((~seen).sum())
        if missing:
            raise CheckpointError(f"table {table.name!r}: {missing} rows of member {table.member} are in no shard",
                                  folder)
    except BaseException:
        discard_tier(tier)
        raise
    return tier, steps.pop() if steps else 0


_problem, _agree = describe_problem, agree


def _check_dense(manager: Any, epoch: int) -> tuple:
    """On rank 0: (problems, the store manifest digest that dense version ``epoch`` committed)."""
    try:
        header = manager.verify(epoch)
    except Exception as exc:  # noqa: BLE001 - rank 0 alone: reported to every rank, not raised here
        return [f"dense checkpoint: {_problem(exc)}"], None
    committed = header.groups.get("/extra", {}).get(EXTRA_KEY)
    if not isinstance(committed, str):
        return [f"dense checkpoint {header.path} records no store manifest"], None
    return [], committed


def load_stores(manager: Any, stores: Any, version: Union[str, int] = "latest", **dense: Any) -> int:
    """Load the newest complete version into ``stores`` and ``manager`` (collective).

    A table changes only when a whole version has been checked.

    Args:
        manager: the ``CheckpointManager`` the stores were saved with.
        stores: as :func:`save_stores`, at any number of ranks (the rows are re-sharded).
        version: ``"latest"`` skips (with a warning on every rank) each version with a defect; an epoch
            number raises CheckpointError on every rank instead.
        **dense: passed to ``manager.load`` (e.g. ``model=``, ``optimizer=`` for the torch adapter's manager).

    Returns:
        The epoch to resume from (0 when no complete version exists).

    Raises:
        ValueError: ``version`` is neither ``"latest"`` nor an epoch number.
        CheckpointError: the epoch given is missing or defective (on every rank).
    """
    modules = _modules(stores)
    latest = version == "latest"
    if not latest and not is_int(version):
        raise ValueError(f"version must be 'latest' or an epoch number, got {version!r}")
    prestart()  # the inspection helper starts while the collectives below run
    for m in modules:
        m.synchronize()
    epochs = api.broadcast_object([v.epoch for v in reversed(manager.list())] if latest else [int(version)], 0,
                                  name="store.ckpt.load.versions")
    for epoch in epochs:
        folder = store_dir(manager.directory, epoch)
        # 1. the store manifest (every rank) and the dense file that commits it (rank 0)
        problems, digest, committed = [], None, None
        try:
            blob, manifest = read_store_manifest(folder, epoch)
            digest = hashlib.sha256(blob).hexdigest()
            problems += [f"table {m.name!r} is not in the store manifest" for m in modules
                         if m.name not in manifest["tables"]]
        except Exception as exc:  # noqa: BLE001 - every rank learns every rank's problems below
            problems.append(_problem(exc))
        if api.rank() == 0:
            dense_problems, committed = _check_dense(manager, epoch)
            problems += dense_problems
        gathered = api.allgather_object((problems, digest, committed), name=f"store.ckpt.load.{epoch}.manifest")
        committed = gathered[0][2]
        everyone = []
        for rank, (rank_problems, rank_digest, _) in enumerate(gathered):
            everyone.extend(p for p in rank_problems if p not in everyone)
            if committed is not None and rank_digest is not None and rank_digest != committed:
                everyone.append(f"rank {rank}: {folder / MANIFEST}: not the store manifest the dense checkpoint "
                                "committed (SHA-256 differs)")
        # 2. every table's rows, into spare tiers
        staged: list = []
        if not everyone:
            try:
                for m in modules:
                    tier, steps = stage_table(folder, m.table, manifest["tables"][m.name], epoch)
                    staged.append(_Staged(m, tier, steps))
            except Exception as exc:  # noqa: BLE001 - as above: a problem of this version on every rank
                problems = [_problem(exc)]
            else:
                problems = []
            everyone = _agree(problems, f"store.ckpt.load.{epoch}.shards")
        if everyone:
            for s in staged:
                discard_tier(s.tier)
            if not latest:
                raise CheckpointError(f"store checkpoint epoch {epoch} cannot be loaded", folder, everyone)
            warn(f"skipping checkpoint epoch {epoch}: {'; '.join(everyone)}", RuntimeWarning)
            continue
        # 3. the dense state (verified again as it is read), then the tables
        try:
            start = manager.load(epoch, **dense)
            if manager.loaded.extra.get(EXTRA_KEY) != committed:
                raise CheckpointError(f"dense checkpoint epoch {epoch} changed while it was loaded "
                                      "(it no longer commits the store manifest that was checked)", folder)
        except BaseException:
            for s in staged:
                discard_tier(s.tier)
            raise
        for s in staged:
            s.module.table.install(s.tier)
            s.module.table.optimizer.load_state_dict({"steps": s.steps})
        api.barrier()
        return start
    return 0
