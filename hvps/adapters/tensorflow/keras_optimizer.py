"""``DistributedOptimizer`` for Keras 3: wraps any ``keras.optimizers.Optimizer``.

How it hooks into Keras 3: ``model.fit``'s TensorFlow ``train_step`` computes
gradients with a tf.GradientTape and calls ``optimizer.apply_gradients(zip(grads,
vars))``, which the base class forwards to ``apply(grads, vars)``. This class
is a wrapper optimizer (the pattern of Keras's own ``LossScaleOptimizer``): its
``apply`` reduces the gradients over the ranks (one grouped allreduce, a
stateful ``tf.numpy_function`` inside the compiled train function) and then
calls the wrapped optimizer's ``apply``. Its ``build`` builds the wrapped
optimizer (and, with ``backward_passes_per_step > 1``, the local gradient
accumulators), so every variable exists before the train function is traced;
``learning_rate``, ``iterations``, ``variables`` and ``scale_loss`` are the
wrapped optimizer's. No runtime subclassing: the wrapped optimizer's class and
state stay as they are.

Keras 3 with the TensorFlow backend has no ``stateless_apply`` (TF raises), so
only the stateful path is needed. XLA (``jit_compile=True``, which Keras picks
by default on GPUs) cannot run ``tf.numpy_function``: compile with
``jit_compile=False``.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import keras
import tensorflow as tf

import hvps
from hvps import global_process_set
from hvps.adapters.common.controls import CompressionControls
from hvps.compression.framework_compressors import from_name
from hvps.core.user_warnings import warn

from . import overlap
from .compression import is_fusable
from .gradients import allreduce_gradients, gradient_options, reduce_shared_gradients, variable_key, variable_name
from .mpi_ops import Average, _check_process_set


class DistributedOptimizer(CompressionControls, keras.optimizers.Optimizer):
    """Applies gradients averaged over all ranks with the wrapped Keras 3 optimizer.

    ``backward_passes_per_step=N`` accumulates N local gradients and communicates
    and applies once every N calls (their sum, or their mean with
    ``average_aggregated_gradients=True``); the calls in between only accumulate.

    ``compression``: ``hvd.Compression.none`` (default), ``.fp16``, ``.bf16`` or a
    Horovod-style compressor fuse all dense gradients into one allreduce;
    ``.int8``, ``.topk(density)`` and ``.dgc(density)`` compress every gradient
    through the core pipeline, error feedback keyed by variable path.
    ``compression_stats()`` reports the bytes on the wire, ``set_epoch(epoch)``
    drives DGC's density warm-up (``callbacks.CompressionEpochCallback`` calls it
    from ``model.fit``), ``compression.state_dict()`` holds the residuals.
    """

    def __new__(cls, optimizer: Any = None, *args: Any, shard: bool = False, **kwargs: Any) -> Any:
        """``shard=True`` gives a :class:`~hvps.adapters.tensorflow.keras_sharded_optimizer.ShardedOptimizer`
        (ZeRO stage 1-2: each rank keeps 1/N of the optimizer state) with the same arguments instead."""
        if shard:
            from .keras_sharded_optimizer import ShardedOptimizer

            # positional arguments by DistributedOptimizer's order; keywords the sharded one adds pass through
            named = dict(inspect.signature(cls.__init__).bind_partial(None, optimizer, *args).arguments)
            del named["self"], named["optimizer"]
            return ShardedOptimizer(optimizer, **_sharded_arguments({**named, **kwargs}))
        return super().__new__(cls)

    def __init__(self, optimizer: keras.optimizers.Optimizer, name: Optional[str] = None, device_dense: str = "",
                 device_sparse: str = "", compression: Any = None, sparse_as_dense: bool = False,
                 backward_passes_per_step: int = 1, op=Average, gradient_predivide_factor: float = 1.0,
                 average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
                 process_set: Any = global_process_set, scale_local_gradients: bool = True,
                 shard: bool = False) -> None:
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a Keras 3 keras.optimizers.Optimizer, got {type(optimizer)}")
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("the optimizer is already a DistributedOptimizer")
        op, compression, _, _ = gradient_options(op, gradient_predivide_factor, compression, backward_passes_per_step)
        process_set = None if process_set is global_process_set else process_set
        if process_set is not None and not is_fusable(compression):
            _check_process_set(process_set)
        hvps.size()  # raises HvpsError before hvps.init()
        super().__init__(learning_rate=0.0, name=name or f"Distributed{type(optimizer).__name__}")
        self.inner_optimizer = optimizer
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.op = op
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self.process_set = process_set
        self.scale_local_gradients = bool(scale_local_gradients)
        self._local_vars: set = set()

    def register_local_var(self, var: tf.Variable) -> None:
        """Keep ``var``'s gradient on this rank: never reduced, only divided by the set size when
        ``scale_local_gradients`` (Horovod's PartialDistributedOptimizer)."""
        self._local_vars.add(variable_key(var))

    # -- state -------------------------------------------------------------------------------
    def build(self, var_list):
        if self.built:
            return
        var_list = list(var_list)
        if self.backward_passes_per_step > 1:
            self._pass_counter = self.add_variable(shape=(), dtype="int32", initializer="zeros",
                                                   aggregation="none", name="hvps_pass_counter")
            self._accumulators = [self.add_variable_from_reference(v, name="hvps_accumulated_gradient")
                                  for v in var_list]
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError("hvps's Keras DistributedOptimizer runs on the TensorFlow backend (stateful apply)")

    # -- the hook ------------------------------------------------------------------------------
    def _reduce(self, grads: list, variables: list) -> list:
        def reduce(gs: list, vs: list) -> list:
            return allreduce_gradients(gs, self.op, self.compression, self.sparse_as_dense,
                                       self.gradient_predivide_factor,
                                       names=[variable_name(v, f"variable{i}") for i, v in enumerate(vs)],
                                       process_set=self.process_set)

        return reduce_shared_gradients(grads, variables, self._local_vars, reduce, self.scale_local_gradients,
                                       self.process_set)

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None) -> list:
        """Horovod's (Keras 2's) hook: ``(gradient, variable)`` pairs of ``loss`` (a tensor recorded on
        ``tape``, or a callable run under a new tape), averaged over the set's ranks. With
        ``backward_passes_per_step > 1`` they stay local: ``apply_gradients`` accumulates and reduces them."""
        var_list = list(var_list)
        if tape is None:
            tape = tf.GradientTape()
        if callable(loss):
            with tape:
                loss = loss()
        grads = list(tape.gradient(loss, var_list, grad_loss))
        if self.backward_passes_per_step == 1:
            grads = self._reduce(grads, var_list)
        return list(zip(grads, var_list))

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> list:
        """:meth:`_compute_gradients` without ``grad_loss`` (Horovod's public name)."""
        return self._compute_gradients(loss, var_list, None, tape)

    def get_gradients(self, loss: Any, params: Any) -> list:
        """The wrapped optimizer's ``get_gradients(loss, params)`` (Keras 2's; else ``tf.gradients``, in a graph),
        averaged over the set's ranks."""
        params = list(params)
        inner = getattr(self.inner_optimizer, "get_gradients", None)
        grads = list(inner(loss, params) if inner is not None else tf.gradients(loss, params))
        return self._reduce(grads, params)

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if not grads:
            return
        if trainable_variables is None:
            if not self.built:
                raise ValueError("pass trainable_variables on the first call, or build the optimizer first")
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        if self.backward_passes_per_step == 1:
            self.inner_optimizer.apply(self._reduce(grads, trainable_variables), trainable_variables)
            return
        self._accumulate_and_maybe_apply(grads, trainable_variables)

    def _accumulate_and_maybe_apply(self, grads: list, trainable_variables: list) -> None:
        accumulators = [self._accumulators[self._get_variable_index(v)] for v in trainable_variables]
        present = [g is not None for g in grads]
        for g, acc in zip(grads, accumulators):
            if g is not None:
                acc.assign_add(tf.cast(tf.convert_to_tensor(g), acc.dtype))
        self._pass_counter.assign_add(1)
        steps = self.backward_passes_per_step

        def communicate_and_apply():
            divisor = float(steps) if self.average_aggregated_gradients else 1.0
            summed = [tf.convert_to_tensor(acc) / divisor if p else None for acc, p in zip(accumulators, present)]
            self.inner_optimizer.apply(self._reduce(summed, trainable_variables), trainable_variables)
            for acc in accumulators:
                acc.assign(tf.zeros_like(acc))
            self._pass_counter.assign(0)

        tf.cond(tf.equal(tf.convert_to_tensor(self._pass_counter), steps), communicate_and_apply, lambda: None)

    # -- elastic ----------------------------------------------------------------------------------
    def reset_step(self) -> None:
        """Forget the step in progress, so that the next ``apply`` starts a fresh one.

        The only state a step keeps outside variables is its gradient buckets in flight (started,
        not finished: a failure came between); those whose collective has finished (an elastic
        reset has failed them) are claimed and forgotten, any still running are waited for by the
        next start under their name. The ``backward_passes_per_step`` accumulators and pass counter
        are variables: ``hvd.elastic.KerasState`` commits and restores them with the optimizer's
        other variables, as it does the compression's error feedback. ``KerasState.restore()``
        calls this, so a restore leaves the optimizer ready wherever the failure interrupted a step.
        """
        overlap.forget_finished()

    # -- serialisation ----------------------------------------------------------------------------
    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "compression": self.compression.name,
            "sparse_as_dense": self.sparse_as_dense,
            "backward_passes_per_step": self.backward_passes_per_step,
            "op": self.op.name,
            "gradient_predivide_factor": self.gradient_predivide_factor,
            "average_aggregated_gradients": self.average_aggregated_gradients,
            "scale_local_gradients": self.scale_local_gradients,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("optimizer"), custom_objects=custom_objects)
        config["compression"] = _compression_from_config(config.get("compression", "none"))
        config["op"] = getattr(hvps.ReduceOp, config.get("op", "Average"))
        return cls(inner, **config)


def PartialDistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: Optional[str] = None,
                                device_dense: str = "", device_sparse: str = "", compression: Any = None,
                                sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0, op=Average,
                                backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                                groups: Any = None, process_set: Any = global_process_set, local_layers: Any = None,
                                scale_local_gradients: bool = True) -> DistributedOptimizer:
    """A DistributedOptimizer that leaves the gradients of ``local_layers`` (Keras layers) on this rank:
    not reduced, only divided by the set size when ``scale_local_gradients``."""
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("local_layers must be Keras layers (keras.layers.Layer)")
    opt = DistributedOptimizer(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                               compression=compression, sparse_as_dense=sparse_as_dense,
                               backward_passes_per_step=backward_passes_per_step, op=op,
                               gradient_predivide_factor=gradient_predivide_factor,
                               average_aggregated_gradients=average_aggregated_gradients, groups=groups,
                               process_set=process_set, scale_local_gradients=scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            opt.register_local_var(var)
    return opt


def load_model(filepath: str, custom_optimizers: Any = None, custom_objects: Optional[dict] = None,
               compression: Any = None) -> keras.Model:
    """``keras.models.load_model`` whose model comes back with its optimizer wrapped in a
    DistributedOptimizer (with ``compression``), its loaded state kept, as Horovod's does.

    ``custom_optimizers``: optimizer classes the file may name beyond Keras's own.
    """
    objects = {"DistributedOptimizer": DistributedOptimizer, **(custom_objects or {})}
    objects.update({cls.__name__: cls for cls in (custom_optimizers or [])})
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not isinstance(optimizer, DistributedOptimizer):
        model.optimizer = DistributedOptimizer(optimizer, compression=compression)
    return model


def _sharded_arguments(kwargs: dict) -> dict:
    """``DistributedOptimizer``'s keyword arguments as the sharded optimizer takes them: the device hints
    dropped, those that mean nothing without a replicated gradient refused when set."""
    kwargs = dict(kwargs)
    kwargs.pop("device_dense", None)
    kwargs.pop("device_sparse", None)
    if kwargs.pop("average_aggregated_gradients", False):
        raise ValueError("average_aggregated_gradients with shard=True is not supported: backward_passes_per_step "
                         "must be 1 (use the optimizer's gradient_accumulation_steps)")
    if not kwargs.pop("scale_local_gradients", True):
        raise ValueError("scale_local_gradients=False with shard=True is not supported: a sharded optimizer has no "
                         "local variables")
    return kwargs


def _compression_from_config(name: str):
    """The compression a config names; Horovod-style ones cannot be rebuilt and become ``none``."""
    try:
        return from_name(name)
    except ValueError:
        warn(f"DistributedOptimizer.from_config cannot rebuild the compression {name!r}; using none")
        return from_name("none")
