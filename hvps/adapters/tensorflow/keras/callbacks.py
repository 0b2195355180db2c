"""Keras 3 callbacks with Horovod's names and arguments."""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Optional, Sequence, Union

import keras
import numpy as np

import hvps
from hvps.checkpoint import sharded_optimizer_state as _state
from hvps.core.user_warnings import warn

from ..functions import broadcast_variables
from ..keras_sharded_optimizer import ShardedOptimizer
from . import sharded_checkpoint as _sharded


def _optimizer_variables(optimizer: Any) -> list:
    if optimizer is None or not getattr(optimizer, "built", False):
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Start every rank from the root's model and optimizer state.

    Broadcasts ``model.weights`` and the optimizer's variables when training
    begins (Keras 3 builds the optimizer before that); an optimizer that is
    not built yet is broadcast after the first batch, as Horovod does. ``local_variables`` (each
    rank's own, such as a model-parallel layer's weights) are left out of the broadcast.
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Optional[Sequence] = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self._local = {id(v) for v in (local_variables or ())}

    def _broadcast(self) -> bool:
        optimizer = getattr(self.model, "optimizer", None)
        opt_vars = _optimizer_variables(optimizer)
        shared = [v for v in list(self.model.weights) + opt_vars if id(v) not in self._local]
        broadcast_variables(shared, root_rank=self.root_rank)
        return optimizer is None or bool(opt_vars)

    def on_train_begin(self, logs=None):
        if not self.broadcast_done:
            self.broadcast_done = self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()
            self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace the epoch's logged metrics (including ``val_*``) by their mean over ranks.

    Put it before callbacks that read the metrics (checkpointing, early stopping,
    LR on plateau); Keras's History comes last and records the averaged values.
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and isinstance(v, (int, float, np.number)))
        if not keys:
            return
        values = np.asarray([float(logs[k]) for k in keys], dtype=np.float64)
        averaged = hvps.allreduce(values, op=hvps.Average, name=f"MetricAverageCallback.{len(keys)}")
        for k, v in zip(keys, averaged):
            logs[k] = float(v)


class CompressionEpochCallback(keras.callbacks.Callback):
    """Call ``set_epoch(epoch)`` on the model's DistributedOptimizer at the start of every epoch,
    which steps DGC's density warm-up (other compressions ignore it)."""

    def on_epoch_begin(self, epoch, logs=None):
        set_epoch = getattr(getattr(self.model, "optimizer", None), "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` between ``start_epoch`` and ``end_epoch``.

    ``multiplier`` is a function of the (fractional, when ``staircase=False``)
    epoch, or a number ``m`` meaning ``m ** epoch``. ``momentum_correction``
    is accepted for Horovod compatibility, but Keras 3 optimizers keep
    ``momentum`` as a Python float compiled into the train function, so it is
    not applied (a warning says so once).
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]], start_epoch: int = 0,
                 end_epoch: Optional[int] = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("initial_lr is required")
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch, m=float(multiplier): m ** epoch)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0
        self._warned_momentum = False

    def _in_range(self, epoch: float) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _set_lr(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)
        if self.momentum_correction and hasattr(optimizer, "momentum") and not self._warned_momentum:
            self._warned_momentum = True
            warn("momentum_correction is not applied: Keras 3 compiles the optimizer's momentum into the "
                 "train function")

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ValueError(f"{type(self).__name__}: pass steps_per_epoch (Keras did not say how many "
                                 "steps an epoch has)")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if not self._in_range(self.current_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._set_lr(self.current_epoch)
        else:
            self._set_lr(self.current_epoch + batch / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``
    (Goyal et al., "Accurate, Large Minibatch SGD"), per batch."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            epoch += 1.0 / self.steps_per_epoch  # reach exactly 1 at the end of the last warm-up epoch
            n = hvps.size()
            return (epoch * (n - 1) / warmup_epochs + 1) / n

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch, verbose=verbose)
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose and hvps.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)):g}.")


class CheckpointCallback(keras.callbacks.Callback):
    """Save versioned HDF5 checkpoints (``hvps.checkpoint``) every ``every`` epochs.

    Collective: every rank runs it, the root writes. The model's weights and
    the optimizer's variables are stored by position (their Keras paths go in
    ``extra``), with the epoch's logs. ``restore(model)`` loads the newest good
    version into a built model (and its optimizer) and returns the epoch to
    pass as ``initial_epoch``.

    A sharded optimizer (``hvd.DistributedOptimizer(opt, shard=True)``) is never gathered: every rank writes
    its own shard of the state beside the version and the version records their manifest (the directory must
    be shared by all ranks; see :mod:`hvps.adapters.tensorflow.keras.sharded_checkpoint`). ``restore`` reads it
    back into a sharded optimizer at any rank count, or into a plain Keras optimizer (consolidated), and falls
    back to the previous version when a shard is missing, damaged or of another model.

    Args:
        directory: where the versions live (shared by every rank for a sharded optimizer).
        every: save after every ``every``-th epoch.
        keep_last: as :class:`hvps.checkpoint.CheckpointManager`'s.
        keep_every: as :class:`hvps.checkpoint.CheckpointManager`'s.
        compress: as :class:`hvps.checkpoint.CheckpointManager`'s.
        root_rank: the rank that writes the dense file.
        fsync: as :class:`hvps.checkpoint.CheckpointManager`'s.

    Raises:
        ValueError: ``every`` is below 1 (or ``keep_last``, ``keep_every`` are).
    """

    def __init__(self, directory: Union[str, os.PathLike], every: int = 1, keep_last: Optional[int] = 3,
                 keep_every: Optional[int] = None, compress: bool = False, root_rank: int = 0,
                 fsync: bool = True) -> None:
        super().__init__()
        from hvps.checkpoint.manager import CheckpointManager

        if every < 1:
            raise ValueError("every must be >= 1")
        self.every = every
        self.manager = CheckpointManager(directory, keep_last=keep_last, keep_every=keep_every, compress=compress,
                                         root_rank=root_rank, fsync=fsync)

    @staticmethod
    def _arrays(variables: list) -> dict:
        return {f"{i:05d}": np.array(keras.ops.convert_to_numpy(v)) for i, v in enumerate(variables)}

    def on_epoch_end(self, epoch, logs=None):
        if (epoch + 1) % self.every:
            return
        weights = list(self.model.weights)
        optimizer = getattr(self.model, "optimizer", None)
        if isinstance(optimizer, ShardedOptimizer):
            _built(optimizer, self.model)
            opt_vars, section = [], _sharded.save_optimizer_shards(self.manager, epoch, optimizer, None)
        else:
            opt_vars = _optimizer_variables(optimizer)
            section = self._arrays(opt_vars)
        logs = {k: float(v) for k, v in (logs or {}).items()
                if np.ndim(v) == 0 and isinstance(v, (int, float, np.number)) and math.isfinite(float(v))}
        path = self.manager.save(epoch, model=self._arrays(weights), optimizer=section,
                                 extra={"weight_paths": [getattr(v, "path", v.name) for v in weights],
                                        "optimizer_paths": [getattr(v, "path", v.name) for v in opt_vars],
                                        "logs": logs})
        if path is not None:  # the root: drop the shard folders of versions retention removed
            _state.tidy(self.manager, int(epoch))

    def restore(self, model: keras.Model, version: Union[str, int] = "latest") -> int:
        """Load a saved version into ``model`` (and its optimizer); return the epoch to resume at (0: none).

        Collective. A sharded optimizer, and a plain one given a sharded checkpoint, are built over the model's
        trainable variables first if they are not yet.

        Args:
            model: a built Keras model (with its optimizer, if the optimizer's state is to be restored).
            version: ``"latest"`` (the newest good version) or an epoch.

        Returns:
            The epoch to pass as ``initial_epoch``: the saved epoch + 1, or 0 when there is none.

        Raises:
            CheckpointError: a version that cannot be read (an explicit ``version``), or a sharded optimizer
                state that does not fit the model's optimizer.
            ValueError: the checkpoint does not fit the model, or a sharded optimizer is given a checkpoint
                of a replicated one (whose state is stored by position, not by key).
        """
        optimizer = getattr(model, "optimizer", None)
        start = self.manager.load(version)
        staged = None
        if optimizer is not None and self.manager.loaded is not None and (
                isinstance(optimizer, ShardedOptimizer) or _state.is_sharded_manifest(self.manager.loaded.optimizer)):
            _built(optimizer, model)
            start, staged = self.manager.stage_shards(
                version, start, lambda ck: _sharded.shard_reader(self.manager.directory, ck, model, optimizer),
                drop=False)
        ckpt = self.manager.loaded
        if ckpt is None:
            return 0
        if staged is None and isinstance(optimizer, ShardedOptimizer):
            raise ValueError(f"checkpoint {ckpt.path} holds a replicated optimizer's variables (by position): a "
                             "sharded optimizer restores the state of a sharded one (by key)")
        targets = [(list(model.weights), ckpt.model)]
        if staged is None:
            targets.append((_optimizer_variables(optimizer), ckpt.optimizer))
        for target, saved in targets:
            if not target:
                continue
            if len(saved) != len(target):
                raise ValueError(f"checkpoint {ckpt.path} holds {len(saved)} arrays where the model has {len(target)}")
            for i, v in enumerate(target):
                v.assign(saved[f"{i:05d}"])
        if staged is not None:
            _sharded.apply_staged(staged, model, optimizer)
        return start


def _built(optimizer: Any, model: keras.Model) -> None:
    """Build ``optimizer`` over ``model``'s trainable variables unless it is (collective for a sharded one)."""
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
