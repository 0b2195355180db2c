"""``hvd.DistributedOptimizer`` and ``hvd.broadcast_global_variables`` at the ``horovod.tensorflow`` level.

Horovod's TensorFlow-level ``DistributedOptimizer`` wraps either a Keras optimizer (handed to the
Keras wrapper) or a TF1 ``tf.compat.v1.train.Optimizer``; hvps supports Keras 3 optimizers only
(TF1 graph-mode optimizers and session hooks are out of scope) and says so.
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from hvps import global_process_set

from .functions import broadcast_variables
from .mpi_ops import Average


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "", compression: Any = None,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1, op: Any = Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None, process_set: Any = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap a Keras 3 optimizer so that it applies gradients averaged over the ranks (see the Keras adapter)."""
    import keras

    from .keras_optimizer import DistributedOptimizer as KerasDistributedOptimizer

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise NotImplementedError("hvps wraps Keras 3 optimizers only (no TF1 tf.compat.v1.train.Optimizer); "
                                  "use a keras.optimizers.Optimizer or DistributedGradientTape")
    return KerasDistributedOptimizer(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                                     compression=compression, sparse_as_dense=sparse_as_dense,
                                     backward_passes_per_step=backward_passes_per_step, op=op,
                                     gradient_predivide_factor=gradient_predivide_factor,
                                     average_aggregated_gradients=average_aggregated_gradients,
                                     num_groups=num_groups, groups=groups, process_set=process_set,
                                     scale_local_gradients=scale_local_gradients)


def broadcast_global_variables(root_rank: int) -> Any:
    """TF1's global variables from the root (graph mode only; in TF2 use ``broadcast_variables``)."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution; use "
                           "hvd.broadcast_variables(<model/optimizer variables>) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)
