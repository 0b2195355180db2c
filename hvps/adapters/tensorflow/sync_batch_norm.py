"""``SyncBatchNormalization``: Keras 3 batch normalization with statistics over a process set.

In training, each rank's per-channel sum, sum of squares and element count are summed over the
set's ranks by one grouped allreduce (differentiable: its gradient is the same allreduce of the
incoming gradients), so the mean and variance are those of the global batch, whatever each rank's
batch size; gradients flow through them as through single-process BatchNormalization on the
global batch. Inference uses the moving statistics, as BatchNormalization does.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from hvps import global_process_set

from .mpi_ops import Sum, _grouped_allreduce


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """BatchNormalization whose batch statistics cover every rank of ``process_set``.

    ``fused`` is Horovod's argument and must stay False; masks are not supported.
    """

    def __init__(self, fused: bool = False, process_set: Any = global_process_set, **kwargs: Any) -> None:
        if fused:
            raise ValueError("SyncBatchNormalization does not support fused=True")
        kwargs.pop("synchronized", None)
        super().__init__(**kwargs)
        self.process_set = None if process_set is global_process_set else process_set

    def _moments(self, inputs, mask):
        if mask is not None:
            raise NotImplementedError("SyncBatchNormalization does not support masks")
        axes = self._reduction_axes
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype)
        local_sum = tf.reduce_sum(inputs, axis=axes)
        local_squares = tf.reduce_sum(tf.square(inputs), axis=axes)
        total, squares, n = _grouped_allreduce([local_sum, local_squares, tf.reshape(count, [1])], Sum, None,
                                               1.0, 1.0, process_set=self.process_set)
        mean = total / n
        variance = tf.maximum(squares / n - tf.square(mean), 0.0)
        return mean, variance

    def get_config(self) -> dict:
        config = super().get_config()
        config.pop("synchronized", None)
        return config
