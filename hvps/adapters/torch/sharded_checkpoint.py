"""Checkpoints of a :class:`ShardedOptimizer` as per-rank shards plus a manifest, loadable at any rank count.

Why through the manager's ordinary ``save``/``load``. A user already writes
``ckpt.save(epoch, model=model, optimizer=opt)`` and ``ckpt.load(model=model, optimizer=opt)`` with
``hvd.CheckpointManager``; whether ``opt`` is sharded changes where its state lives, not how the loop
reads, so the same two calls take a sharded optimizer (as ``hvd.DistributedOptimizer(..., shard=True)``
is Horovod's constructor with one more keyword). Funnelling the state through rank 0, as the dense file
does for every other optimizer, would need the whole state in one process: exactly what sharding avoids.

Saving epoch N (collective; every rank of the optimizer's job calls it, on a directory all ranks share):

1. every rank writes its own shard, ``optim-epoch-N/optimizer.<rank>-of-<size>.h5`` (temporary name,
   fsync, rename): a file of the dense checkpoint format whose ``/optimizer/bNNNNN/<key>`` datasets hold
   this rank's block of bucket NNNNN's element-wise state (Adam's moments, SGD's momentum), with an
   ``/extra`` naming the rank, the world size, the model fingerprint and the SHA-256 of every 1 MiB block
   of every dataset (so a reader of part of a dataset checks what it reads). 1/N of the state per rank,
   in memory and on disk;
2. the shards' manifest digests are gathered, and the dense checkpoint of epoch N (rank 0, as always)
   records the **manifest** as its ``/optimizer/sharded`` section: the optimizer class, the world size,
   every parameter's name, shape and dtype, the model fingerprint (SHA-256 of those), the parameter
   groups, the bucket layout (each bucket's group, length, shard length, its parameters' offsets, its
   element-wise keys and dtypes, its scalar state such as Adam's ``step``) and each shard's file and
   digest. The dense file is written last and is the commit record: a version counts only when every
   shard and the manifest are there, and the digest chain (dense file -> manifest -> each shard's
   manifest -> block digests -> bytes) covers everything a load reads.

Loading (``load(model=..., optimizer=...)``, collective) treats everything as untrusted: the manifest's
schema is checked, a shard must be a regular file named as the manifest says, inspected in the sandboxed
helper, be the file the manifest lists, and agree with it (rank, world size, fingerprint, datasets), and
every block read is checked. Into a ``ShardedOptimizer`` at any rank count M each rank reads only the
ranges of the saved shards that its new block of every bucket needs (:mod:`hvps.checkpoint.resharding`);
into a plain torch optimizer (inference, export, or one process without ``hvps.init()``) the state is
consolidated on load. Shards that are missing, damaged, disagree with the manifest or come from another
model make the version fail on every rank: ``load("latest")`` warns and falls back to the previous
version, as it does for a damaged dense file; an explicit epoch raises CheckpointError. A manifest that
does not fit the given optimizer (another model, another optimizer class) raises CheckpointError, as a
dense optimizer state that does not fit does.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from hvps import api
from hvps.checkpoint.format import CheckpointError, root_attributes
from hvps.checkpoint.resharding import param_pieces, shard_bounds, shard_numel
from hvps.checkpoint.safety import is_int, need
from hvps.checkpoint.sharded_buffers import (STATE_KEY, SavedShards, check_flat_buffer, check_manifest_head,
                                             check_params, check_shard_list, checked_manifest, params_fingerprint,
                                             save_rank_shards, scalar_ok, write_rank_shard)
from hvps.checkpoint.sharded_buffers import shard_file_name as _file_name
from hvps.checkpoint.shards import shard_folder, short, tidy_shard_folders
from hvps.core.views import as_array

from .sharded_optimizer import ShardedOptimizer

FORMAT = "hvps-sharded-optimizer"
FORMAT_VERSION = 1
FRAMEWORK = "hvps.sharded_optimizer"  # the shards' root attribute "framework"
PREFIX = "optim"
FOLDER_RE = re.compile(r"^optim-epoch-(\d{6,})$")
STEM = "optimizer"  # the shards' file names
_UNNAMED = re.compile(r"^param\.\d+$")  # ShardedOptimizer's names without named_parameters

__all__ = ["save_optimizer_shards", "is_sharded_manifest", "check_fit", "stage_optimizer", "stage_shard", "relayout",
           "model_fingerprint", "shard_file_name", "tidy", "encode_scalar", "decode_scalar"]


def shard_file_name(rank: int, size: int) -> str:
    """The file name of ``rank``'s shard when ``size`` ranks saved."""
    return _file_name(STEM, rank, size)


def _bucket_key(b: int) -> str:
    return f"b{int(b):05d}"


def _dataset(b: int, key: str) -> str:
    return f"/optimizer/{_bucket_key(b)}/{key}"


def model_fingerprint(params: list) -> str:
    """SHA-256 of the parameters' ``[name, shape, dtype, requires_grad]`` list (layout-independent).

    Args:
        params: ``shard_layout()["params"]``.

    Returns:
        64 hex digits.
    """
    return params_fingerprint(params)


def _element_wise(value: Any, numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == numel


def encode_scalar(key: str, value: Any, where: str) -> dict:
    """``value``, state that is not element-wise (a step count), as the manifests record it.

    Args:
        key: its name, for messages.
        value: a 0-d tensor, None, a bool, an int or a float.
        where: what holds it, for messages.

    Returns:
        ``{"value": v}``, or ``{"tensor": dtype, "value": v}`` for a 0-d tensor.

    Raises:
        CheckpointError: any other value (it cannot be saved as shards).
    """
    if torch.is_tensor(value):
        if value.dim() != 0:
            raise CheckpointError(f"{where}: state {key!r} is a tensor of shape {list(value.shape)}, neither "
                                  "element-wise nor a scalar: it cannot be saved as shards")
        return {"tensor": str(value.dtype).replace("torch.", ""), "value": value.item()}
    if value is None or isinstance(value, (bool, int, float)):
        return {"value": value}
    raise CheckpointError(f"{where}: state {key!r} of type {type(value).__name__} cannot be saved as shards")


def decode_scalar(encoded: dict) -> Any:
    """The inverse of :func:`encode_scalar` (of a manifest that was checked with ``scalar_ok``)."""
    if "tensor" in encoded:
        return torch.tensor(encoded["value"], dtype=getattr(torch, encoded["tensor"]))
    return encoded["value"]


# ----------------------------------------------------------------------------- saving
def _write_own_shard(folder: Path, optimizer: ShardedOptimizer, layout: dict, fingerprint: str, epoch: int,
                     step: Optional[int], fsync: bool) -> str:
    """Write this rank's shard; its manifest digest."""
    rank, size = optimizer.process_set.rank(), layout["world_size"]
    datasets: dict = {}
    for b, entry in optimizer.local_state().items():
        numel = layout["buckets"][b]["shard_numel"]
        for key, value in entry.items():
            if not STATE_KEY.match(key):
                raise CheckpointError(f"optimizer state {short(key)} cannot name a dataset (letters, digits, _)")
            if _element_wise(value, numel):
                array = as_array(value.detach().reshape(-1).cpu().contiguous())
                datasets[_dataset(b, key)] = (array, f"{_bucket_key(b)}.{key}")
    extra = {"rank": rank, "world_size": size, "fingerprint": fingerprint}
    attrs = root_attributes(epoch, step, size, FRAMEWORK, torch.__version__)
    return write_rank_shard(folder / shard_file_name(rank, size), datasets, extra, attrs, fsync)


def _bucket_manifest(layout: dict, state: dict) -> list:
    """The manifest's buckets: the layout plus each bucket's element-wise keys and scalar state."""
    out = []
    for b, bucket in enumerate(layout["buckets"]):
        entry = state.get(b, {})
        keys = {k: str(v.dtype).replace("torch.", "") for k, v in entry.items()
                if _element_wise(v, bucket["shard_numel"])}
        scalars = {k: encode_scalar(k, v, f"bucket {b}") for k, v in entry.items() if k not in keys}
        out.append(dict(bucket, keys=keys, scalars=scalars))
    return out


def save_optimizer_shards(manager: Any, epoch: int, optimizer: ShardedOptimizer, step: Optional[int]) -> dict:
    """Write every rank's shard of ``optimizer`` for version ``epoch`` (collective); the manifest to save as
    the dense checkpoint's ``optimizer`` section.

    Args:
        manager: the torch ``CheckpointManager`` (its ``directory`` and ``fsync``).
        epoch: the version being saved.
        optimizer: the sharded optimizer; its process set must be every rank of the job.
        step: the step recorded in the shards' root attributes.

    Returns:
        ``{"sharded": manifest}``, JSON-able (the same on every rank).

    Raises:
        CheckpointError: on every rank, when a rank could not write its shard (earlier versions stay intact).
    """
    size = optimizer.process_set.size()
    job = api.size() if api.is_initialized() else 1
    if size != job:
        raise CheckpointError(f"a sharded optimizer over {size} of the job's {job} ranks cannot be checkpointed: "
                              "its process set must hold every rank")
    layout = optimizer.shard_layout()
    fingerprint = model_fingerprint(layout["params"])
    folder = shard_folder(manager.directory, PREFIX, epoch)

    def write() -> str:
        folder.mkdir(parents=True, exist_ok=True)
        return _write_own_shard(folder, optimizer, layout, fingerprint, epoch, step, getattr(manager, "fsync", True))

    digests = save_rank_shards(write, optimizer.process_set.rank(), size,
                               f"the sharded optimizer state of epoch {epoch}", folder, f"ckpt.save.optim.{int(epoch)}")
    inner = optimizer.shard_optimizer
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": ids}
              for g, ids in zip(optimizer.param_groups, _group_indices(optimizer.param_groups))]
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "class": type(inner).__name__,
                "world_size": size, "fingerprint": fingerprint, "params": layout["params"], "param_groups": groups,
                "buckets": _bucket_manifest(layout, optimizer.local_state()),
                "shards": [{"file": shard_file_name(r, size), "rank": r, "sha256": d} for r, d in enumerate(digests)]}
    return {"sharded": manifest}


def _group_indices(param_groups: list) -> list:
    out, at = [], 0
    for g in param_groups:
        out.append(list(range(at, at + len(g["params"]))))
        at += len(g["params"])
    return out


def tidy(manager: Any, epoch: int) -> None:
    """After committing ``epoch`` (root only): drop the shard folders of versions retention removed."""
    tidy_shard_folders(manager, epoch, FOLDER_RE)


# ----------------------------------------------------------------------------- the manifest
def is_sharded_manifest(optimizer_section: Any) -> bool:
    """Whether a loaded checkpoint's ``optimizer`` section is a sharded optimizer's manifest."""
    return isinstance(optimizer_section, Mapping) and "sharded" in optimizer_section


def check_manifest(manifest: Any) -> None:
    """Raise Defect unless ``manifest`` has the structure, types, ranges and consistency that
    :func:`save_optimizer_shards` writes."""
    check_manifest_head(manifest, {"format", "format_version", "class", "world_size", "fingerprint", "params",
                                   "param_groups", "buckets", "shards"}, FORMAT, FORMAT_VERSION)
    need(isinstance(manifest["class"], str), "class", "must be a string")
    size, params = manifest["world_size"], manifest["params"]
    check_params(params, manifest["fingerprint"])
    groups = manifest["param_groups"]
    need(isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups),
         "param_groups", "must be a list of objects with params")
    need([i for g in groups for i in g["params"]] == list(range(len(params))), "param_groups",
         "must number the parameters 0, 1, ... in order")
    group_of = {i: gi for gi, g in enumerate(groups) for i in g["params"]}
    seen: set = set()
    for b, bucket in enumerate(manifest["buckets"] if isinstance(manifest["buckets"], list) else [None]):
        at = f"buckets[{b}]"
        need(isinstance(bucket, dict) and set(bucket) == {"group", "numel", "shard_numel", "params", "keys",
                                                           "scalars"}, at, "must be a bucket object")
        need(is_int(bucket["group"]) and 0 <= bucket["group"] < len(groups), f"{at}.group", "out of range")
        check_flat_buffer(bucket, at, size, params, seen)
        need(bucket["numel"] >= 1, f"{at}.numel", "must be a positive integer")
        need(all(group_of[index] == bucket["group"] for index, _, _ in bucket["params"]), f"{at}.params",
             "holds a parameter of another group")
        keys = bucket["keys"]
        scalars = bucket["scalars"]
        need(isinstance(scalars, dict) and all(isinstance(k, str) and STATE_KEY.match(k) and k not in keys and scalar_ok(v)
                                               for k, v in scalars.items()), f"{at}.scalars", "must map names to scalars")
    need(seen == {i for i, p in enumerate(params) if p[3]}, "buckets", "must hold every trainable parameter once")
    check_shard_list(manifest["shards"], size, STEM)


def _manifest_of(section: Mapping, path: Any) -> dict:
    return checked_manifest(section.get("sharded"), check_manifest, "sharded optimizer", path)


def _target_params(optimizer: torch.optim.Optimizer) -> list:
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.shard_layout()["params"]
    return [[None, list(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad]
            for g in optimizer.param_groups for p in g["params"]]


def check_fit(section: Mapping, optimizer: torch.optim.Optimizer, path: Any) -> list:
    """Problems of loading the manifest in ``section`` into ``optimizer`` (the same on every rank).

    Args:
        section: the loaded checkpoint's ``optimizer`` section.
        optimizer: a ``ShardedOptimizer`` or any torch optimizer.
        path: the dense file, for messages.

    Returns:
        A list of problems (another model, optimizer class or group count), empty when it fits.

    Raises:
        CheckpointError: the manifest itself is malformed (a defect of the version).
    """
    manifest = _manifest_of(section, path)
    inner = optimizer.shard_optimizer if isinstance(optimizer, ShardedOptimizer) else getattr(optimizer, "_inner",
                                                                                              optimizer)
    problems = []
    if manifest["class"] != type(inner).__name__:
        problems.append(f"optimizer class: checkpoint {manifest['class'][:60]}, given {type(inner).__name__}")
    if len(manifest["param_groups"]) != len(optimizer.param_groups):
        problems.append(f"optimizer param_groups: checkpoint has {len(manifest['param_groups'])}, "
                        f"optimizer {len(optimizer.param_groups)}")
    else:
        for gi, (g, mine) in enumerate(zip(manifest["param_groups"], optimizer.param_groups)):
            if len(g["params"]) != len(mine["params"]):
                problems.append(f"optimizer param_groups[{gi}]: checkpoint has {len(g['params'])} parameters, "
                                f"optimizer {len(mine['params'])}")
    saved, mine = manifest["params"], _target_params(optimizer)
    if len(saved) != len(mine):
        problems.append(f"the checkpoint is of a model with {len(saved)} parameters, the optimizer has {len(mine)}")
    for i, (a, b) in enumerate(zip(saved, mine)):
        # names count when both sides have them (model.named_parameters() given when saving and loading)
        named = not (a[0] is None or b[0] is None or _UNNAMED.match(a[0]) or _UNNAMED.match(b[0]))
        if (a if named else a[1:]) != (b if named else b[1:]):
            problems.append(f"parameter {i}: checkpoint has {short(a[0])} {a[1]} {a[2]}"
                            f"{'' if a[3] else ' (frozen)'}, the optimizer {b[0] or ''} {b[1]} {b[2]}"
                            f"{'' if b[3] else ' (frozen)'} (a checkpoint of another model)")
            break
    return problems


# ----------------------------------------------------------------------------- reading
def _open_shards(directory: os.PathLike, manifest: dict, epoch: int) -> SavedShards:
    """The saved shards of version ``epoch``, to be checked against ``manifest`` as they are opened."""
    expected = {_dataset(b, k): (dtype, bucket["shard_numel"], f"{_bucket_key(b)}.{k}")
                for b, bucket in enumerate(manifest["buckets"]) for k, dtype in bucket["keys"].items()}
    identity = {"framework": FRAMEWORK, "epoch": epoch, "world_size": manifest["world_size"],
                "fingerprint": manifest["fingerprint"]}
    return SavedShards(shard_folder(directory, PREFIX, epoch), manifest["shards"], identity, expected)


def relayout(layout: dict, size: int) -> dict:
    """``layout`` (a ``shard_layout()``) as the same buckets split over ``size`` ranks.

    Args:
        layout: the layout at its own world size.
        size: another world size.

    Returns:
        The layout a ``ShardedOptimizer`` with the same buckets would have at ``size`` ranks.
    """
    return dict(layout, world_size=size,
                buckets=[dict(b, shard_numel=shard_numel(b["numel"], size)) for b in layout["buckets"]])


def _locations(manifest: dict) -> dict:
    """Parameter index -> (saved bucket, start in it)."""
    return {index: (b, start) for b, bucket in enumerate(manifest["buckets"]) for index, start, _ in bucket["params"]}


def _read_flat(shards: SavedShards, manifest: dict, b: int, key: str, lo: int, n: int, out: torch.Tensor) -> None:
    """Copy elements ``[lo, lo + n)`` of saved bucket ``b``'s ``key`` into ``out`` (``n`` elements)."""
    shards.read_flat(_dataset(b, key), manifest["buckets"][b]["numel"], lo, n, as_array(out))


def _stage_sharded(shards: SavedShards, manifest: dict, layout: dict, rank: int) -> dict:
    """Rank ``rank``'s shard of every bucket of ``layout`` (a ``shard_layout()`` at any world size):
    ``{bucket index: {key: value}}``, reading only the saved ranges it needs."""
    where = _locations(manifest)
    staged: dict = {}
    for nb, bucket in enumerate(layout["buckets"]):
        sources = sorted({where[index][0] for index, _, _ in bucket["params"]})
        keys = [manifest["buckets"][b]["keys"] for b in sources]
        scalars = [manifest["buckets"][b]["scalars"] for b in sources]
        if any(k != keys[0] for k in keys) or any(s != scalars[0] for s in scalars):
            raise CheckpointError(f"the parameters of bucket {nb} were saved with different state (keys "
                                  f"{short(keys)}, scalars {short(scalars)}): a sharded optimizer keeps one per bucket")
        if not keys[0] and not scalars[0]:
            continue
        lo, hi = shard_bounds(bucket["numel"], layout["world_size"], rank)
        entry = {k: decode_scalar(v) for k, v in scalars[0].items()}
        for key, dtype in keys[0].items():
            flat = torch.zeros(hi - lo, dtype=getattr(torch, dtype))
            for index, p_offset, s_offset, n in param_pieces(bucket["params"], lo, hi):
                b, start = where[index]
                _read_flat(shards, manifest, b, key, start + p_offset, n, flat[s_offset:s_offset + n])
            entry[key] = flat
        staged[nb] = entry
    return staged


def stage_shard(directory: os.PathLike, checkpoint: Any, layout: dict, rank: int) -> dict:
    """Rank ``rank``'s new shard of a sharded optimizer laid out as ``layout`` (of any world size), read
    from the version ``checkpoint``: what a ``ShardedOptimizer`` of that layout loads on that rank.

    Args:
        directory: the checkpoint directory.
        checkpoint: the loaded :class:`hvps.checkpoint.Checkpoint` (its optimizer section is a manifest).
        layout: a ``ShardedOptimizer.shard_layout()``, or one computed for another world size.
        rank: the rank in ``layout``'s world.

    Returns:
        ``{bucket index: {key: value}}`` (element-wise state as 1-D tensors of the bucket's shard length).

    Raises:
        CheckpointError: as :func:`stage_optimizer`.
    """
    manifest = _manifest_of(checkpoint.optimizer, checkpoint.path)
    with _open_shards(directory, manifest, checkpoint.epoch) as shards:
        return _stage_sharded(shards, manifest, layout, rank)


def _stage_consolidated(shards: SavedShards, manifest: dict) -> dict:
    """The whole state in the adapter's neutral optimizer format (for a plain torch optimizer)."""
    state: dict = {}
    for b, bucket in enumerate(manifest["buckets"]):
        for index, start, n in bucket["params"]:
            shape = manifest["params"][index][1]
            entry: dict = {}
            for key, value in bucket["scalars"].items():
                decoded = decode_scalar(value)
                entry[key] = as_array(decoded) if torch.is_tensor(decoded) else decoded
            for key, dtype in bucket["keys"].items():
                flat = torch.empty(n, dtype=getattr(torch, dtype))
                _read_flat(shards, manifest, b, key, start, n, flat)
                entry[key] = as_array(flat.view(shape))
            if entry:
                state[str(index)] = entry
    return {"class": manifest["class"], "param_groups": manifest["param_groups"], "state": state}


def stage_optimizer(directory: os.PathLike, checkpoint: Any, optimizer: torch.optim.Optimizer) -> Any:
    """Read (and verify) what ``optimizer`` needs of the sharded state of ``checkpoint``; nothing is changed.

    Args:
        directory: the checkpoint directory.
        checkpoint: the loaded :class:`hvps.checkpoint.Checkpoint` (its optimizer section is a manifest).
        optimizer: a ``ShardedOptimizer`` (any rank count) or a plain torch optimizer (consolidated).

    Returns:
        ``("sharded", {bucket index: {key: value}}, saved param_groups)`` for a ``ShardedOptimizer`` (give
        it to ``load_local_state``), or ``("plain", the consolidated state in the adapter's neutral optimizer
        format, None)`` for any other optimizer.

    Raises:
        CheckpointError: a shard is missing, unsafe, damaged, disagrees with the manifest or is of another model.
    """
    manifest = _manifest_of(checkpoint.optimizer, checkpoint.path)
    with _open_shards(directory, manifest, checkpoint.epoch) as shards:
        if isinstance(optimizer, ShardedOptimizer):
            state = _stage_sharded(shards, manifest, optimizer.shard_layout(), optimizer.process_set.rank())
            return ("sharded", state, manifest["param_groups"])
        return ("plain", _stage_consolidated(shards, manifest), None)
