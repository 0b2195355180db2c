"""Checkpoints of the Keras ``ShardedOptimizer`` as per-rank shards plus a manifest, loadable at any rank count.

What ``hvd.callbacks.CheckpointCallback`` does with a model compiled with ``hvd.DistributedOptimizer(opt,
shard=True)``: the optimizer state is never gathered. Every rank writes its own block of every bucket's
element-wise state (Adam's moments, SGD's momentum) into ``optim-epoch-N/optimizer.<rank>-of-<size>.h5`` beside
the version (so the directory must be shared by all ranks), and the dense file of the version (rank 0, written
last: the commit record) holds their manifest as its ``optimizer`` section: the files, layout and checks are
those of the torch sharded optimizer's checkpoints (:mod:`hvps.checkpoint.sharded_optimizer_state`), with the
shards' ``framework`` attribute ``hvps.keras_sharded_optimizer``.

The state is found in the inner Keras optimizer by Keras's own naming: an optimizer variable made by
``add_variable_from_reference(shard, key)`` is named ``<shard path with _>_<key>``, so ``key`` (``momentum``,
``velocity``, ...) names the dataset; state of shape ``()`` (the step count ``iteration``, a variable
``learning_rate``, Nadam's ``variable``) is the same on every rank and goes into the manifest as each bucket's
scalars. A plain Keras optimizer's variables are named alike after the model's variables, which is how a
sharded checkpoint is restored into one (in one process, for inference or export: the state is consolidated,
every rank reading every shard it needs).

Restoring (``CheckpointCallback.restore``, collective) treats all of it as untrusted, as the torch loader does:
a shard that is missing, damaged, disagrees with the manifest or comes from another model makes the version fail
on every rank, and ``restore("latest")`` warns and falls back to the previous version; a manifest that does not
fit the model (other shapes or dtypes; names are not compared, since Keras numbers layers per process) or the
optimizer (another class, other state) raises ``CheckpointError``. Into a ``ShardedOptimizer`` at any rank
count M, each rank reads only the ranges of the saved shards its new blocks need.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping, Optional

import keras
import numpy as np

from hvps.checkpoint import sharded_optimizer_state as _state
from hvps.checkpoint.format import CheckpointError, logical_dtype
from hvps.checkpoint.sharded_buffers import DTYPES

from ..gradients import variable_name
from ..keras_sharded_optimizer import ShardedOptimizer

FRAMEWORK = "hvps.keras_sharded_optimizer"  # the shards' root attribute "framework"
#: the number Keras appends to the name of an unnamed variable (Nadam's ``variable_2``), different per process
_AUTO_NUMBER = re.compile(r"_\d+$")

__all__ = ["FRAMEWORK", "save_optimizer_shards", "shard_reader", "apply_staged", "state_slots", "decode_scalar"]


def _prefix(reference: Any) -> str:
    """What Keras's ``add_variable_from_reference`` puts before the state's key in its variable's name."""
    path = getattr(reference, "path", None)
    if path is not None:
        return f"{path.replace('/', '_')}_"
    return f"{str(reference.name).replace('/', '_').replace(':', '_')}_"


def state_slots(optimizer: keras.optimizers.Optimizer, references: list) -> tuple:
    """The state variables of a built Keras ``optimizer`` over ``references``, by key.

    Args:
        optimizer: a plain Keras optimizer (a ``ShardedOptimizer``'s ``inner_optimizer``), built.
        references: the variables it was built over, in order.

    Returns:
        ``(per reference: [{key: state variable}], scalars: {key: variable of shape ()})``; a scalar's key is its
        name without the number Keras may append (``variable_2`` -> ``variable``), made unique in the order of
        ``optimizer.variables`` (``beta_1``, ``beta_2`` -> ``beta``, ``beta_1``).

    Raises:
        CheckpointError: a state variable that is neither a scalar nor named after one of ``references`` with
            its shape (it could not be saved or restored by key).
    """
    prefixes = sorted(((_prefix(r), i) for i, r in enumerate(references)), key=lambda p: -len(p[0]))
    per: list = [{} for _ in references]
    scalars: dict = {}
    for v in optimizer.variables:
        if len(v.shape) == 0:
            key = _AUTO_NUMBER.sub("", v.name)
            scalars[_first_free(key, scalars)] = v
            continue
        for prefix, i in prefixes:
            if v.name.startswith(prefix) and tuple(v.shape) == tuple(references[i].shape):
                per[i][v.name[len(prefix):]] = v
                break
        else:
            raise CheckpointError(f"optimizer state {v.name!r} of shape {tuple(v.shape)} is neither a scalar nor "
                                  "named after one of the variables it updates: it cannot be checkpointed by key")
    return per, scalars


def _first_free(key: str, taken: dict) -> str:
    """``key``, or ``key_1``, ``key_2``, ... : the first not in ``taken``."""
    n, found = 0, key
    while found in taken:
        n += 1
        found = f"{key}_{n}"
    return found


def _encode(name: str, variable: Any) -> dict:
    dtype = str(variable.dtype)
    if dtype not in DTYPES:
        raise CheckpointError(f"optimizer state {name!r} of dtype {dtype} cannot be saved as shards")
    return {"tensor": dtype, "value": np.asarray(keras.ops.convert_to_numpy(variable)).item()}


def decode_scalar(encoded: dict) -> Any:
    """A manifest's scalar state (``{"value": v}`` or ``{"tensor": dtype, "value": v}``) as a numpy value."""
    if "tensor" in encoded:
        return np.asarray(encoded["value"], dtype=logical_dtype(encoded["tensor"], "scalar state"))
    return encoded["value"]


def _numpy(variable: Any) -> np.ndarray:
    return np.ascontiguousarray(keras.ops.convert_to_numpy(variable)).reshape(-1)


# ----------------------------------------------------------------------------- saving
def save_optimizer_shards(manager: Any, epoch: int, optimizer: ShardedOptimizer, step: Optional[int]) -> dict:
    """Write every rank's shard of ``optimizer``'s state for version ``epoch`` (collective over the job).

    Args:
        manager: the ``CheckpointManager`` (its ``directory`` and ``fsync``).
        epoch: the version being saved.
        optimizer: the sharded optimizer, built; its process set must be every rank of the job.
        step: the step recorded in the shards' root attributes.

    Returns:
        The section to save as the dense checkpoint's ``optimizer`` (JSON-able, the same on every rank).

    Raises:
        CheckpointError: on every rank, when a rank could not write its shard (earlier versions stay intact);
            state that cannot be saved by key.
    """
    layout = optimizer.shard_layout()
    slots, scalars = state_slots(optimizer.inner_optimizer, optimizer.shard_variables)
    encoded = {name: _encode(name, v) for name, v in scalars.items()}
    arrays, buckets = {}, []
    for b, bucket in enumerate(layout["buckets"]):
        clash = sorted(set(slots[b]) & set(encoded))
        if clash:
            raise CheckpointError(f"optimizer state {clash[0]!r} is both a scalar and element-wise")
        arrays[b] = {key: _numpy(v) for key, v in slots[b].items()}
        buckets.append(dict(bucket, keys={key: str(v.dtype) for key, v in slots[b].items()}, scalars=encoded))
    head = {"class": type(optimizer.inner_optimizer).__name__,
            "param_groups": [{"params": list(range(len(layout["params"])))}], "buckets": buckets}
    return _state.save_shards(manager, epoch, step, optimizer.process_set, layout, arrays, head,
                              (FRAMEWORK, keras.__version__))


# ----------------------------------------------------------------------------- restoring
def _target(model: keras.Model, optimizer: keras.optimizers.Optimizer) -> tuple:
    """``(inner optimizer, its references, parameter list)`` of what a sharded checkpoint restores into."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.inner_optimizer, optimizer.shard_variables, optimizer.shard_layout()["params"]
    variables = list(model.trainable_variables)
    return getattr(optimizer, "inner_optimizer", optimizer), variables, [[variable_name(v, f"variable{i}"), [int(d) for d in v.shape], str(v.dtype), True]
                                  for i, v in enumerate(variables)]


def _check_fit(section: Mapping, model: keras.Model, optimizer: keras.optimizers.Optimizer, path: Any) -> list:
    """Problems of restoring the manifest in ``section`` into ``model``'s ``optimizer`` (the same on every rank)."""
    manifest = _state.manifest_of(section, path)
    inner, references, params = _target(model, optimizer)
    problems = []
    if manifest["class"] != type(inner).__name__:
        problems.append(f"optimizer class: checkpoint {manifest['class'][:60]}, given {type(inner).__name__}")
    problems += _state.misfit_params(manifest["params"], params, lambda a, b: False)
    if problems:
        return problems
    slots, scalars = state_slots(inner, references)
    saved = manifest["buckets"][0]
    mine = (sorted(slots[0]) if slots else [], sorted(scalars))
    if (sorted(saved["keys"]), sorted(saved["scalars"])) != mine:
        problems.append(f"optimizer state: checkpoint has {sorted(saved['keys'])} and scalars "
                        f"{sorted(saved['scalars'])}, the optimizer {mine[0]} and {mine[1]} (another configuration)")
    return problems


def _stage(directory: os.PathLike, checkpoint: Any, optimizer: keras.optimizers.Optimizer) -> tuple:
    """Read (and verify) what ``optimizer`` needs of the version's shards; nothing is changed."""
    manifest = _state.manifest_of(checkpoint.optimizer, checkpoint.path)
    with _state.open_shards(directory, manifest, checkpoint.epoch, FRAMEWORK) as shards:
        if isinstance(optimizer, ShardedOptimizer):
            return "sharded", _state.stage_sharded(shards, manifest, optimizer.shard_layout(),
                                                   optimizer.process_set.rank(), decode_scalar)
        return "plain", _state.stage_consolidated(shards, manifest, decode_scalar)


def shard_reader(directory: os.PathLike, checkpoint: Any, model: keras.Model,
                 optimizer: keras.optimizers.Optimizer) -> Optional[tuple]:
    """What ``CheckpointManager.stage_shards`` needs to restore a version's sharded optimizer state.

    Args:
        directory: the checkpoint directory.
        checkpoint: the loaded version.
        model: the model being restored.
        optimizer: its optimizer, built: a ``ShardedOptimizer`` at any rank count or a plain Keras optimizer.

    Returns:
        ``(check the fit, stage, what a misfit is)``, or None when the version's optimizer state is not sharded.
    """
    if not _state.is_sharded_manifest(checkpoint.optimizer):
        return None
    return (lambda: _check_fit(checkpoint.optimizer, model, optimizer, checkpoint.path),
            lambda: _stage(directory, checkpoint, optimizer),
            "the checkpoint's sharded optimizer state does not fit this model's optimizer")


def apply_staged(staged: tuple, model: keras.Model, optimizer: keras.optimizers.Optimizer) -> None:
    """Install what :func:`shard_reader`'s stage read into ``optimizer`` (no communication).

    Args:
        staged: ``("sharded", {bucket: {key: value}})`` or ``("plain", {variable index: {key: value}})``.
        model: the model restored.
        optimizer: the optimizer it was staged for.
    """
    _, state = staged
    inner, references, _ = _target(model, optimizer)
    slots, scalars = state_slots(inner, references)
    for index, entry in state.items():
        for key, value in entry.items():
            if key in scalars:
                scalars[key].assign(value)
            else:
                slots[index][key].assign(value)
