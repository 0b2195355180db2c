"""``hvd.DistributedOptimizer`` and ``hvd.broadcast_global_variables`` at the ``horovod.tensorflow`` level.

Horovod's TensorFlow-level ``DistributedOptimizer`` wraps either a Keras optimizer (handed to the
Keras wrapper) or a TF1 ``tf.compat.v1.train.Optimizer`` (still in TF 2.21): its
``compute_gradients`` returns the gradients averaged over the process set's ranks, and
``apply_gradients`` applies them with the wrapped optimizer. Ranks outside the process set get their
own gradients back, unreduced, as in Horovod.
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

import hvps
from hvps import global_process_set

from .functions import broadcast_variables
from .gradients import allreduce_gradients, gradient_options, reduce_shared_gradients, variable_key, variable_name
from .mpi_ops import Average


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "", compression: Any = None,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1, op: Any = Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None, process_set: Any = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap ``optimizer`` so that it applies gradients averaged over the set's ranks.

    Args:
        optimizer: a Keras 3 optimizer (see the Keras adapter's DistributedOptimizer) or a TF1
            ``tf.compat.v1.train.Optimizer``. The other arguments are Horovod's (``num_groups``/``groups``
            are accepted and change nothing: hvps buckets gradients by size).

    Returns:
        The wrapped optimizer.

    Raises:
        TypeError: ``optimizer`` is neither kind.
        NotImplementedError: ``backward_passes_per_step > 1`` with a TF1 optimizer.
    """
    import keras

    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return _LegacyDistributedOptimizer(optimizer, name=name, use_locking=use_locking, compression=compression,
                                           sparse_as_dense=sparse_as_dense, op=op,
                                           gradient_predivide_factor=gradient_predivide_factor,
                                           backward_passes_per_step=backward_passes_per_step,
                                           process_set=process_set, scale_local_gradients=scale_local_gradients)
    from .keras_optimizer import DistributedOptimizer as KerasDistributedOptimizer

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer or a tf.compat.v1.train.Optimizer, "
                        f"not {type(optimizer).__name__}")
    return KerasDistributedOptimizer(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                                     compression=compression, sparse_as_dense=sparse_as_dense,
                                     backward_passes_per_step=backward_passes_per_step, op=op,
                                     gradient_predivide_factor=gradient_predivide_factor,
                                     average_aggregated_gradients=average_aggregated_gradients,
                                     num_groups=num_groups, groups=groups, process_set=process_set,
                                     scale_local_gradients=scale_local_gradients)


class _LegacyDistributedOptimizer(tf.compat.v1.train.Optimizer):
    """A TF1 optimizer whose ``compute_gradients`` averages the wrapped one's over the set's ranks."""

    def __init__(self, optimizer: Any, name: Optional[str], use_locking: bool, compression: Any,
                 sparse_as_dense: bool, op: Any, gradient_predivide_factor: float, backward_passes_per_step: int,
                 process_set: Any, scale_local_gradients: bool) -> None:
        if int(backward_passes_per_step) != 1:
            raise NotImplementedError(
                f"backward_passes_per_step={backward_passes_per_step} with a TF1 tf.compat.v1.train.Optimizer: hvps "
                "accumulates local gradients for Keras optimizers only; wrap a keras.optimizers.Optimizer, or "
                "accumulate in your graph and call this optimizer once per step")
        gradient_options(op, gradient_predivide_factor, compression)  # every argument checked here
        hvps.size()  # raises before hvps.init()
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking)
        self._optimizer = optimizer
        self._op, self._compression, self._sparse_as_dense = op, compression, sparse_as_dense
        self._predivide = float(gradient_predivide_factor)
        self.process_set = process_set
        self.scale_local_gradients = bool(scale_local_gradients)
        self._local_vars: set = set()

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient on this rank (divided by the set size when ``scale_local_gradients``)."""
        self._local_vars.add(variable_key(var))

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list:
        """The wrapped optimizer's ``(gradient, variable)`` pairs, gradients averaged over the set's ranks."""
        pairs = list(self._optimizer.compute_gradients(*args, **kwargs))
        if not pairs:
            return pairs
        grads, variables = (list(x) for x in zip(*pairs))
        process_set = None if self.process_set is global_process_set else self.process_set

        def reduce(gs: list, vs: list) -> list:
            return allreduce_gradients(gs, self._op, self._compression, self._sparse_as_dense, self._predivide,
                                       names=[variable_name(v, f"variable{i}") for i, v in enumerate(vs)],
                                       process_set=process_set)

        reduced = reduce_shared_gradients(grads, variables, self._local_vars, reduce, self.scale_local_gradients,
                                          process_set)
        return list(zip(reduced, variables))

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None, name: Optional[str] = None) -> Any:
        """The wrapped optimizer's ``apply_gradients``."""
        return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)


def broadcast_global_variables(root_rank: int) -> Any:
    """TF1's global variables from the root (graph mode only; in TF2 use ``broadcast_variables``)."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution; use "
                           "hvd.broadcast_variables(<model/optimizer variables>) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)
