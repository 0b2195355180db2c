"""PyTorch checkpoints on top of :mod:`hvps.checkpoint.manager`::

    import hvps.adapters.torch as hvd

    ckpt = hvd.CheckpointManager("/nfs/run1", keep_last=3, keep_every=10)
    start = ckpt.load(model=model, optimizer=optimizer)   # 0, or the saved epoch + 1
    for epoch in range(start, epochs):
        train_one_epoch(...)
        ckpt.save(epoch, model=model, optimizer=optimizer)

Every rank calls ``save`` and ``load`` (collective when hvps is initialized); only rank 0
reads or writes the files.  Saved: the module's ``state_dict()``; the optimizer's
``state_dict()`` (any ``torch.optim`` optimizer, ``hvd.DistributedOptimizer`` included):
``param_groups`` as a JSON attribute, per-parameter tensors as datasets; each rank's RNG
states (torch CPU and CUDA, numpy's global generator, Python's ``random``); optional
per-rank compression state and user extras.  bfloat16 and float8 tensors are stored as
integers of the same width with a ``dtype`` attribute.  No pickle is involved.

A :class:`ShardedOptimizer` (``hvd.DistributedOptimizer(..., shard=True)``) is passed the same way,
but its state is never gathered: every rank writes its own shard next to the version
(``optim-epoch-NNNNNN/``, so the directory must be shared by all ranks) and the dense file records
their manifest; ``load`` re-shards it for any rank count, or consolidates it into a plain torch
optimizer (see :mod:`hvps.adapters.torch.sharded_checkpoint`). A model changed by ``hvd.fully_shard``
(with its optimizer over the shards) is saved alike, parameters and optimizer state as per-rank
shards (``model-epoch-NNNNNN/``), and loads into a fully sharded model at any rank count or into
an unsharded model in one process (see :mod:`hvps.adapters.torch.fully_sharded_checkpoint`). A dense
version (a replicated run's) loads into a fully sharded model and its optimizer, or into a
``ShardedOptimizer``, at any rank count: each rank keeps its slices; so does a ``ShardedOptimizer`` run's version
(dense model, sharded optimizer state) into a fully sharded model and its optimizer. An optimizer over a fully
sharded model's shards loads alone too (``load(optimizer=opt)``): its shards know their model.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Mapping, Optional, Union

import numpy as np
import torch

import hvps.checkpoint.manager as _core
from hvps.checkpoint.format import CheckpointError
from hvps.core.views import as_array, as_tensor
from hvps.core.user_warnings import warn

from . import fully_sharded_checkpoint as _fully
from . import sharded_checkpoint as _sharded
from .sharded_optimizer import ShardedOptimizer


def tensor_to_array(tensor: torch.Tensor, where: str = "tensor") -> np.ndarray:
    """A CPU numpy array with the tensor's bytes (bfloat16 and float8 as ml_dtypes arrays)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_sparse or t.layout != torch.strided or t.is_quantized:
        raise CheckpointError(f"{where}: only dense tensors can be stored (got layout {t.layout})")
    try:
        return as_array(t.contiguous())
    except TypeError as exc:
        raise CheckpointError(f"{where}: tensors of dtype {t.dtype} cannot be stored") from exc


def array_to_tensor(array: np.ndarray) -> torch.Tensor:
    """The inverse of :func:`tensor_to_array` (shares memory with ``array``)."""
    return as_tensor(array)


def _to_neutral(value: Any, where: str) -> Any:
    """Tensors -> arrays inside nested mappings; other values untouched."""
    if isinstance(value, torch.Tensor):
        return tensor_to_array(value, where)
    if isinstance(value, Mapping):
        return {str(k): _to_neutral(v, f"{where}.{k}") for k, v in value.items()}
    return value


# ----------------------------------------------------------------------------- model
def model_state(model: Union[torch.nn.Module, Mapping]) -> dict:
    sd = model.state_dict() if isinstance(model, torch.nn.Module) else model
    return {k: tensor_to_array(v, f"model.{k}") if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def check_model(model: torch.nn.Module, saved: Mapping, path: Any) -> list:
    """Problems (missing / unexpected keys, shape and dtype mismatches) of loading ``saved``."""
    return check_state(model.state_dict(), saved)


def check_state(current: Mapping, saved: Mapping) -> list:
    """Problems (missing / unexpected keys, shape and dtype mismatches) of loading ``saved`` over ``current``.

    Args:
        current: the entries of a model's ``state_dict()`` to load.
        saved: the checkpoint's, as numpy arrays and values.

    Returns:
        One line a problem.
    """
    problems = []
    for k in current:
        if k not in saved:
            problems.append(f"missing in checkpoint: model.{k}")
    for k, v in saved.items():
        if k not in current:
            problems.append(f"unexpected in checkpoint: model.{k}")
            continue
        cur = current[k]
        if isinstance(v, np.ndarray) and isinstance(cur, torch.Tensor):
            if tuple(cur.shape) != v.shape:
                problems.append(f"shape mismatch: model.{k}: checkpoint {list(v.shape)}, model {list(cur.shape)}")
            elif array_to_tensor(v).dtype != cur.dtype:
                problems.append(f"dtype mismatch: model.{k}: checkpoint {v.dtype.name}, model {cur.dtype}")
    return problems


def apply_model(model: torch.nn.Module, saved: Mapping, strict: bool, path: Any,
                current: Optional[Mapping] = None) -> None:
    """Load ``saved`` into ``model`` (what fits, with a warning, unless ``strict``).

    Args:
        model: the module.
        saved: the checkpoint's model section (numpy arrays and values).
        strict: raise on any problem instead of warning.
        path: the checkpoint, for messages.
        current: the entries of ``model.state_dict()`` to load (default all).

    Raises:
        CheckpointError: ``strict`` and the checkpoint does not fit.
    """
    current = model.state_dict() if current is None else current
    problems = check_state(current, saved)
    if problems and strict:
        raise CheckpointError("the checkpoint does not fit this model (strict=True)", path, problems)
    if problems:
        warn(f"{path}: loading what fits; skipped: " + "; ".join(problems), RuntimeWarning)
    state = {}
    for k, v in saved.items():
        if k not in current:
            continue
        if isinstance(v, np.ndarray):
            t = array_to_tensor(v)
            if tuple(t.shape) != tuple(current[k].shape) or t.dtype != current[k].dtype:
                continue
            state[k] = t
        else:
            state[k] = v
    model.load_state_dict(state, strict=False)


# ----------------------------------------------------------------------------- optimizer
def optimizer_state(optimizer: Union[torch.optim.Optimizer, Mapping]) -> dict:
    is_opt = isinstance(optimizer, torch.optim.Optimizer)
    sd = optimizer.state_dict() if is_opt else optimizer
    inner = getattr(optimizer, "_inner", optimizer)
    out = {
        "param_groups": sd["param_groups"],
        "state": {str(k): _to_neutral(dict(v), f"optimizer.state.{k}") for k, v in sd["state"].items()},
    }
    if is_opt:
        out["class"] = type(inner).__name__
    for k, v in sd.items():
        if k not in ("state", "param_groups"):
            out.setdefault("extra", {})[k] = _to_neutral(v, f"optimizer.{k}")
    return out


def _int_key(k: str) -> Any:
    return int(k) if k.isdigit() else k


def check_optimizer(optimizer: torch.optim.Optimizer, saved: Mapping,
                    whole: Optional[Mapping[int, torch.Tensor]] = None) -> list:
    """Problems (class, parameter groups, state shapes) of loading the optimizer section ``saved``.

    Args:
        optimizer: the optimizer to load.
        saved: the checkpoint's optimizer section (the adapter's neutral format).
        whole: ``{id(parameter): tensor of the shape its saved state has}`` where that is not the parameter's
            own (the shards of a fully sharded model: the whole parameter's).

    Returns:
        One line a problem.
    """
    whole = {} if whole is None else whole
    problems = []
    # a sharded optimizer loads a plain one's state (it keeps its shard): the class is the one it wraps
    inner = optimizer.shard_optimizer if isinstance(optimizer, ShardedOptimizer) else getattr(optimizer, "_inner",
                                                                                              optimizer)
    cls = saved.get("class")
    if cls is not None and cls != type(inner).__name__:
        problems.append(f"optimizer class: checkpoint {cls}, given {type(inner).__name__}")
    groups = saved.get("param_groups", [])
    cur_groups = optimizer.param_groups
    if len(groups) != len(cur_groups):
        problems.append(f"optimizer param_groups: checkpoint has {len(groups)}, optimizer {len(cur_groups)}")
        return problems
    params = {}
    for gi, (g, cg) in enumerate(zip(groups, cur_groups)):
        if len(g["params"]) != len(cg["params"]):
            problems.append(f"optimizer param_groups[{gi}]: checkpoint has {len(g['params'])} parameters, "
                            f"optimizer {len(cg['params'])}")
            continue
        params.update(zip(g["params"], cg["params"]))
    for key, st in saved.get("state", {}).items():
        p = params.get(_int_key(key))
        if p is None:
            problems.append(f"optimizer state for parameter {key}, which is in no param_group")
            continue
        shape = tuple(whole.get(id(p), p).shape)
        for name, v in st.items():
            if isinstance(v, np.ndarray) and v.ndim and tuple(v.shape) != shape:
                problems.append(f"shape mismatch: optimizer.state.{key}.{name}: checkpoint {list(v.shape)}, "
                                f"parameter {list(shape)}")
    return problems


def apply_optimizer(optimizer: torch.optim.Optimizer, saved: Mapping, path: Any) -> None:
    problems = check_optimizer(optimizer, saved)
    if problems:
        raise CheckpointError("the checkpoint's optimizer state does not fit this optimizer", path, problems)
    state = {}
    for key, st in saved.get("state", {}).items():
        state[_int_key(key)] = {k: (array_to_tensor(v).clone() if isinstance(v, np.ndarray) else v)
                                for k, v in st.items()}
    sd = {"state": state, "param_groups": [dict(g) for g in saved["param_groups"]]}
    for k, v in saved.get("extra", {}).items():
        sd[k] = v
    optimizer.load_state_dict(sd)


# ----------------------------------------------------------------------------- RNG
def rng_state() -> dict:
    """This process's torch (CPU, CUDA), numpy (global) and Python ``random`` states."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    out = {
        "torch": tensor_to_array(torch.get_rng_state(), "rng.torch"),
        "numpy": {"kind": str(kind), "keys": np.asarray(keys, dtype=np.uint32), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": int(version), "state": np.asarray(internal, dtype=np.uint64),
                   "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = {str(i): tensor_to_array(s, f"rng.cuda.{i}") for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return out


def set_rng_state(saved: Mapping) -> None:
    if "torch" in saved:
        torch.set_rng_state(torch.from_numpy(np.array(saved["torch"], dtype=np.uint8)))
    if "numpy" in saved:
        n = saved["numpy"]
        np.random.set_state((n["kind"], np.array(n["keys"], dtype=np.uint32), int(n["pos"]),
                             int(n["has_gauss"]), float(n["cached_gaussian"])))
    if "python" in saved:
        p = saved["python"]
        random.setstate((int(p["version"]), tuple(int(x) for x in p["state"]), p["gauss_next"]))
    if "cuda" in saved and torch.cuda.is_available():
        states = [torch.from_numpy(np.array(saved["cuda"][k], dtype=np.uint8))
                  for k in sorted(saved["cuda"], key=int)]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
        else:
            warn(f"checkpoint has CUDA RNG states for {len(states)} devices, this process sees "
                 f"{torch.cuda.device_count()}: CUDA RNG left as is", RuntimeWarning)


# ----------------------------------------------------------------------------- manager
class CheckpointManager(_core.CheckpointManager):
    """:class:`hvps.checkpoint.CheckpointManager` that takes torch modules and optimizers.

    ``save(epoch, model=module, optimizer=opt, extra=..., compression_state=..., step=...,
    rng=True)`` and ``load(version="latest", model=module, optimizer=opt)`` (returns the
    epoch to resume from: saved epoch + 1, or 0 when there is no checkpoint).  After
    ``load``, ``self.loaded`` holds the :class:`hvps.checkpoint.Checkpoint` (numpy views;
    ``compression_state`` converted to tensors).
    """

    framework = "torch"

    def framework_version(self) -> str:
        """The version of torch, recorded in each checkpoint.

        Returns:
            ``torch.__version__``.
        """
        return torch.__version__

    def save(self, epoch: int, model: Any = None, optimizer: Any = None, extra: Optional[Mapping] = None,
             compression_state: Any = None, step: Optional[int] = None, rng: Any = True):
        """Save ``epoch`` (a finished epoch) as a new version; collective.

        The model and a replicated optimizer are written by rank 0; a ``ShardedOptimizer``'s state and a
        ``hvd.fully_shard`` model's parameters and optimizer state are written by every rank, its own shard,
        before rank 0's dense file commits the version.

        Args:
            epoch: the epoch just finished (>= 0); ``load`` returns it + 1.
            model: a ``torch.nn.Module`` (fully sharded or not), or None.
            optimizer: its optimizer (plain, ``DistributedOptimizer``, ``ShardedOptimizer``, or the optimizer
                over a fully sharded model's shards), or None.
            extra: more values to keep (tensors become arrays, also inside nested mappings), from rank 0.
            compression_state: a mapping name -> tensor, or an object with ``state_dict()`` (PowerSGD's
                factors, error feedback); each rank's is kept.
            step: the global step, kept beside the epoch.
            rng: True captures this rank's RNG states, False none; a mapping is stored as given.

        Returns:
            The version's path on rank 0, None on the other ranks.

        Raises:
            ValueError: ``epoch`` is negative.
            CheckpointError: on every rank, when the version could not be written (the previous versions stay
                intact).
        """
        if compression_state is not None and hasattr(compression_state, "state_dict"):
            compression_state = compression_state.state_dict()
        if rng is True:
            rng = rng_state()
        elif rng is False:
            rng = None
        fully_sharded = _fully.is_fully_sharded_model(model)
        if (fully_sharded or isinstance(optimizer, ShardedOptimizer)) and int(epoch) < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        # sharded state: every rank writes its own shards first; the dense file below commits them
        if fully_sharded:  # the optimizer's state lies in the model's shards
            manifest = _fully.save_model_shards(self, epoch, model, optimizer, step)
            model_section, optimizer_section = {_fully.SECTION: manifest,
                                                "buffers": model_state(_fully.buffers_of(model))}, None
        else:
            model_section = None if model is None else model_state(model)
            optimizer_section = None if optimizer is None else (
                _sharded.save_optimizer_shards(self, epoch, optimizer, step) if isinstance(optimizer, ShardedOptimizer)
                else optimizer_state(optimizer))
        path = super().save(
            epoch,
            model=model_section,
            optimizer=optimizer_section,
            extra=None if extra is None else _to_neutral(extra, "extra"),
            compression_state=None if compression_state is None else _to_neutral(compression_state, "compression"),
            step=step, rng=None if rng is None else _to_neutral(rng, "rng"))
        if path is not None:  # the root: drop the shard folders of versions retention removed
            _sharded.tidy(self, int(epoch))
            _fully.tidy(self, int(epoch))
        return path

    def load(self, version: Union[str, int] = "latest", drop_compression_state: bool = False, *,
             model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
             compression: Any = None, restore_rng: bool = True, strict: bool = True) -> int:
        """Load a version on every rank and restore ``model`` / ``optimizer`` (and this
        rank's RNG states unless ``restore_rng=False``) in place; collective.

        Before anything is changed, the checkpoint is compared with the model and the
        optimizer: missing or unexpected keys and shape or dtype mismatches raise one
        CheckpointError listing them all (``strict=False`` loads what fits and warns).
        Sharded state (stage 1–2 or ``fully_shard``) is re-sharded to this job's rank count.

        ``optimizer`` alone (no ``model``) over a ``hvd.fully_shard`` model's shards loads its state from any
        checkpoint a fully sharded model loads: its shards name their model (the whole shapes, names and this
        rank's slices), whose parameters are left as they are.

        Args:
            version: ``"latest"`` (the newest valid version; a damaged one is skipped for the one before it)
                or an epoch.
            drop_compression_state: ignore the saved compression state.
            model: the model to restore (fully sharded or not), or None.
            optimizer: the optimizer to restore, or None.
            compression: an object with ``load_state_dict``; it receives this rank's saved compression state.
            restore_rng: restore this rank's RNG states.
            strict: False loads what fits and warns about the rest.

        Returns:
            The saved epoch + 1, or 0 when ``version="latest"`` finds nothing to load.

        Raises:
            ValueError: ``version`` is neither ``"latest"`` nor an epoch number.
            CheckpointError: on every rank: the version does not fit the model or optimizer (all problems
                listed); an explicit ``version`` is missing or damaged; per-rank compression state saved by
                another number of ranks (unless ``drop_compression_state``).
        """
        start = super().load(version, drop_compression_state=drop_compression_state)
        # an optimizer over a fully sharded model's shards, given alone: its model says where its slices lie
        owner = model if model is not None else _fully.model_of_optimizer(optimizer)
        start, staged = self.stage_shards(
            version, start, lambda ck: self._shard_reader(ck, owner, optimizer, parameters=model is not None),
            drop_compression_state)
        ck = self.loaded
        if ck is None:
            return start
        ck.compression_state = {k: (array_to_tensor(v) if isinstance(v, np.ndarray) else v)
                                for k, v in ck.compression_state.items()}
        if isinstance(staged, tuple) and staged[0] == "dense":  # read from shards into dense sections
            ck = dataclasses.replace(ck, model=ck.model if staged[1] is None else staged[1],
                                     optimizer=ck.optimizer if staged[2] is None else staged[2])
            staged = None
        problems = []
        if isinstance(staged, _fully.Staged):  # the parameters are staged: the buffers are the model's rest
            if strict and model is not None:
                problems += check_state(_fully.buffers_of(model), staged.buffers)
        elif model is not None and strict:
            problems += check_model(model, ck.model, ck.path)
        if optimizer is not None and staged is None:
            problems += check_optimizer(optimizer, ck.optimizer) if ck.optimizer else \
                ["the checkpoint holds no optimizer state"]
        if problems:
            raise CheckpointError("the checkpoint does not fit the given model/optimizer", ck.path, problems)
        if isinstance(staged, _fully.Staged):
            _fully.apply_staged(staged, owner, optimizer)
            if model is not None:
                apply_model(model, staged.buffers, strict, ck.path, current=_fully.buffers_of(model))
        elif model is not None:
            apply_model(model, ck.model, strict, ck.path)
        if isinstance(staged, tuple):  # a ShardedOptimizer's own shard
            optimizer.load_local_state(staged[1], staged[2])
        elif optimizer is not None and staged is None:
            apply_optimizer(optimizer, ck.optimizer, ck.path)
        if compression is not None:
            compression.load_state_dict(ck.compression_state)
        if restore_rng and ck.rng is not None:
            set_rng_state(ck.rng)
        return start

    def _shard_reader(self, ck: Any, model: Any, optimizer: Any, parameters: bool = True) -> Optional[tuple]:
        """``(check the fit, stage, what)`` for a version whose state lies in per-rank shards that ``model`` or
        ``optimizer`` load, or for a dense version that a fully sharded ``model`` loads (each rank its slices);
        None for a dense version loaded as it is (or nothing to load from the shards). ``parameters`` False: a
        fully sharded ``model`` only places its ``optimizer``'s slices (its own parameters are not loaded)."""
        if (_fully.is_fully_sharded_model(model) and not _fully.is_fully_sharded(ck.model)
                and optimizer is not None and _sharded.is_sharded_manifest(ck.optimizer)):
            return (lambda: _stage12_fits_fully_sharded(ck, model, optimizer, parameters),
                    lambda: _fully.stage_sharded_optimizer(self.directory, ck, model, optimizer,
                                                           parameters=parameters),
                    "the stage 1-2 checkpoint does not fit the given fully sharded model/optimizer")
        if _fully.is_fully_sharded_model(model) and not _fully.is_fully_sharded(ck.model):
            return (lambda: _dense_fits_fully_sharded(ck, model, optimizer, parameters),
                    lambda: _fully.stage_dense(ck, model, optimizer, parameters=parameters),
                    "the dense checkpoint does not fit the given fully sharded model/optimizer")
        if _fully.is_fully_sharded(ck.model) and (model is not None or optimizer is not None):
            return (lambda: _fully.check_fit(ck, model, optimizer),
                    lambda: _dense_or_staged(_fully.stage(self.directory, ck, model, optimizer,
                                                          parameters=parameters)),
                    "the checkpoint's fully sharded model does not fit the given model/optimizer")
        if optimizer is not None and _sharded.is_sharded_manifest(ck.optimizer):
            return (lambda: _sharded.check_fit(ck.optimizer, optimizer, ck.path),
                    lambda: _sharded_optimizer_staged(_sharded.stage_optimizer(self.directory, ck, optimizer)),
                    "the checkpoint's sharded optimizer state does not fit this optimizer")
        return None


def _whole_parameter_problems(ck: Any, model: torch.nn.Module, parameters: bool) -> tuple:
    """The whole parameters of the fully sharded ``model`` (meta tensors, by name) and the problems of loading the
    version ``ck``'s dense parameters into them (none asked when not ``parameters``)."""
    whole = _fully.whole_parameters(model)
    return whole, check_state(whole, {k: v for k, v in (ck.model or {}).items() if k in whole}) if parameters else []


def _dense_fits_fully_sharded(ck: Any, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                              parameters: bool = True) -> list:
    """Problems of loading the dense version ``ck`` into a fully sharded ``model`` and its ``optimizer``: its
    parameters (missing, or of another shape or dtype than the whole parameter; unless not ``parameters``) and its
    optimizer state (as :func:`check_optimizer`, over the whole parameters). Buffers are left to the caller
    (``strict``)."""
    whole, problems = _whole_parameter_problems(ck, model, parameters)
    if optimizer is None:
        return problems
    if isinstance(optimizer, ShardedOptimizer):
        return problems + ["a ShardedOptimizer over a fully sharded model is not supported"]
    if not ck.optimizer:
        return problems + ["the checkpoint holds no optimizer state"]
    by_id = {id(p): whole[name] for name, p in model.named_parameters(remove_duplicate=False)}
    if any(id(p) not in by_id for g in optimizer.param_groups for p in g["params"]):
        return problems + ["the optimizer holds a parameter that is not a shard of the fully sharded model: build "
                           "it over model.parameters() after hvd.fully_shard(model)"]
    return problems + check_optimizer(optimizer, ck.optimizer, whole=by_id)


def _stage12_fits_fully_sharded(ck: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                parameters: bool) -> list:
    """Problems of loading the stage 1-2 version ``ck`` (dense model, sharded optimizer manifest) into a fully
    sharded ``model`` (its parameters unless not ``parameters``) and its ``optimizer``: the parameters as
    :func:`_dense_fits_fully_sharded`, the manifest as
    :func:`hvps.adapters.torch.fully_sharded_checkpoint.sharded_optimizer_misfit`."""
    _, problems = _whole_parameter_problems(ck, model, parameters)
    return problems + _fully.sharded_optimizer_misfit(ck, model, optimizer)


def _dense_or_staged(staged: Any) -> Any:
    """A fully sharded model's staged state, or its state read whole as dense sections."""
    return staged if isinstance(staged, _fully.Staged) else ("dense", *staged)


def _sharded_optimizer_staged(staged: tuple) -> tuple:
    """A ShardedOptimizer's own shard, or its state consolidated as a dense optimizer section."""
    kind, state, groups = staged
    return ("sharded", state, groups) if kind == "sharded" else ("dense", None, state)


__all__ = ["CheckpointManager", "CheckpointError", "tensor_to_array", "array_to_tensor", "rng_state", "set_rng_state"]
