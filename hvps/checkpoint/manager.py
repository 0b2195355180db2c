"""Versioned HDF5 checkpoints, one file per epoch, safe on NFS.

::

    ckpt = hvps.checkpoint.CheckpointManager("/nfs/run1", keep_last=3, keep_every=10)
    start = ckpt.load()                       # 0 if there is none; else saved epoch + 1
    state = ckpt.loaded                       # the Checkpoint read (None when start == 0)
    for epoch in range(start, epochs):
        ...
        ckpt.save(epoch, model={"w": w}, optimizer={"lr": 0.1, "state": {...}})

**Framework-neutral**: sections are nested mappings of numpy arrays (stored as datasets)
and JSON-able values (stored as attributes).  ``hvps.adapters.torch.CheckpointManager``
accepts torch modules and optimizers and restores them in place.

**Collective when hvps is initialized**: every rank calls ``save`` and ``load`` with the
same arguments.  Only ``root_rank`` (0) touches the directory: on save it gathers the
per-rank sections (``compression_state``, ``rng``) and writes; on load it reads and
verifies, broadcasts the shared sections (one flat uint8 buffer, sent in pieces of
``chunk_bytes`` as soon as each is read, while it is still being hashed) and sends each rank its
own per-rank sections.  Without ``hvps.init()`` everything runs in one process.

**Crash safety**: rank 0 writes ``.ckpt-epoch-000007.h5.tmp-<pid>-<hex>`` in the
directory, fsyncs it, renames it to ``ckpt-epoch-000007.h5`` (atomic on POSIX and on NFS,
which guarantees close-to-open consistency; no locks are used) and fsyncs the directory.
A crash leaves either the old set of versions or the new one, plus possibly a temporary
file that the next save removes.  Only then does retention drop old versions: each is
renamed to a hidden ``.trash-...`` name at once (``list()`` no longer sees it) and
unlinked in a background thread (freeing a large file's blocks takes a while); the next
save, or the end of the process, waits for that thread, and leftovers of a crash are
removed by the next save.

**Verification**: every dataset's SHA-256 is in a manifest whose own SHA-256 is a root
attribute: a checksum against damage, and with ``HVPS_CHECKPOINT_KEY`` an HMAC signature
against tampering (``checkpoint/safety.py``, which also refuses storage, dtypes and manifests
that are unsafe to read); :meth:`CheckpointManager.latest` and ``load("latest")`` skip (with
a warning on every rank) versions that fail and fall back to the newest good one.

``list``, ``latest``, ``verify``, ``rollback`` and ``undo_rollback`` are local file
operations of :class:`~hvps.checkpoint.versions.CheckpointVersions` (the ``hvps ckpt``
command line uses it); the manager's methods of those names delegate to it: call them on
one process.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import numpy as np

from .. import api
from ..core.atomic_files import atomic_publish, remove_temporaries
from ..core.user_warnings import warn
from .. import metrics as _metrics
from .format import (
    CheckpointError,
    DatasetEntry,
    Header,
    IncompatibleCheckpointError,
    Reader,
    aligned_empty,
    build_trees,
    chunk_bounds,
    flatten_tree,
    is_per_rank_compression,
    padded,
    place_in_buffer,
    root_attributes,
    write_file,
)
from .inspect import prestart, read_header
from .shards import agree, describe_problem
from .versions import FILE_RE, CheckpointVersions, Version, file_name

TRASH_RE = re.compile(r"^\.trash-ckpt-epoch-\d{6,}\.h5-")  # versions retention dropped, not yet unlinked
PER_RANK = ("compression", "rng")  # sections saved once per rank


def _rank_key(rank: int) -> str:
    return f"rank_{rank:05d}"


@dataclass
class Checkpoint:
    """A loaded checkpoint, as this rank sees it.

    ``epoch`` is the epoch that was saved (the one that had finished); training resumes at
    ``next_epoch == epoch + 1``.  ``compression_state`` and ``rng`` are this rank's own;
    ``rng`` is None when the checkpoint holds none for this rank.
    """

    path: Path
    epoch: int
    step: Optional[int]
    world_size: int
    attrs: dict
    model: dict = field(default_factory=dict)
    optimizer: dict = field(default_factory=dict)
    compression_state: dict = field(default_factory=dict)
    rng: Optional[dict] = None
    extra: dict = field(default_factory=dict)

    @property
    def next_epoch(self) -> int:
        return self.epoch + 1


class _Group:
    """The collectives a manager needs, or their one-process stand-ins."""

    def __init__(self, root_rank: int) -> None:
        self.distributed = api.is_initialized() and api.size() > 1
        self.rank = api.rank() if api.is_initialized() else 0
        self.size = api.size() if api.is_initialized() else 1
        self.root = root_rank if self.distributed else 0
        if not 0 <= self.root < self.size:
            raise ValueError(f"root_rank {root_rank} is out of range for {self.size} ranks")
        self.is_root = self.rank == self.root

    def bcast_obj(self, obj: Any, name: str) -> Any:
        return api.broadcast_object(obj, self.root, name=name) if self.distributed else obj

    def bcast_buf_async(self, buf: np.ndarray, name: str):
        if not self.distributed or buf.size == 0:
            return None
        return api.broadcast_async(buf, self.root, name=name, out=buf)

    def gather_bufs(self, buf: np.ndarray, name: str) -> list:
        """Every rank's uint8 ``buf`` on the root (a list in rank order), [] elsewhere."""
        if not self.distributed:
            return [buf]
        splits = [0] * self.size
        splits[self.root] = buf.size
        out, received = api.alltoall(buf, splits=splits, name=name)
        if not self.is_root:
            return []
        bounds = np.concatenate(([0], np.cumsum(received)))
        return [out[bounds[r]:bounds[r + 1]] for r in range(self.size)]

    def scatter_bufs(self, bufs: Optional[list], name: str) -> np.ndarray:
        """Rank r receives ``bufs[r]`` from the root."""
        if not self.distributed:
            return bufs[0]
        if self.is_root:
            send = np.concatenate(bufs) if bufs else np.empty(0, np.uint8)
            splits = [b.size for b in bufs]
        else:
            send, splits = np.empty(0, np.uint8), [0] * self.size
        out, _ = api.alltoall(send, splits=splits, name=name)
        return out


# ----------------------------------------------------------------------------- pack/unpack
def _pack(tree: Optional[Mapping]) -> tuple:
    """(spec, uint8 buffer) for a nested mapping of arrays and JSON-able values; the spec
    holds no arrays, so it travels as a small object."""
    if tree is None:
        return None, np.empty(0, np.uint8)
    leaves, groups = [], {}
    flatten_tree(tree, "", "", leaves, groups)
    entries = [DatasetEntry(leaf.path, leaf.dtype, leaf.array.dtype.str, tuple(leaf.array.shape), int(leaf.array.nbytes), "")
               for leaf in leaves]
    total = place_in_buffer(entries)
    buf = aligned_empty(total)
    for e, leaf in zip(entries, leaves):
        buf[e.start:e.start + e.nbytes] = memoryview(leaf.array).cast("B")
    return {"entries": entries, "groups": groups}, buf


def _unpack(spec: Optional[dict], buf: np.ndarray) -> Optional[dict]:
    if spec is None:
        return None
    header = Header(Path(""), {}, spec["entries"], spec["groups"])
    return build_trees(header, buf)


def _relayout(entries: list, keep) -> list:
    """Copies of the entries that ``keep`` accepts, laid out from 0 in a new buffer."""
    out, pos = [], 0
    for e in entries:
        if keep(e.path):
            out.append(DatasetEntry(e.path, e.dtype, e.storage, e.shape, e.nbytes, e.sha256, pos))
            pos += padded(e.nbytes)
    return out


class CheckpointManager:
    """Saves and loads versioned checkpoints in ``directory`` (see the module docstring).

    Args:
        directory: where the versions live (created by the first save); every rank that writes shards
            must see it.
        keep_last: how many of the newest versions retention keeps (None: all).
        keep_every: also keep every version whose epoch is a multiple of it (e.g. 10: epochs 0, 10, 20,
            ...). Other versions are deleted after each successful save.
        compress: lzf-compressed chunked datasets (smaller, slower); default off.
        root_rank: the rank that writes and reads the dense file.
        fsync: fsync files and the directory (turn off only for tests on tmpfs).

    Raises:
        ValueError: ``keep_last`` or ``keep_every`` is below 1.
    """

    framework = "numpy"
    chunk_bytes = 16 << 20  # pieces in which load() broadcasts the shared sections

    def __init__(self, directory: Union[str, os.PathLike], keep_last: Optional[int] = 3,
                 keep_every: Optional[int] = None, compress: bool = False, root_rank: int = 0,
                 fsync: bool = True) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be >= 1 (or None to keep every version)")
        if keep_every is not None and keep_every < 1:
            raise ValueError("keep_every must be >= 1 (or None)")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.compress = compress
        self.root_rank = root_rank
        self.fsync = fsync
        self.loaded: Optional[Checkpoint] = None
        self._deleter: Optional[threading.Thread] = None
        try:
            root = _Group(root_rank).is_root
        except ValueError:  # raised again by save and load
            root = False
        if root:  # the root will inspect files: its helper starts meanwhile
            prestart()

    # ------------------------------------------------------------------ framework hooks
    def framework_version(self) -> str:
        """The version of the framework whose state is saved, recorded in each checkpoint.

        Returns:
            numpy's version here; each framework's manager gives its own.
        """
        return np.__version__

    # ------------------------------------------------------------------ save
    @_metrics.timed_checkpoint("save")
    def save(self, epoch: int, model: Optional[Mapping] = None, optimizer: Optional[Mapping] = None,
             extra: Optional[Mapping] = None, compression_state: Optional[Mapping] = None,
             step: Optional[int] = None, rng: Optional[Mapping] = None) -> Optional[Path]:
        """Save ``epoch`` (a finished epoch) as a new version; collective when initialized.

        ``model``, ``optimizer`` and ``extra`` are taken from the root rank (they are the
        same on every rank in data-parallel training); ``compression_state`` and ``rng``
        are gathered from every rank.

        Args:
            epoch: the epoch just finished (>= 0).
            model: the model's state, a mapping name -> array (the root's).
            optimizer: the optimizer's state, a nested mapping (the root's).
            extra: more values to keep (the root's).
            compression_state: this rank's compression state, a mapping (every rank's is kept).
            step: the global step, kept beside the epoch.
            rng: this rank's RNG states, a mapping (every rank's is kept).

        Returns:
            The file's path on the root, None elsewhere.

        Raises:
            ValueError: ``epoch`` is negative.
            CheckpointError: on every rank, if the root could not write (previous versions stay intact), or
                the ranks disagree on whether compression or RNG state is given.
        """
        if int(epoch) < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        group = _Group(self.root_rank)
        per_rank = {}
        for section, tree in (("compression", compression_state), ("rng", rng)):
            flag = group.bcast_obj(tree is not None, f"ckpt.save.{section}.present") if group.distributed else tree is not None
            if (tree is not None) != flag:
                raise CheckpointError(f"save: {section} state given on the root but not on this rank (or vice versa)")
            if not flag:
                continue
            spec, buf = _pack(tree)
            specs = self._allgather_specs(group, spec, section)
            bufs = group.gather_bufs(buf, f"ckpt.save.{section}.data")
            if group.is_root:
                per_rank[section] = {_rank_key(r): _unpack(specs[r], bufs[r]) for r in range(group.size)}
        result: Any = None
        if group.is_root:
            try:
                result = str(self._write(epoch, step, group.size, model, optimizer, extra, per_rank))
            except CheckpointError as exc:
                result = exc
            except (OSError, RuntimeError, ValueError, TypeError) as exc:
                result = CheckpointError(f"saving epoch {epoch} failed: {exc}", self.directory / file_name(epoch))
                result.__cause__ = exc
            shared = result if isinstance(result, str) else f"ERROR {result}"
        else:
            shared = None
        shared = group.bcast_obj(shared, "ckpt.save.result")
        if isinstance(result, Exception):
            raise result
        if shared.startswith("ERROR "):
            raise CheckpointError(f"the root rank could not save epoch {epoch}: {shared[6:]}")
        return Path(shared) if group.is_root else None

    def _allgather_specs(self, group: _Group, spec: Any, section: str) -> list:
        if not group.distributed:
            return [spec]
        return api.allgather_object(spec, name=f"ckpt.save.{section}.spec")

    def _write(self, epoch, step, world_size, model, optimizer, extra, per_rank) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temporaries()
        final = self.directory / file_name(epoch)
        sections = {"model": model, "optimizer": optimizer, "extra": extra, **per_rank}
        attrs = root_attributes(epoch, step, world_size, self.framework, self.framework_version())
        with atomic_publish(final, fsync=self.fsync) as tmp:
            write_file(tmp, sections, attrs, compress=self.compress, fsync=self.fsync)
        self._apply_retention()
        return final

    def wait_for_retention(self) -> None:
        """Wait until the versions dropped by the last save are unlinked."""
        if self._deleter is not None:
            self._deleter.join()
            self._deleter = None

    def _remove_stale_temporaries(self) -> None:
        """Temporary and trash files of writers that died (one job owns a directory)."""
        self.wait_for_retention()
        remove_temporaries(self.directory, publishes=FILE_RE.match)
        for p in self.directory.iterdir():
            if TRASH_RE.match(p.name):
                try:
                    p.unlink()
                except OSError:
                    pass

    def retained(self, epochs: list) -> set:
        """The epochs that retention keeps out of ``epochs``."""
        ordered = sorted(set(epochs))
        keep = set(ordered if self.keep_last is None else ordered[-self.keep_last:])
        if self.keep_every:
            keep |= {e for e in ordered if e % self.keep_every == 0}
        return keep

    def _apply_retention(self) -> None:
        """Drop the versions retention does not keep: a rename now (cheap, and they are
        gone from ``list()``), the unlink in a background thread.  No directory fsync: a
        dropped version that reappears after a crash is dropped again by the next save."""
        self.wait_for_retention()
        versions = self.list()
        keep = self.retained([v.epoch for v in versions])
        trash = []
        for v in versions:
            if v.epoch not in keep:
                doomed = v.path.with_name(f".trash-{v.path.name}-{secrets.token_hex(4)}")
                try:
                    os.replace(v.path, doomed)
                except FileNotFoundError:
                    continue
                trash.append(doomed)
        if trash:
            self._deleter = threading.Thread(target=_unlink_all, args=(trash,), name="hvps-ckpt-retention")
            self._deleter.start()

    # ------------------------------------------------------------------ versions (one process)
    @property
    def versions(self) -> CheckpointVersions:
        """The local version operations on this manager's directory (call them on one process)."""
        return CheckpointVersions(self.directory, fsync=self.fsync)

    def list(self) -> list:
        """Every version in the directory, oldest first (:meth:`CheckpointVersions.list`)."""
        return self.versions.list()

    def path_of(self, version: Union[str, int, os.PathLike]) -> Path:
        """The path of a version (:meth:`CheckpointVersions.path_of`)."""
        return self.versions.path_of(version)

    def verify(self, version: Union[int, str, os.PathLike]) -> Header:
        """Fully verify one version (:meth:`CheckpointVersions.verify`)."""
        return self.versions.verify(version)

    def latest(self) -> Optional[Version]:
        """The newest version that verifies (:meth:`CheckpointVersions.latest`)."""
        return self.versions.latest()

    # ------------------------------------------------------------------ loading
    @_metrics.timed_checkpoint("load")
    def read(self, version: Union[str, int] = "latest", drop_compression_state: bool = False) -> Optional[Checkpoint]:
        """Read one version on the root, verify it and hand every rank its view; collective.

        Args:
            version: ``"latest"`` (the newest version that verifies) or an epoch number.
            drop_compression_state: leave out per-rank compression state saved by another number of ranks.

        Returns:
            The version's :class:`Checkpoint`; None when ``"latest"`` finds none.

        Raises:
            ValueError: ``version`` is neither ``"latest"`` nor an epoch number.
            CheckpointError: an epoch given is missing or broken, or per-rank compression state was saved by
                another number of ranks (without ``drop_compression_state``).
        """
        group = _Group(self.root_rank)
        latest = version == "latest"
        if not latest and not isinstance(version, (int, np.integer)):
            raise ValueError(f"version must be 'latest' or an epoch number, got {version!r}")
        candidates = []
        if group.is_root:
            candidates = [v.path for v in reversed(self.list())] if latest else [self.path_of(int(version))]
        for attempt in itertools.count():
            path = candidates[attempt] if group.is_root and attempt < len(candidates) else None
            header = reader = None
            status: Any = "none"
            if group.is_root and path is not None:
                try:
                    reader = Reader(path, read_header(path))
                    header = reader.header
                    self._check_world_size(header, group.size, drop_compression_state)
                    status = "ok"
                except CheckpointError as exc:
                    status = exc
            msg = None
            if group.is_root:
                if isinstance(status, CheckpointError):
                    incompatible = isinstance(status, IncompatibleCheckpointError)
                    msg = ("error" if not latest or incompatible else "skip", str(status), incompatible)
                elif status == "none":
                    msg = ("none", None, False)
                else:
                    msg = ("ok", {"attrs": header.attrs, "entries": header.entries, "groups": header.groups,
                                  "path": str(path)}, False)
            kind, payload, incompatible = group.bcast_obj(msg, f"ckpt.load.meta.{attempt}")
            if kind == "none":
                if not latest:
                    raise CheckpointError(f"no checkpoint for epoch {version}", self.path_of(int(version)))
                return None
            if kind == "error":  # the root's own exception; the others the same class and text
                raise status if group.is_root else (IncompatibleCheckpointError if incompatible
                                                    else CheckpointError)(payload)
            if kind == "skip":  # every rank says why it falls back
                warn(f"skipping checkpoint: {payload}", RuntimeWarning)
                continue
            ok, checkpoint = self._transfer(group, payload, reader, attempt, drop_compression_state)
            if ok is True:
                return checkpoint
            if latest:
                warn(f"skipping checkpoint: {ok}", RuntimeWarning)
            if not latest:
                raise ok if isinstance(ok, CheckpointError) else CheckpointError(str(ok))

    @staticmethod
    def _check_world_size(header: Header, size: int, drop: bool) -> None:
        saved = int(header.attrs.get("world_size", 1))
        has_comp = any(e.path.startswith("/compression/") for e in header.entries)
        if has_comp and saved != size and not drop:
            raise IncompatibleCheckpointError(
                f"compression state was saved per rank by {saved} ranks but this job has {size}; "
                "error-feedback residuals cannot be redistributed: pass drop_compression_state=True "
                "to start them from zero", header.path)

    def _transfer(self, group: _Group, meta: dict, reader: Optional[Reader], attempt: int, drop: bool):
        """Move the data of one version from the root to every rank: (True, Checkpoint), or
        (error, None) when the root could not read or verify it."""
        entries, groups, attrs = meta["entries"], meta["groups"], meta["attrs"]
        shared = _relayout(entries, lambda p: not is_per_rank_compression(p))
        shared_bytes = sum(padded(e.nbytes) for e in shared)
        has_comp = len(shared) != len(entries) and not drop
        saved_size = int(attrs.get("world_size", 1))
        mine = f"/compression/{_rank_key(group.rank)}/"
        own = _relayout(entries, lambda p: p.startswith(mine)) if has_comp else []
        status = full = None
        # The shared part travels in pieces: each piece's broadcast starts as soon as the
        # root has read it, so reading, hashing and sending overlap.
        bounds = chunk_bounds(shared, self.chunk_bytes) if group.distributed else []
        handles: list = []

        def send(k: int) -> None:
            lo = bounds[k - 1] if k else 0
            handles.append(group.bcast_buf_async(shared_buf[lo:bounds[k]], f"ckpt.load.data.{attempt}.{k}"))

        if group.is_root:
            # laid out as: shared sections, then rank 0's, rank 1's, ... compression state
            full = aligned_empty(reader.header.total_bytes)
            shared_buf = full[:shared_bytes]
            try:
                reader.read(full, bounds=bounds, ready=send)
            except CheckpointError as exc:
                status = exc
            while len(handles) < len(bounds):  # the others wait for every piece
                send(len(handles))
        else:
            shared_buf = aligned_empty(shared_bytes)
            for k in range(len(bounds)):
                send(k)
        # A read error is reported with the verdict below (one round trip fewer); until
        # then every rank goes through the same collectives, the root with garbage bytes.
        own_buf = None
        if group.is_root:
            index = {e.path: e for e in reader.header.entries}
            parts = []
            for r in range(group.size if has_comp else 0):
                part = [index[e.path] for e in entries if e.path.startswith(f"/compression/{_rank_key(r)}/")]
                lo = part[0].start if part else 0
                parts.append(full[lo:lo + sum(padded(e.nbytes) for e in part)])
            if has_comp:
                own_buf = parts[group.rank]
        else:
            parts = None
        if has_comp and group.distributed:
            got = group.scatter_bufs(parts, f"ckpt.load.comp.{attempt}")
            if not group.is_root:
                own_buf = aligned_empty(got.size)
                own_buf[...] = got
        verdict = status
        if group.is_root and verdict is None:
            try:
                reader.verify()  # the hashes ran while the bytes were read and sent
            except CheckpointError as exc:
                verdict = exc
        for h in handles:
            if h is not None:
                h.wait()
        text = group.bcast_obj(None if verdict is None else str(verdict), f"ckpt.load.verdict.{attempt}")
        if text is not None:
            return (verdict if group.is_root else CheckpointError(text)), None
        path = Path(meta["path"])
        trees = build_trees(Header(path, attrs, shared, groups), shared_buf,
                            only=lambda p: not is_per_rank_compression(p))
        compression = {}
        if own:
            tree = build_trees(Header(path, attrs, own, groups), own_buf,
                               only=lambda p: p.startswith(mine) or p == mine.rstrip("/"))
            compression = tree.get("compression", {}).get(_rank_key(group.rank), {})
        rng = trees.get("rng", {}).get(_rank_key(group.rank))
        if "rng" in trees and rng is None:
            warn(f"{path}: no RNG state for rank {group.rank} (saved by {saved_size} ranks); "
                 "this rank keeps its current RNG state", RuntimeWarning)
        step = int(attrs.get("step", -1))
        return True, Checkpoint(
            path=path, epoch=int(attrs["epoch"]), step=None if step < 0 else step, world_size=saved_size,
            attrs=dict(attrs), model=trees.get("model", {}), optimizer=trees.get("optimizer", {}),
            compression_state=compression, rng=rng, extra=trees.get("extra", {}))

    def load(self, version: Union[str, int] = "latest", drop_compression_state: bool = False) -> int:
        """Read a version (see :meth:`read`) into ``self.loaded``; collective.

        Args:
            version: as :meth:`read`.
            drop_compression_state: as :meth:`read`.

        Returns:
            The epoch to resume from: the saved epoch + 1, or 0 when ``version="latest"`` finds nothing.

        Raises:
            CheckpointError: as :meth:`read`.
        """
        self.loaded = self.read(version, drop_compression_state=drop_compression_state)
        return 0 if self.loaded is None else self.loaded.next_epoch

    def stage_shards(self, version: Union[str, int], start: int, reader: Callable[[Checkpoint], Optional[tuple]],
                      drop: bool) -> tuple:
        """When the loaded version keeps state in per-rank shards (a sharded optimizer's, a fully sharded model's):
        read (and verify) what the caller needs of them, falling back to older versions (``version="latest"``)
        while shards are bad; collective. The framework adapters' ``load`` calls it after :meth:`load`.

        Args:
            version: as given to :meth:`load`.
            start: what :meth:`load` returned.
            reader: for a loaded version, ``(check the fit, stage, what a misfit is)``, or None when nothing is
                to be read from its shards: ``check_fit()`` returns the problems of loading the manifest into
                the caller's objects (raising CheckpointError for a malformed manifest, a defect of the
                version), ``stage()`` reads and verifies the shards (nothing is changed) and returns what it read.
            drop: ``drop_compression_state``, for the older versions.

        Returns:
            ``(epoch to resume from, staged)``; ``self.loaded`` is the version staged, ``staged`` what its
            ``stage()`` returned (None for a version without shards to read).

        Raises:
            CheckpointError: on every rank, for an explicit ``version`` whose shards are bad, or when the
                manifest does not fit (another model or optimizer class).
        """
        while self.loaded is not None:
            ck = self.loaded
            found = reader(ck)
            if found is None:
                return start, None
            check_fit, stage, misfit = found
            problems, staged = [], None
            try:
                fit = check_fit()
            except CheckpointError as exc:  # a malformed manifest: a defect of this version
                fit, problems = [], [describe_problem(exc)]
            if fit:
                raise CheckpointError(misfit, ck.path, fit)
            if not problems:
                try:
                    staged = stage()
                except Exception as exc:  # noqa: BLE001 - every rank learns every rank's problems below
                    problems = [describe_problem(exc)]
            everyone = agree(problems, f"ckpt.load.shards.{ck.epoch}")
            if not everyone:
                return start, staged
            if version != "latest":
                raise CheckpointError(f"the sharded state of epoch {ck.epoch} cannot be loaded", ck.path, everyone)
            warn(f"skipping checkpoint epoch {ck.epoch}: {'; '.join(everyone)}", RuntimeWarning)
            start = self._load_older(ck.epoch, drop)
        return start, None

    def _load_older(self, epoch: int, drop: bool) -> int:
        """Load the newest version older than ``epoch`` that reads (skipping, with a warning, those that do
        not), as ``load("latest")`` does; 0 and ``self.loaded = None`` when there is none."""
        group = _Group(self.root_rank)
        older = group.bcast_obj([v.epoch for v in reversed(self.list()) if v.epoch < epoch] if group.is_root
                                else None, f"ckpt.load.older.{epoch}")
        self.loaded = None
        for candidate in older:
            try:
                return CheckpointManager.load(self, candidate, drop_compression_state=drop)
            except IncompatibleCheckpointError:
                raise
            except CheckpointError as exc:  # raised on every rank alike
                warn(f"skipping checkpoint: {exc}", RuntimeWarning)
        return 0

    # ------------------------------------------------------------------ rollback (one process)
    @property
    def attic(self) -> Path:
        """The attic folder (:attr:`CheckpointVersions.attic`)."""
        return self.versions.attic

    def rollback(self, epoch: int) -> list:
        """Make ``epoch`` the newest version (:meth:`CheckpointVersions.rollback`)."""
        return self.versions.rollback(epoch)

    def rollbacks(self) -> list:
        """The attic's rollback batches, oldest first (:meth:`CheckpointVersions.rollbacks`)."""
        return self.versions.rollbacks()

    def undo_rollback(self, force: bool = False) -> list:
        """Restore the most recent rollback (:meth:`CheckpointVersions.undo_rollback`)."""
        return self.versions.undo_rollback(force=force)


def _unlink_all(paths: list) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass  # the next save removes leftovers


def header_of(path: Union[str, os.PathLike]) -> Header:
    """The header of one file (cheap: no tensor data is read)."""
    return read_header(path)


__all__ = ["CheckpointManager", "Checkpoint", "CheckpointError", "IncompatibleCheckpointError", "Version", "file_name", "header_of"]
