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

The files, the manifest's schema and the reads are shared with the Keras sharded optimizer's checkpoints
(:mod:`hvps.checkpoint.sharded_optimizer_state`, in numpy); this module turns torch's optimizer state into
arrays and scalars and back.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping, Optional

import numpy as np
import torch

from hvps.checkpoint import sharded_optimizer_state as _state
from hvps.checkpoint.format import CheckpointError
from hvps.checkpoint.sharded_buffers import params_fingerprint
from hvps.checkpoint.sharded_optimizer_state import is_sharded_manifest, relayout, shard_file_name, tidy
from hvps.core.views import as_array, as_tensor

from .sharded_optimizer import ShardedOptimizer

FORMAT = _state.FORMAT
FORMAT_VERSION = _state.FORMAT_VERSION
FRAMEWORK = "hvps.sharded_optimizer"  # the shards' root attribute "framework"
_UNNAMED = re.compile(r"^param\.\d+$")  # ShardedOptimizer's names without named_parameters

__all__ = ["save_optimizer_shards", "is_sharded_manifest", "check_fit", "stage_optimizer", "stage_shard", "relayout",
           "model_fingerprint", "shard_file_name", "tidy", "encode_scalar", "decode_scalar", "comparable_names"]


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
    layout = optimizer.shard_layout()
    state = optimizer.local_state()
    arrays = {b: {k: as_array(v.detach().reshape(-1).cpu().contiguous()) for k, v in entry.items()
                  if _element_wise(v, layout["buckets"][b]["shard_numel"])} for b, entry in state.items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": ids}
              for g, ids in zip(optimizer.param_groups, _group_indices(optimizer.param_groups))]
    head = {"class": type(optimizer.shard_optimizer).__name__, "param_groups": groups,
            "buckets": _bucket_manifest(layout, state)}
    return _state.save_shards(manager, epoch, step, optimizer.process_set, layout, arrays, head,
                              (FRAMEWORK, torch.__version__))


def _group_indices(param_groups: list) -> list:
    out, at = [], 0
    for g in param_groups:
        out.append(list(range(at, at + len(g["params"]))))
        at += len(g["params"])
    return out


# ----------------------------------------------------------------------------- the manifest
def _target_params(optimizer: torch.optim.Optimizer) -> list:
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.shard_layout()["params"]
    return [[None, list(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad]
            for g in optimizer.param_groups for p in g["params"]]


def comparable_names(a: Any, b: Any) -> bool:
    """Whether two parameter names are to be compared: both given and meaningful (``named_parameters`` given to
    the ShardedOptimizer, not its ``param.N``)."""
    return not (a is None or b is None or _UNNAMED.match(a) or _UNNAMED.match(b))


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
    manifest = _state.manifest_of(section, path)
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
    return problems + _state.misfit_params(manifest["params"], _target_params(optimizer), comparable_names)


# ----------------------------------------------------------------------------- reading
def _as_tensors(entry: dict) -> dict:
    return {k: as_tensor(v) if isinstance(v, np.ndarray) else v for k, v in entry.items()}


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
    manifest = _state.manifest_of(checkpoint.optimizer, checkpoint.path)
    with _state.open_shards(directory, manifest, checkpoint.epoch, FRAMEWORK) as shards:
        staged = _state.stage_sharded(shards, manifest, layout, rank, decode_scalar)
    return {b: _as_tensors(entry) for b, entry in staged.items()}


def _decode_as_array(encoded: dict) -> Any:
    decoded = decode_scalar(encoded)
    return as_array(decoded) if torch.is_tensor(decoded) else decoded


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
    manifest = _state.manifest_of(checkpoint.optimizer, checkpoint.path)
    with _state.open_shards(directory, manifest, checkpoint.epoch, FRAMEWORK) as shards:
        if isinstance(optimizer, ShardedOptimizer):
            staged = _state.stage_sharded(shards, manifest, optimizer.shard_layout(), optimizer.process_set.rank(),
                                          decode_scalar)
            return ("sharded", {b: _as_tensors(entry) for b, entry in staged.items()}, manifest["param_groups"])
        state = _state.stage_consolidated(shards, manifest, _decode_as_array)
    return ("plain", {"class": manifest["class"], "param_groups": manifest["param_groups"],
                      "state": {str(index): entry for index, entry in state.items()}}, None)
