"""``hvd.elastic`` for TensorFlow 2 and Keras 3, with Horovod's semantics (``horovod.tensorflow.elastic``,
``horovod.tensorflow.keras.elastic``; ``hvps.adapters.tensorflow.keras`` exports this module too).

``TensorFlowKerasState(model, optimizer)`` (or ``KerasState``) and ``TensorFlowState(variables)`` keep host
copies of the variables at each ``commit()``, put them back on ``restore()`` and broadcast them from
rank 0 on ``sync()``; ``@hvd.elastic.run`` wraps the training function in the retry loop of
:mod:`hvps.elastic.loop`. The Keras callbacks (``CommitStateCallback``, ``UpdateBatchStateCallback``,
``UpdateEpochStateCallback``) drive a state from ``model.fit``; they are built on first use, so that
importing the TensorFlow adapter does not import Keras. Only eager TensorFlow 2 is supported (no TF1
sessions). What works without an elastic launcher is in the README's "Elastic training".

A sharded Keras optimizer (``hvd.DistributedOptimizer(opt, shard=True)``) holds 1/N of its state on each rank,
outside ``optimizer.variables``: the state keeps it with :class:`KerasShardsHandler`, which at each commit keeps
this rank's shard and a copy of a neighbour's in host memory and, when ranks are lost or join, rebuilds every
lost shard from those copies and re-shards for the new size (:mod:`hvps.elastic.ring_shards`), reading no
checkpoint. A shard whose owner and copy's keeper are both lost between two commits is gone: ``sync()`` raises
``HvpsError`` (restart from a checkpoint).
"""

from __future__ import annotations

import contextlib
import copy
import re
from typing import Any, Callable, Iterable, Optional

import numpy as np
import tensorflow as tf

from hvps import HvpsError
from hvps.adapters.common.controls import compression_of
from hvps.elastic import HostsUpdatedInterrupt, HostUpdateResult, ObjectState, State, notify_hosts_updated, run_fn
from hvps.elastic import reset as _reset
from hvps.elastic.ring_shards import RingShardsHandler

from .functions import broadcast_variables

#: how a failed hvps collective inside a graph shows in TensorFlow's error (the numpy_function's traceback)
_HVPS_ERROR_LINE = re.compile(r"hvps\.core\.errors\.HvpsError: (.+)")


def _translate(error: BaseException) -> Optional[HvpsError]:
    """A TensorFlow error that carries a failed hvps collective, as that HvpsError (or None)."""
    if not isinstance(error, tf.errors.OpError):
        return None
    found = _HVPS_ERROR_LINE.findall(str(error))
    return HvpsError(found[-1].strip()) if found else None


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``func(state, *args, **kwargs)`` elastically (see ``hvps.adapters.torch.elastic.run``); a failed
    collective inside a ``tf.function`` or ``model.fit`` (a TensorFlow error) counts as HorovodInternalError."""
    return run_fn(func, _reset, translate=_translate)


def _host_copies(variables: Iterable[Any]) -> list:
    return [np.array(variable.numpy(), copy=True) for variable in variables]


def _assign(variables: Iterable[Any], values: list) -> None:
    variables = list(variables)
    if len(variables) != len(values):
        raise HvpsError(f"cannot restore {len(variables)} variables from a commit of {len(values)}: the variables "
                        "changed since the last commit (commit again after building new ones)")
    for variable, value in zip(variables, values):
        variable.assign(value)


def _check_eager() -> None:
    if not tf.executing_eagerly():
        raise HvpsError("hvps's elastic TensorFlow states need eager execution (TensorFlow 2); TF1 graphs and "
                        "sessions are not supported")


class TensorFlowState(ObjectState):
    """A list of ``tf.Variable``s (``variables=``, required) and plain keyword attributes.

    ``session`` is TF1's and must be None.
    """

    def __init__(self, variables: Optional[Iterable[Any]] = None, session: Any = None, **kwargs: Any) -> None:
        _check_eager()
        if session is not None:
            raise HvpsError("TensorFlowState(session=...) is TF1's; hvps supports eager TensorFlow 2 only")
        if variables is None:
            raise ValueError("TensorFlowState needs variables=[...] (TensorFlow 2 has no global variable "
                             "collection to default to); pass e.g. model.variables")
        self.variables = list(variables)
        self.session = None
        self._values = _host_copies(self.variables)
        super().__init__(bcast_object=None, get_rank=None, **kwargs)

    def save(self) -> None:
        self._values = _host_copies(self.variables)
        super().save()

    def restore(self) -> None:
        _assign(self.variables, self._values)
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self.variables, root_rank=0)
        self._values = _host_copies(self.variables)
        super().sync()



def _is_sharded(optimizer: Any) -> bool:
    return optimizer is not None and hasattr(optimizer, "shard_state_variables")


class KerasShardsHandler(RingShardsHandler):
    """Saves, restores and syncs a Keras ``ShardedOptimizer``'s shard of the state (its buckets are the flat
    groups, each element-wise state a channel); its replicated variables (step count, learning rate) and the
    model's are the :class:`TensorFlowKerasState`'s.

    Args:
        optimizer: the sharded optimizer (built or not: a joiner's is built by the state's sync).
    """

    what = "keras_sharded_optimizer"

    def __init__(self, optimizer: Any) -> None:
        self.value = optimizer
        self._start()

    @property
    def process_set(self) -> Any:
        """The optimizer's process set: the ranks that share its shards."""
        return self.value.process_set

    def _layout(self) -> list:
        if not self.value.built:
            return []
        layout = self.value.shard_layout()
        return [(f"bucket{b}", tuple(n for _, _, n in bucket["params"]), layout["params"][bucket["params"][0][0]][2])
                for b, bucket in enumerate(layout["buckets"])]

    def _world(self) -> tuple:
        return self.value.world()

    def _capture(self) -> tuple:
        state = self.value.shard_state() if self.value.built else []
        structure = [[(key, str(values[key].dtype)) for key in sorted(values)] for values in state]
        blocks = []
        for values, keys in zip(state, structure):
            columns = [values[key].reshape(-1, 1).view(np.uint8) for key, _ in keys]
            rows = self.value.shard_variables[len(blocks)].shape[0]
            blocks.append(np.concatenate(columns, axis=1) if columns else np.zeros((rows, 0), np.uint8))
        return blocks, structure, None  # the replicated variables are the state's

    def _row_bytes(self, structure: list) -> list:
        return [sum(np.dtype(dtype).itemsize for _, dtype in keys) for keys in structure]

    def _install(self, blocks: list, size: int, rank: int, structure: list) -> None:
        self.value.relayout(size, rank)
        state = []
        for block, keys in zip(blocks, structure):
            block, at, entry = np.ascontiguousarray(block), 0, {}
            for key, dtype in keys:
                width = np.dtype(dtype).itemsize
                entry[key] = np.ascontiguousarray(block[:, at : at + width]).view(dtype).reshape(-1)
                at += width
            state.append(entry)
        self.value.load_shard_state(state)

    def _apply_hyperparameters(self, structure: list) -> None:
        """Nothing: a Keras optimizer's hyper-parameters are its replicated variables, which the state syncs."""


def _optimizer_variables(optimizer: Any) -> list:
    if optimizer is None:
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class TensorFlowKerasState(ObjectState):
    """A Keras model (built), its optimizer (``optimizer=``, default ``model.optimizer``) and plain
    keyword attributes (``epoch=0, batch=0``). ``backend`` is TF1's and ignored.

    An optimizer that has no variables yet (not built) is built on ``sync()``, on every rank alike, so
    that a worker that joins a running job broadcasts the same variables as the others.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        _check_eager()
        if model is None or not hasattr(model, "variables"):
            raise ValueError(f"TensorFlowKerasState needs a Keras model, not {model!r}")
        if hasattr(model, "built") and not model.built:
            raise ValueError("the model must be built first: call model.build(input_shape) or run it on a batch")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.backend = backend
        self._shards = KerasShardsHandler(self.optimizer) if _is_sharded(self.optimizer) else None
        self._save_model()
        super().__init__(bcast_object=None, get_rank=None, **kwargs)

    @property
    def same_on_every_rank(self) -> bool:
        """False with a sharded optimizer (each rank holds its own shard of the state), else True."""
        return self._shards is None

    @contextlib.contextmanager
    def _retrace_if_resharded(self):
        """Around a restore or sync of the optimizer's shards: if they were laid out anew (another size), drop
        the model's compiled train step, which holds the old shard variables, so that ``model.fit`` traces it
        again (Keras keeps ``model.train_function`` until then)."""
        before = self.optimizer.layout_generation
        yield
        if self.optimizer.layout_generation != before and hasattr(self.model, "train_function"):
            self.model.train_function = None

    def _build_optimizer(self) -> None:
        if self.optimizer is not None and not getattr(self.optimizer, "built", True):
            if self._shards is not None:  # a joiner's: the sync compares the layouts across ranks
                self.optimizer.build_locally(self.model.trainable_variables)
            else:
                self.optimizer.build(self.model.trainable_variables)

    def _save_model(self) -> None:
        self._saved_model_state = _host_copies(self.model.variables)
        self._saved_optimizer_state = _host_copies(_optimizer_variables(self.optimizer))
        compression = compression_of(self.optimizer)
        self._saved_compression = None if compression is None else copy.deepcopy(compression.state_dict())

    def _load_model(self) -> None:
        """Put the commit back: a ``hvd.DistributedOptimizer`` first forgets the step the failure
        interrupted (``reset_step()``); its compression's error feedback (the part of past gradients
        not yet applied, so part of the commit, as the variables are; this rank's own, never synced)
        returns to the commit's, so that a step that runs again does not count its gradient twice."""
        reset_step = getattr(self.optimizer, "reset_step", None)
        if callable(reset_step):
            reset_step()
        _assign(self.model.variables, self._saved_model_state)
        optimizer_variables = _optimizer_variables(self.optimizer)
        if optimizer_variables or self._saved_optimizer_state:
            _assign(optimizer_variables, self._saved_optimizer_state)
        compression = compression_of(self.optimizer)
        if compression is not None and self._saved_compression is not None:
            compression.load_state_dict(copy.deepcopy(self._saved_compression))

    def save(self) -> None:
        self._save_model()
        if self._shards is not None:
            self._shards.save()
        super().save()

    def restore(self) -> None:
        if self._shards is not None:  # first: a re-layout builds the inner optimizer afresh
            with self._retrace_if_resharded():
                self._shards.restore()
        self._load_model()
        super().restore()

    def sync(self) -> None:
        self._build_optimizer()
        if self._shards is not None:
            with self._retrace_if_resharded():
                self._shards.sync()
        broadcast_variables(list(self.model.variables) + _optimizer_variables(self.optimizer), root_rank=0)
        self._save_model()
        super().sync()


class KerasState(TensorFlowKerasState):
    """``horovod.tensorflow.keras.elastic.KerasState``: a TensorFlowKerasState of a Keras model."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, backend=None, **kwargs)


# ---------------------------------------------------------------------------------------------- Keras callbacks
def _check_state(state: Any, needs: tuple = ()) -> None:
    if not isinstance(state, State):
        raise TypeError(f"the callback needs an elastic state (hvd.elastic.KerasState, ...), "
                        f"not {type(state).__name__}")
    missing = [name for name in needs if not hasattr(state, name)]
    if missing:
        raise ValueError(f"the state has no attribute {', '.join(missing)}; create it with "
                         f"KerasState(model, {', '.join(f'{name}=0' for name in missing)})")


def _make_callbacks() -> dict:
    import keras

    class CommitStateCallback(keras.callbacks.Callback):
        """Commit ``state`` every ``batches_per_commit`` batches and at every epoch's end."""

        def __init__(self, state: State, batches_per_commit: int = 1) -> None:
            super().__init__()
            _check_state(state)
            count = batches_per_commit
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"batches_per_commit must be an int >= 1, not {batches_per_commit!r}")
            self.state = state
            self.batches_per_commit = batches_per_commit
            self.batches_remaining = batches_per_commit

        def on_train_begin(self, logs=None):
            self.batches_remaining = self.batches_per_commit  # the same count on every rank after a reset

        def on_train_batch_end(self, batch, logs=None):
            self.batches_remaining -= 1
            if self.batches_remaining == 0:
                self.commit()
                self.batches_remaining = self.batches_per_commit

        def on_epoch_end(self, epoch, logs=None):
            self.commit()

        def commit(self) -> None:
            self.state.commit()

    class UpdateBatchStateCallback(keras.callbacks.Callback):
        """Keep ``state.batch`` at the index of the last finished batch of the epoch (0 at its end).

        Horovod also shortens a resumed epoch by ``state.batch`` steps through ``params['steps']``;
        Keras 3's ``fit`` takes its steps from its own arguments, so pass
        ``steps_per_epoch=... - state.batch`` yourself for a resumed epoch if it matters.
        """

        def __init__(self, state: State) -> None:
            super().__init__()
            _check_state(state, ("batch",))
            self.state = state

        def on_train_batch_end(self, batch, logs=None):
            self.state.batch = batch

        def on_epoch_end(self, epoch, logs=None):
            self.state.batch = 0

    class UpdateEpochStateCallback(keras.callbacks.Callback):
        """Keep ``state.epoch`` at the number of epochs finished, across resets. Both ways of resuming
        count each epoch once: Horovod's ``fit(..., epochs=epochs - state.epoch)`` (Keras counts that
        ``fit``'s epochs from 0, and the callback adds the epochs committed before it) and Keras's own
        ``fit(..., initial_epoch=state.epoch, epochs=epochs)`` (Keras counts from ``state.epoch``; Horovod's
        callback added it a second time)."""

        def __init__(self, state: State) -> None:
            super().__init__()
            _check_state(state, ("epoch",))
            self.state = state
            self.initial_epoch = state.epoch
            #: what this ``fit``'s epoch numbers lack of the epochs finished (None: its first epoch not begun)
            self._offset: Optional[int] = None

        def on_train_begin(self, logs=None):
            self.initial_epoch = self.state.epoch
            self._offset = None

        def on_epoch_begin(self, epoch, logs=None):
            if self._offset is None:  # fit's first epoch: numbered from 0, or from initial_epoch=state.epoch
                self._offset = 0 if epoch == self.initial_epoch else self.initial_epoch

        def on_epoch_end(self, epoch, logs=None):
            offset = self.initial_epoch if self._offset is None else self._offset
            self.state.epoch = offset + epoch + 1

    return {cls.__name__: cls for cls in (CommitStateCallback, UpdateBatchStateCallback, UpdateEpochStateCallback)}


_CALLBACKS = ("CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback")
_built: dict = {}


def __getattr__(name: str) -> Any:
    if name in _CALLBACKS:
        if not _built:
            _built.update(_make_callbacks())
            globals().update(_built)
        return _built[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(_CALLBACKS))


__all__ = ["run", "State", "ObjectState", "TensorFlowState", "TensorFlowKerasState", "KerasState",
           "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "HostsUpdatedInterrupt",
           "HostUpdateResult", "notify_hosts_updated"]
