"""Checkpoints of a ``fully_shard`` model (ZeRO stage 3) and its optimizer as per-rank shards plus a manifest,
loadable into a fully sharded model at any rank count and into an unsharded model in one process.

Why through the manager's ordinary ``save``/``load``. A user writes ``ckpt.save(epoch, model=model,
optimizer=opt)`` and ``ckpt.load(model=model, optimizer=opt)``; after ``hvd.fully_shard(model)`` the same
two calls must keep working. Before this module they saved rank 0's shards as if they were whole
parameters (every other rank's part was lost) and loaded them on rank 0 only. Funnelling the parameters
through rank 0 would need the whole model in one process: exactly what stage 3 avoids.

Saving epoch N (collective over the job; the directory is shared by all ranks), as the stage 1-2
checkpoint does (:mod:`hvps.adapters.torch.sharded_checkpoint`, with the files of
:mod:`hvps.checkpoint.sharded_buffers`):

1. every rank writes ``model-epoch-N/model.<rank>-of-<size>.h5``: per flat group ``gNNNNN`` of the model
   (``FullyShardedModel.flat_groups()``), its block of the parameters (``/model/gNNNNN/values``) and of each
   element-wise optimizer state (``/optimizer/gNNNNN/<key>``: Adam's moments, SGD's momentum, laid out as
   the parameters), each 1-D with block digests, and ``/extra`` naming the rank, the world size and the
   model fingerprint;
2. the dense checkpoint of epoch N (rank 0, written last: the commit record) holds the model's buffers
   and, as ``model/fully_sharded``, the **manifest**: the world size, every parameter's name, shape, dtype
   and ``requires_grad`` (and their SHA-256, the fingerprint), each flat group's parameters, offsets and
   state keys, the optimizer's class, parameter groups and scalar state (``step``) per parameter, and
   each shard's file and digest.

Loading treats all of it as untrusted input (schema of the manifest; each shard inspected in the
sandboxed helper, the file the manifest lists, agreeing with it; every block read checked). Parameters
are matched by name, so the target may group its units differently. Into a ``fully_shard`` model at any
rank count M each rank reads only the ranges of the saved shards that its blocks need; into an unsharded
model (and a plain optimizer: one process without ``hvps.init()``, for inference or export) the full
tensors are assembled and loaded as a dense checkpoint would be. Shards that are missing, damaged,
disagree with the manifest or come from another model make the version fail on every rank, and
``load("latest")`` falls back to the previous version; a manifest of another model (other names, shapes
or dtypes) or another optimizer raises CheckpointError.

A dense checkpoint, written by a replicated run (``hvd.DistributedOptimizer``, DDP-style), loads into a
``fully_shard`` model and its optimizer too, at any rank count (the usual migration from replication to
sharding): every rank receives the dense file as for any load, and :func:`stage_dense` takes its block of
every flat group from the whole parameters by name, and its slice of each element-wise optimizer state from
torch's ``state_dict()`` layout (the optimizer's k-th parameter takes the saved k-th, as a plain optimizer
does), through the same staging as a re-sharded checkpoint. The torch ``CheckpointManager`` checks the fit
first (:func:`whole_parameters`): a dense file of another model raises CheckpointError naming what differs.

A ``ShardedOptimizer`` run's checkpoint (stage 1-2: the dense model plus the sharded optimizer's manifest and
per-rank shards, :mod:`hvps.adapters.torch.sharded_checkpoint`) loads alike (:func:`stage_sharded_optimizer`):
the parameters from the dense model section, and each rank reads only the ranges of the saved optimizer shards
that its blocks need, through the same staging; its manifest is checked first (:func:`sharded_optimizer_misfit`:
the optimizer's class and groups, every parameter's name, whole shape and dtype at its position), and missing or
damaged shards make ``load("latest")`` fall back to the previous version.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np
import torch

from hvps import api
from hvps.checkpoint import sharded_optimizer_state as _stage12
from hvps.checkpoint.format import CheckpointError, root_attributes
from hvps.checkpoint.safety import is_int, need
from hvps.checkpoint.sharded_buffers import (STATE_KEY, SavedShards, check_flat_buffer, check_manifest_head,
                                             check_params, check_shard_list, checked_manifest, numel_of,
                                             params_fingerprint, save_rank_shards, scalar_ok, shard_file_name,
                                             write_rank_shard)
from hvps.checkpoint.shards import describe_problem, shard_folder, short, tidy_shard_folders
from hvps.core.flat_shards import FlatLayout
from hvps.core.views import as_array, as_tensor

from .fully_sharded import FullyShardedModel
from .sharded_checkpoint import FRAMEWORK as _STAGE12_FRAMEWORK
from .sharded_checkpoint import comparable_names, decode_scalar, encode_scalar
from .sharded_optimizer import ShardedOptimizer

FORMAT = "hvps-fully-sharded"
FORMAT_VERSION = 1
FRAMEWORK = "hvps.fully_shard"  # the shards' root attribute "framework"
PREFIX = "model"
STEM = "model"
SECTION = "fully_sharded"  # the manifest's key in the dense file's model section
FOLDER_RE = re.compile(r"^model-epoch-(\d{6,})$")

__all__ = ["is_fully_sharded", "is_fully_sharded_model", "buffers_of", "save_model_shards", "check_fit", "stage",
           "whole_parameters", "stage_dense", "stage_sharded_optimizer", "sharded_optimizer_misfit", "model_of_optimizer", "Staged", "apply_staged", "tidy", "SECTION"]


def is_fully_sharded_model(model: Any) -> bool:
    """Whether ``model`` is a module that ``hvd.fully_shard`` changed."""
    return isinstance(model, torch.nn.Module) and getattr(model, "_hvps_fully_sharded", None) is not None


def is_fully_sharded(model_section: Any) -> bool:
    """Whether a loaded checkpoint's ``model`` section is a fully sharded model's (holds a manifest)."""
    return isinstance(model_section, Mapping) and isinstance(model_section.get(SECTION), Mapping)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _group_key(g: int) -> str:
    return f"g{int(g):05d}"


def _values(g: int) -> str:
    return f"/model/{_group_key(g)}/values"


def _state(g: int, key: str) -> str:
    return f"/optimizer/{_group_key(g)}/{key}"


def _digest_name(dataset: str) -> str:
    return dataset.strip("/").replace("/", ".")


def _element_wise(value: Any, shard: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() >= 1 and value.shape == shard.shape


def _buffer_names(model: torch.nn.Module) -> list:
    """The model's ``state_dict()`` keys that are not parameters (buffers, extra state)."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return [k for k in model.state_dict() if k not in params]


def buffers_of(model: torch.nn.Module) -> dict:
    """The entries of ``model.state_dict()`` that are not parameters (what every rank holds alike).

    Args:
        model: any module.

    Returns:
        ``{state_dict key: value}``.
    """
    state = model.state_dict()
    return {k: state[k] for k in _buffer_names(model)}


# ----------------------------------------------------------------------------- saving
def _optimizer_part(optimizer: torch.optim.Optimizer, controller: FullyShardedModel) -> tuple:
    """``(the manifest's optimizer part, {(group, key): dtype name})`` of ``optimizer`` over the model's shards."""
    groups = controller.flat_groups()
    where, base = {}, 0
    for g, group in enumerate(groups):
        for i, shard in enumerate(group.shards):
            where[id(shard)] = (g, base + i)
        base += len(group.shards)
    keys: dict = {}
    state, param_groups = [], []
    for group in optimizer.param_groups:
        indices = []
        for p in group["params"]:
            if id(p) not in where:
                raise CheckpointError("the optimizer holds a parameter that is not a shard of the fully sharded "
                                      "model: build it over model.parameters() after hvd.fully_shard(model)")
            g, index = where[id(p)]
            indices.append(index)
            entries = optimizer.state.get(p)
            if entries is None:
                state.append(None)
                continue
            flat = []
            for key, value in entries.items():
                if not STATE_KEY.match(str(key)):
                    raise CheckpointError(f"optimizer state {short(key)} cannot name a dataset (letters, digits, _)")
                if _element_wise(value, p):
                    flat.append(key)
                    dtype = keys.setdefault((g, key), _dtype_name(value.dtype))
                    if dtype != _dtype_name(value.dtype):
                        raise CheckpointError(f"optimizer state {key!r} is {dtype} and {value.dtype} within one flat "
                                              "group: it cannot be saved as one buffer")
            scalars = {k: encode_scalar(k, v, f"parameter {index}") for k, v in entries.items() if k not in flat}
            state.append({"flat": flat, "scalars": scalars})
        param_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": indices})
    inner = getattr(optimizer, "_inner", optimizer)
    return {"class": type(inner).__name__, "param_groups": param_groups, "state": state}, keys


def _write_own_shard(path: Any, controller: FullyShardedModel, optimizer: Optional[torch.optim.Optimizer],
                     layout: list, identity: dict, attrs: dict, fsync: bool) -> str:
    """Write this rank's block of every flat group (``layout``: the manifest's groups) and of its state keys."""
    datasets: dict = {}
    for g, (group, saved) in enumerate(zip(controller.flat_groups(), layout)):
        datasets[_values(g)] = (as_array(group.shard_flat.detach().cpu().contiguous()), _digest_name(_values(g)))
        for key, dtype in saved["keys"].items():
            column = torch.zeros(group.shard_numel, dtype=getattr(torch, dtype))
            for shard, (at, n) in zip(group.shards, group.pieces):
                value = optimizer.state.get(shard, {}).get(key)
                if _element_wise(value, shard):
                    column[at:at + n] = value.detach().reshape(-1).cpu()
            datasets[_state(g, key)] = (as_array(column), _digest_name(_state(g, key)))
    extra = {"rank": identity["rank"], "world_size": identity["world_size"], "fingerprint": identity["fingerprint"]}
    return write_rank_shard(path, datasets, extra, attrs, fsync)


def save_model_shards(manager: Any, epoch: int, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                      step: Optional[int]) -> dict:
    """Write every rank's shard of ``model`` (and of ``optimizer``'s state) for version ``epoch`` (collective);
    the manifest to record in the dense checkpoint's model section.

    Args:
        manager: the torch ``CheckpointManager`` (its ``directory`` and ``fsync``).
        epoch: the version being saved.
        model: a model that ``hvd.fully_shard`` changed, over every rank of the job.
        optimizer: None, or a torch optimizer over the model's shards (``model.parameters()``).
        step: the step recorded in the shards' root attributes.

    Returns:
        The manifest, JSON-able (the same on every rank).

    Raises:
        CheckpointError: on every rank, when a rank could not write its shard, its optimizer is not over the
            model's shards or the ranks' optimizer state differs in kind (earlier versions stay intact), or the
            model is sharded over fewer ranks than the job's or ``optimizer`` is a ``ShardedOptimizer``.
    """
    controller = FullyShardedModel.of(model)
    size, rank = controller.world()
    job = api.size() if api.is_initialized() else 1
    if size != job:
        raise CheckpointError(f"a model fully sharded over {size} of the job's {job} ranks cannot be checkpointed: "
                              "its process set must hold every rank")
    if isinstance(optimizer, ShardedOptimizer):
        raise CheckpointError("a ShardedOptimizer over a fully sharded model is not supported: build a plain torch "
                              "optimizer over model.parameters()")
    groups = controller.flat_groups()
    params = [[name, list(shape), _dtype_name(group.dtype), shard.requires_grad]
              for group in groups for name, shape, shard in zip(group.names, group.shapes, group.shards)]
    layout, at = [], 0
    for group in groups:
        layout.append({"unit": group.name, "numel": group.numel, "shard_numel": group.shard_numel,
                       "params": [[at + i, start, n] for i, (start, n) in enumerate(group.slices)], "keys": {}})
        at += len(group.shards)
    optimizer_part, keys, problem = None, {}, None
    try:
        if optimizer is not None:
            optimizer_part, keys = _optimizer_part(optimizer, controller)
    except CheckpointError as exc:  # every rank learns every rank's problem below (none waits alone)
        problem = describe_problem(exc)
    for (g, key), dtype in sorted(keys.items()):
        layout[g]["keys"][key] = dtype
    # the shards must hold the same datasets: every rank's optimizer state of the same kind
    mine = (problem, json.dumps([optimizer_part, layout], sort_keys=True, default=str))
    gathered = api.allgather_object(mine, name=f"ckpt.save.model.layout.{int(epoch)}") if size > 1 else [mine]
    problems = [f"rank {r}: {p}" for r, (p, _) in enumerate(gathered) if p is not None]
    problems += [f"rank {r}: its optimizer state differs in kind from rank 0's (keys, dtypes, step counts)"
                 for r, (_, theirs) in enumerate(gathered) if theirs != gathered[0][1]]
    if problems:
        raise CheckpointError(f"saving the fully sharded model of epoch {epoch} failed", manager.directory, problems)
    fingerprint = params_fingerprint(params)
    folder = shard_folder(manager.directory, PREFIX, epoch)
    identity = {"rank": rank, "world_size": size, "fingerprint": fingerprint}
    attrs = root_attributes(epoch, step, size, FRAMEWORK, torch.__version__)

    def write() -> str:
        folder.mkdir(parents=True, exist_ok=True)
        return _write_own_shard(folder / shard_file_name(STEM, rank, size), controller, optimizer, layout, identity,
                                attrs, getattr(manager, "fsync", True))

    digests = save_rank_shards(write, rank, size, f"the fully sharded model of epoch {epoch}", folder,
                               f"ckpt.save.model.{int(epoch)}")
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "world_size": size, "fingerprint": fingerprint,
            "params": params, "groups": layout, "optimizer": optimizer_part,
            "shards": [{"file": shard_file_name(STEM, r, size), "rank": r, "sha256": d} for r, d in enumerate(digests)]}


def tidy(manager: Any, epoch: int) -> None:
    """After committing ``epoch`` (root only): drop the shard folders of versions retention removed."""
    tidy_shard_folders(manager, epoch, FOLDER_RE)


# ----------------------------------------------------------------------------- the manifest
def check_manifest(manifest: Any) -> None:
    """Raise Defect unless ``manifest`` has the structure, types, ranges and consistency that
    :func:`save_model_shards` writes."""
    check_manifest_head(manifest, {"format", "format_version", "world_size", "fingerprint", "params", "groups",
                                   "optimizer", "shards"}, FORMAT, FORMAT_VERSION)
    size, params = manifest["world_size"], manifest["params"]
    check_params(params, manifest["fingerprint"])
    need(len({p[0] for p in params}) == len(params), "params", "names must be unique")
    groups = manifest["groups"]
    need(isinstance(groups, list), "groups", "must be a list")
    seen: set = set()
    for g, group in enumerate(groups):
        at = f"groups[{g}]"
        need(isinstance(group, dict) and set(group) == {"unit", "numel", "shard_numel", "params", "keys"}
             and isinstance(group["unit"], str) and isinstance(group["params"], list) and group["params"], at,
             "must be a flat group object")
        check_flat_buffer(group, at, size, params, seen)
        need(len({params[index][2] for index, _, _ in group["params"]}) == 1, f"{at}.params", "of several dtypes")
    need(seen == set(range(len(params))), "groups", "must hold every parameter once")
    _check_optimizer_part(manifest["optimizer"], groups, len(params))
    check_shard_list(manifest["shards"], size, STEM)


def _check_optimizer_part(part: Any, groups: list, count: int) -> None:
    if part is None:
        need(all(not g["keys"] for g in groups), "groups", "list optimizer state keys without an optimizer")
        return
    need(isinstance(part, dict) and set(part) == {"class", "param_groups", "state"} and isinstance(part["class"], str),
         "optimizer", "must be {class, param_groups, state}")
    param_groups = part["param_groups"]
    need(isinstance(param_groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                                for g in param_groups), "optimizer.param_groups",
         "must be a list of objects with params")
    indices = [i for g in param_groups for i in g["params"]]
    need(all(is_int(i) and 0 <= i < count for i in indices) and len(set(indices)) == len(indices),
         "optimizer.param_groups", "parameter indices out of range or repeated")
    state = part["state"]
    need(isinstance(state, list) and len(state) == len(indices), "optimizer.state", "must have one entry a parameter")
    group_of = {index: g for g, group in enumerate(groups) for index, _, _ in group["params"]}
    for k, (index, entry) in enumerate(zip(indices, state)):
        if entry is None:
            continue
        at = f"optimizer.state[{k}]"
        need(isinstance(entry, dict) and set(entry) == {"flat", "scalars"} and isinstance(entry["flat"], list)
             and isinstance(entry["scalars"], dict), at, "must be {flat, scalars}")
        need(all(isinstance(key, str) and key in groups[group_of[index]]["keys"] for key in entry["flat"]),
             f"{at}.flat", "names state its flat group does not hold")
        need(all(isinstance(key, str) and STATE_KEY.match(key) and key not in entry["flat"] and scalar_ok(v)
                 for key, v in entry["scalars"].items()), f"{at}.scalars", "must map names to scalars")


def _manifest_of(model_section: Mapping, path: Any) -> dict:
    return checked_manifest(model_section.get(SECTION), check_manifest, "fully sharded model", path)


# ----------------------------------------------------------------------------- fitting
def _target_params(model: torch.nn.Module) -> dict:
    """``{name: [shape, dtype, requires_grad]}`` of the model's parameters (whole, sharded or not)."""
    if is_fully_sharded_model(model):
        return {name: [list(shape), _dtype_name(group.dtype), shard.requires_grad]
                for group in FullyShardedModel.of(model).flat_groups()
                for name, shape, shard in zip(group.names, group.shapes, group.shards)}
    return {name: [list(p.shape), _dtype_name(p.dtype), p.requires_grad] for name, p in model.named_parameters()}


def check_fit(checkpoint: Any, model: Optional[torch.nn.Module], optimizer: Optional[torch.optim.Optimizer]) -> list:
    """Problems of loading the fully sharded ``checkpoint`` into ``model`` and ``optimizer`` (the same on every rank).

    Args:
        checkpoint: the loaded :class:`hvps.checkpoint.Checkpoint` (its model section holds a manifest).
        model: a fully sharded or an unsharded model, or None.
        optimizer: a torch optimizer (over the shards of a fully sharded ``model``), or None.

    Returns:
        A list of problems (another model, optimizer class or groups), empty when it fits.

    Raises:
        CheckpointError: the manifest itself is malformed (a defect of the version).
    """
    manifest = _manifest_of(checkpoint.model, checkpoint.path)
    problems = []
    if model is not None:
        saved = {name: [shape, dtype, grad] for name, shape, dtype, grad in manifest["params"]}
        mine = _target_params(model)
        for name in sorted(set(saved) | set(mine)):
            if saved.get(name) != mine.get(name):
                problems.append(f"parameter {short(name)}: checkpoint {short(saved.get(name))}, model "
                                f"{mine.get(name)} (a checkpoint of another model)")
    if optimizer is None:
        return problems[:8]
    part = manifest["optimizer"]
    if part is None:
        return problems[:8] + ["the checkpoint holds no optimizer state"]
    if isinstance(optimizer, ShardedOptimizer) and is_fully_sharded_model(model):
        problems.append("a ShardedOptimizer over a fully sharded model is not supported")
    inner = optimizer.shard_optimizer if isinstance(optimizer, ShardedOptimizer) else getattr(optimizer, "_inner",
                                                                                              optimizer)
    if part["class"] != type(inner).__name__:
        problems.append(f"optimizer class: checkpoint {part['class'][:60]}, given {type(inner).__name__}")
    if [len(g["params"]) for g in part["param_groups"]] != [len(g["params"]) for g in optimizer.param_groups]:
        problems.append(f"optimizer param_groups: checkpoint has {[len(g['params']) for g in part['param_groups']]} "
                        f"parameters, optimizer {[len(g['params']) for g in optimizer.param_groups]}")
    elif is_fully_sharded_model(model):
        names = {id(s): n for group in FullyShardedModel.of(model).flat_groups()
                 for n, s in zip(group.names, group.shards)}
        for gi, (saved_group, group) in enumerate(zip(part["param_groups"], optimizer.param_groups)):
            got = [names.get(id(p)) for p in group["params"]]
            if got != [manifest["params"][i][0] for i in saved_group["params"]]:
                problems.append(f"optimizer param_groups[{gi}]: other parameters than the checkpoint's (the optimizer "
                                "must be over model.parameters() of the fully sharded model, in the saved order)")
    return problems[:8]


# ----------------------------------------------------------------------------- reading
@dataclass
class Staged:
    """What a fully sharded model loads on this rank, read and verified, nothing changed yet.

    ``blocks``: this rank's block of each of its flat groups (None: the parameters are not loaded); ``optimizer``: a ``state_dict()`` for its
    optimizer (None without one); ``buffers``: the saved buffers (numpy).
    """

    blocks: Optional[list]
    optimizer: Optional[dict]
    buffers: dict


def _open_shards(directory: os.PathLike, manifest: dict, epoch: int) -> SavedShards:
    expected = {}
    for g, group in enumerate(manifest["groups"]):
        dtype = manifest["params"][group["params"][0][0]][2]
        expected[_values(g)] = (dtype, group["shard_numel"], _digest_name(_values(g)))
        for key, key_dtype in group["keys"].items():
            expected[_state(g, key)] = (key_dtype, group["shard_numel"], _digest_name(_state(g, key)))
    identity = {"framework": FRAMEWORK, "epoch": epoch, "world_size": manifest["world_size"],
                "fingerprint": manifest["fingerprint"]}
    return SavedShards(shard_folder(directory, PREFIX, epoch), manifest["shards"], identity, expected)


class _Reader:
    """A fully sharded checkpoint's saved state, by parameter name: any element range of a parameter or of its
    element-wise optimizer state, read from the shards that hold it."""

    def __init__(self, shards: SavedShards, manifest: dict) -> None:
        self.shards, self.manifest = shards, manifest
        self.index = {p[0]: i for i, p in enumerate(manifest["params"])}
        self.where = {index: (g, start) for g, group in enumerate(manifest["groups"])
                      for index, start, _ in group["params"]}
        self.saved = _saved_state(manifest) if manifest["optimizer"] is not None else {}

    def read(self, name: str, key: Optional[str], offset: int, out: torch.Tensor) -> None:
        """Fill ``out`` (1-D) with elements ``[offset, offset + out.numel())`` of parameter ``name`` (``key``
        None) or of its optimizer state ``key``."""
        g, start = self.where[self.index[name]]
        dataset = _values(g) if key is None else _state(g, key)
        self.shards.read_flat(dataset, self.manifest["groups"][g]["numel"], start + offset, out.numel(),
                              as_array(out))

    def state_of(self, name: str) -> Optional[tuple]:
        """``(scalar state, {element-wise key: dtype})`` saved for parameter ``name``; None without state."""
        index = self.index[name]
        entry = self.saved.get(index)
        if entry is None:
            return None
        keys = self.manifest["groups"][self.where[index][0]]["keys"]
        return _scalars(entry), {key: getattr(torch, keys[key]) for key in entry["flat"]}

    @property
    def param_groups(self) -> list:
        """The saved optimizer's parameter groups."""
        return self.manifest["optimizer"]["param_groups"]


class _DenseSource:
    """A dense checkpoint (a replicated run's) as :class:`_Reader` offers a fully sharded one: whole parameters by
    name, and the optimizer state of torch's ``state_dict()`` layout, matched to the parameters by position
    (the target optimizer's k-th parameter takes the saved optimizer's k-th, as for a plain optimizer).

    Args:
        model_section: the checkpoint's model section (numpy arrays by ``state_dict()`` key).
        optimizer_section: its optimizer section (the adapter's neutral optimizer format), or None.
        model: the fully sharded target.
        optimizer: its optimizer over the model's shards, or None.
    """

    def __init__(self, model_section: Mapping, optimizer_section: Optional[Mapping], model: torch.nn.Module,
                 optimizer: Optional[torch.optim.Optimizer]) -> None:
        self.model_section = model_section
        names = {id(s): n for group in FullyShardedModel.of(model).flat_groups()
                 for n, s in zip(group.names, group.shards)}
        self.saved: dict = {}
        if optimizer is not None and optimizer_section is not None:
            state = optimizer_section.get("state", {})
            for saved_group, group in zip(optimizer_section["param_groups"], optimizer.param_groups):
                for saved_index, p in zip(saved_group["params"], group["params"]):
                    self.saved[names[id(p)]] = state.get(str(saved_index))
        self.param_groups = None if optimizer_section is None else optimizer_section["param_groups"]

    def read(self, name: str, key: Optional[str], offset: int, out: torch.Tensor) -> None:
        """Fill ``out`` (1-D) with elements ``[offset, offset + out.numel())`` of parameter ``name`` (``key``
        None) or of its optimizer state ``key``."""
        array = self.model_section[name] if key is None else self.saved[name][key]
        out.copy_(as_tensor(array).reshape(-1)[offset:offset + out.numel()])

    def state_of(self, name: str) -> Optional[tuple]:
        """``(scalar state, {element-wise key: dtype})`` saved for parameter ``name``; None without state."""
        entry = self.saved.get(name)
        if entry is None:
            return None
        flat = {k: as_tensor(v).dtype for k, v in entry.items() if isinstance(v, np.ndarray) and v.ndim}
        scalars = {k: as_tensor(v).clone() if isinstance(v, np.ndarray) else v for k, v in entry.items()
                   if k not in flat}
        return scalars, flat


class _ShardedOptimizerSource:
    """A stage 1-2 checkpoint (a ``ShardedOptimizer`` run's: the dense model plus the sharded optimizer's manifest)
    as :class:`_Reader` offers a fully sharded one: whole parameters by name from the dense model section, and each
    parameter's element-wise optimizer state read from the per-rank shards through the manifest, matched by
    position (the target optimizer's k-th parameter takes the manifest's k-th, as the manifest numbers them).

    Args:
        model_section: the checkpoint's model section (numpy arrays by ``state_dict()`` key).
        manifest: the checked manifest of its optimizer section.
        shards: the opened shards of the version.
        model: the fully sharded target.
        optimizer: its optimizer over the model's shards.
    """

    def __init__(self, model_section: Mapping, manifest: dict, shards: SavedShards, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        self.model_section, self.manifest, self.shards = model_section, manifest, shards
        names = {id(s): n for group in FullyShardedModel.of(model).flat_groups()
                 for n, s in zip(group.names, group.shards)}
        located = _stage12.parameter_locations(manifest)
        targets = [p for group in optimizer.param_groups for p in group["params"]]
        #: parameter name -> (its saved bucket, its first element there); frozen parameters have none
        self.saved = {names[id(p)]: located[k] for k, p in enumerate(targets) if k in located}
        self.param_groups = manifest["param_groups"]

    def read(self, name: str, key: Optional[str], offset: int, out: torch.Tensor) -> None:
        """Fill ``out`` (1-D) with elements ``[offset, offset + out.numel())`` of parameter ``name`` (``key``
        None) or of its optimizer state ``key``."""
        if key is None:
            out.copy_(as_tensor(self.model_section[name]).reshape(-1)[offset:offset + out.numel()])
            return
        _stage12.read_parameter_state(self.shards, self.manifest, self.saved[name], key, offset, as_array(out))

    def state_of(self, name: str) -> Optional[tuple]:
        """``(scalar state, {element-wise key: dtype})`` saved for parameter ``name`` (its bucket's); None without
        state."""
        if name not in self.saved:
            return None
        bucket = self.manifest["buckets"][self.saved[name][0]]
        if not bucket["keys"] and not bucket["scalars"]:
            return None
        return ({k: decode_scalar(v) for k, v in bucket["scalars"].items()},
                {k: getattr(torch, dtype) for k, dtype in bucket["keys"].items()})


def _saved_state(manifest: dict) -> dict:
    """Parameter index -> its saved optimizer entry (or None)."""
    part = manifest["optimizer"]
    indices = [i for g in part["param_groups"] for i in g["params"]]
    return dict(zip(indices, part["state"]))


def _scalars(entry: dict) -> dict:
    return {k: decode_scalar(v) for k, v in entry["scalars"].items()}


def _stage_sharded(source: Any, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                   world: tuple, parameters: bool = True) -> tuple:
    """Rank ``world[1]`` of ``world[0]``'s blocks (None unless ``parameters``) and its optimizer's ``state_dict()``
    for a fully sharded target, read from ``source`` (a :class:`_Reader`, :class:`_DenseSource` or
    :class:`_ShardedOptimizerSource`)."""
    size, rank = world
    blocks, shard_state = [], {}
    for group in FullyShardedModel.of(model).flat_groups():
        layout = FlatLayout(tuple(shape.numel() for shape in group.shapes), size)
        block = torch.zeros(layout.shard_numel, dtype=group.dtype)
        mine = {i: (offset, at, n) for i, offset, at, n in layout.pieces(rank)}
        for i, (name, shard) in enumerate(zip(group.names, group.shards)):
            offset, at, n = mine.get(i, (0, 0, 0))
            if parameters:
                source.read(name, None, offset, block[at:at + n])
            saved = None if optimizer is None else source.state_of(name)
            if saved is not None:
                state, keys = saved
                for key, dtype in keys.items():
                    state[key] = torch.zeros(n, dtype=dtype)
                    source.read(name, key, offset, state[key])
                shard_state[id(shard)] = state
        blocks.append(block)
    blocks = blocks if parameters else None
    if optimizer is None:
        return blocks, None
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {k: shard_state[id(p)] for k, p in enumerate(params) if id(p) in shard_state}
    groups, at = [], 0
    for saved_group in source.param_groups:
        n = len(saved_group["params"])
        groups.append(dict(saved_group, params=list(range(at, at + n))))
        at += n
    return blocks, {"state": state, "param_groups": groups}


def _stage_dense(reader: _Reader, manifest: dict, model: Optional[torch.nn.Module], with_optimizer: bool) -> tuple:
    """The whole model and optimizer state as a dense checkpoint's sections (numpy), for an unsharded target."""
    full = {}
    for name, shape, dtype, _ in manifest["params"]:
        tensor = torch.zeros(numel_of(shape), dtype=getattr(torch, dtype))
        reader.read(name, None, 0, tensor)
        full[name] = tensor.view(shape)
    if model is not None:  # tied weights: every name under which the target registers a parameter
        first = {id(p): name for name, p in model.named_parameters()}
        for name, p in model.named_parameters(remove_duplicate=False):
            if first[id(p)] in full:
                full.setdefault(name, full[first[id(p)]])
    model_section = {k: as_array(v) for k, v in full.items()}
    if not with_optimizer:
        return model_section, None
    part, state, groups, position = manifest["optimizer"], {}, [], 0
    for saved_group in part["param_groups"]:
        ids = []
        for index in saved_group["params"]:
            entry = part["state"][position]
            if entry is not None:
                name, shape = manifest["params"][index][0], manifest["params"][index][1]
                values = _scalars(entry)
                values = {k: as_array(v) if torch.is_tensor(v) else v for k, v in values.items()}
                g = reader.where[index][0]
                for key in entry["flat"]:
                    tensor = torch.zeros(numel_of(shape), dtype=getattr(torch, manifest["groups"][g]["keys"][key]))
                    reader.read(name, key, 0, tensor)
                    values[key] = as_array(tensor.view(shape))
                state[str(position)] = values
            ids.append(position)
            position += 1
        groups.append(dict(saved_group, params=ids))
    return model_section, {"class": part["class"], "param_groups": groups, "state": state}


def stage(directory: os.PathLike, checkpoint: Any, model: Optional[torch.nn.Module],
          optimizer: Optional[torch.optim.Optimizer], world: Optional[tuple] = None, parameters: bool = True) -> Any:
    """Read (and verify) what ``model`` and ``optimizer`` need of the fully sharded ``checkpoint``; nothing is changed.

    Args:
        directory: the checkpoint directory.
        checkpoint: the loaded :class:`hvps.checkpoint.Checkpoint` (its model section holds a manifest).
        model: a fully sharded model (any rank count), an unsharded one, or None.
        optimizer: its optimizer, or None.
        world: ``(size, rank)`` of the layout to stage a fully sharded ``model``'s blocks for (another rank
            count's, to inspect one); default the model's own.
        parameters: stage a fully sharded ``model``'s parameters (False: its optimizer's state alone).

    Returns:
        A :class:`Staged` for a fully sharded ``model`` (give it to :func:`apply_staged`); otherwise
        ``(model section, optimizer section)``: the checkpoint as a dense one would hold it (the optimizer's
        in the adapter's neutral format, None without an optimizer).

    Raises:
        CheckpointError: a shard is missing, unsafe, damaged, disagrees with the manifest or is of another model.
    """
    manifest = _manifest_of(checkpoint.model, checkpoint.path)
    buffers = checkpoint.model.get("buffers", {})
    with _open_shards(directory, manifest, checkpoint.epoch) as shards:
        reader = _Reader(shards, manifest)
        if is_fully_sharded_model(model):
            world = FullyShardedModel.of(model).world() if world is None else world
            blocks, state = _stage_sharded(reader, model, optimizer, world, parameters)
            return Staged(blocks, state, dict(buffers))
        model_section, optimizer_section = _stage_dense(reader, manifest, model, optimizer is not None)
    return {**buffers, **model_section}, optimizer_section


def whole_parameters(model: torch.nn.Module) -> dict:
    """What a dense checkpoint holds of a fully sharded ``model``'s parameters: ``{state_dict() key: an empty
    "meta" tensor of the whole parameter's shape and dtype}`` (every name of a tied parameter).

    Args:
        model: a model that ``hvd.fully_shard`` changed.

    Returns:
        The parameters' keys (its buffers left out), each with a tensor that holds no data.
    """
    whole = {id(shard): (shape, group.dtype) for group in FullyShardedModel.of(model).flat_groups()
             for shape, shard in zip(group.shapes, group.shards)}
    return {name: torch.empty(whole[id(p)][0], dtype=whole[id(p)][1], device="meta")
            for name, p in model.named_parameters(remove_duplicate=False)}


def _staged(checkpoint: Any, model: torch.nn.Module, blocks: Any, state: Any) -> Staged:
    """``blocks`` and ``state`` staged for ``model``, with the saved entries that are none of its parameters (its
    buffers)."""
    params = whole_parameters(model)
    return Staged(blocks, state, {k: v for k, v in (checkpoint.model or {}).items() if k not in params})


def stage_dense(checkpoint: Any, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                world: Optional[tuple] = None, parameters: bool = True) -> Staged:
    """This rank's slices of a dense checkpoint (a replicated run's) for a fully sharded ``model`` and its
    optimizer; nothing is changed. The caller checked the fit (:func:`whole_parameters`).

    Args:
        checkpoint: the loaded :class:`hvps.checkpoint.Checkpoint` (dense model and optimizer sections).
        model: a fully sharded model (any rank count).
        optimizer: a torch optimizer over its shards, or None.
        world: ``(size, rank)`` of the layout to stage for; default the model's own.
        parameters: stage the parameters (False: the optimizer's state alone).

    Returns:
        A :class:`Staged` (give it to :func:`apply_staged`): the saved entries that are no parameters of
        ``model`` are its ``buffers``.
    """
    source = _DenseSource(checkpoint.model, checkpoint.optimizer or None, model, optimizer)
    world = FullyShardedModel.of(model).world() if world is None else world
    blocks, state = _stage_sharded(source, model, optimizer, world, parameters)
    return _staged(checkpoint, model, blocks, state)


def stage_sharded_optimizer(directory: os.PathLike, checkpoint: Any, model: torch.nn.Module,
                            optimizer: torch.optim.Optimizer, world: Optional[tuple] = None,
                            parameters: bool = True) -> Staged:
    """This rank's slices of a stage 1-2 checkpoint (a ``ShardedOptimizer`` run's: dense model, sharded optimizer
    state) for a fully sharded ``model`` and its optimizer, reading only the ranges of the saved optimizer shards
    that its blocks need; nothing is changed. The caller checked the fit (:func:`sharded_optimizer_misfit`).

    Args:
        directory: the checkpoint directory.
        checkpoint: the loaded :class:`hvps.checkpoint.Checkpoint` (dense model section, optimizer manifest).
        model: a fully sharded model (any rank count).
        optimizer: a torch optimizer over its shards.
        world: ``(size, rank)`` of the layout to stage for; default the model's own.
        parameters: stage the parameters (False: the optimizer's state alone).

    Returns:
        A :class:`Staged` (give it to :func:`apply_staged`): the saved entries that are no parameters of
        ``model`` are its ``buffers``.

    Raises:
        CheckpointError: a shard is missing, unsafe, damaged, disagrees with the manifest or is of another model.
    """
    manifest = _stage12.manifest_of(checkpoint.optimizer, checkpoint.path)
    world = FullyShardedModel.of(model).world() if world is None else world
    with _stage12.open_shards(directory, manifest, checkpoint.epoch, _STAGE12_FRAMEWORK) as shards:
        source = _ShardedOptimizerSource(checkpoint.model, manifest, shards, model, optimizer)
        blocks, state = _stage_sharded(source, model, optimizer, world, parameters)
    return _staged(checkpoint, model, blocks, state)


def sharded_optimizer_misfit(checkpoint: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list:
    """Problems of loading the optimizer manifest of a stage 1-2 ``checkpoint`` into ``optimizer`` over the shards
    of the fully sharded ``model``: its class, its parameter groups, and each of its parameters (the whole
    parameter's name, shape, dtype and trainability) against the manifest's at the same position.

    Args:
        checkpoint: the loaded :class:`hvps.checkpoint.Checkpoint` (its optimizer section is a manifest).
        model: a fully sharded model.
        optimizer: a torch optimizer over its shards.

    Returns:
        A list of problems, empty when it fits.

    Raises:
        CheckpointError: the manifest itself is malformed (a defect of the version).
    """
    manifest = _stage12.manifest_of(checkpoint.optimizer, checkpoint.path)
    if isinstance(optimizer, ShardedOptimizer):
        return ["a ShardedOptimizer over a fully sharded model is not supported"]
    whole = {id(shard): [name, list(shape), _dtype_name(group.dtype), shard.requires_grad]
             for group in FullyShardedModel.of(model).flat_groups()
             for name, shape, shard in zip(group.names, group.shapes, group.shards)}
    targets = [p for group in optimizer.param_groups for p in group["params"]]
    if any(id(p) not in whole for p in targets):
        return ["the optimizer holds a parameter that is not a shard of the fully sharded model: build it over "
                "model.parameters() after hvd.fully_shard(model)"]
    problems = []
    inner = getattr(optimizer, "_inner", optimizer)
    if manifest["class"] != type(inner).__name__:
        problems.append(f"optimizer class: checkpoint {manifest['class'][:60]}, given {type(inner).__name__}")
    saved_groups = [len(g["params"]) for g in manifest["param_groups"]]
    if saved_groups != [len(g["params"]) for g in optimizer.param_groups]:
        problems.append(f"optimizer param_groups: checkpoint has {saved_groups} parameters, optimizer "
                        f"{[len(g['params']) for g in optimizer.param_groups]}")
    return problems + _stage12.misfit_params(manifest["params"], [whole[id(p)] for p in targets], comparable_names)


def apply_staged(staged: Staged, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
    """Install ``staged`` into the fully sharded ``model`` (unless its ``blocks`` are None) and its ``optimizer``
    (local; the step in progress and the shards' gradients are dropped).

    Args:
        staged: from :func:`stage`, for this model at this rank count.
        model: the fully sharded model.
        optimizer: its optimizer, or None.
    """
    controller = FullyShardedModel.of(model)
    size, rank = controller.world()
    if staged.blocks is not None:
        controller.relayout(staged.blocks, size, rank)
    if optimizer is not None and staged.optimizer is not None:
        optimizer.state.clear()
        optimizer.load_state_dict(staged.optimizer)


def model_of_optimizer(optimizer: Optional[torch.optim.Optimizer]) -> Optional[torch.nn.Module]:
    """The fully sharded model whose shards ``optimizer`` is over (its first parameter's), for a load of the
    optimizer alone: each shard knows its model (:meth:`FullyShardedModel.owning`), as an FSDP2 parameter knows its
    whole shape and mesh.

    Args:
        optimizer: any torch optimizer, or None.

    Returns:
        The model, or None when the optimizer's first parameter is no shard of a fully sharded model (or there is
        none); whether all of them are is the fit check's to say.
    """
    if optimizer is None or isinstance(optimizer, ShardedOptimizer):
        return None
    for group in optimizer.param_groups:
        for p in group["params"]:
            controller = FullyShardedModel.owning(p)
            return None if controller is None else controller.model
    return None
