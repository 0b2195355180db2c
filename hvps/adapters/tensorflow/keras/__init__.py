"""Keras 3 adapter with Horovod's API: ``import hvps.adapters.tensorflow.keras as hvd``.

Every name ``horovod.tensorflow.keras`` exports (``elastic``: its states, retry loop and callbacks): the basics of
``hvps.adapters.tensorflow``, value-level ``allreduce``/``allgather``/``broadcast``/``reducescatter``
with Keras's signatures, the ``DistributedOptimizer`` (``shard=True``: the ``ShardedOptimizer``, ZeRO stage 1-2)
and the callbacks
(``hvd.callbacks.BroadcastGlobalVariablesCallback(0)``, ...).
"""

from hvps.adapters.common.core_names import *  # noqa: F403  (Horovod's basics, listed once for every adapter)
from hvps.adapters.common.core_names import CORE_NAMES as _CORE_NAMES

from .. import (
    Adasum,
    Average,
    Compression,
    Max,
    Min,
    Product,
    Sum,
    SyncBatchNormalization,
    allgather_object,
    alltoall,
    barrier,
    broadcast_global_variables,
    broadcast_object,
    broadcast_variables,
    elastic,
    grouped_allreduce,
    join,
    set_threads,
)
from ..keras_optimizer import DistributedOptimizer, PartialDistributedOptimizer, load_model
from ..keras_sharded_optimizer import ShardedOptimizer
from . import callbacks
from .callbacks import (
    BroadcastGlobalVariablesCallback,
    CheckpointCallback,
    CompressionEpochCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)
from .functions import allgather, allreduce, broadcast, reducescatter

__all__ = [
    *_CORE_NAMES,
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "Compression", "allreduce", "grouped_allreduce",
    "allgather", "broadcast", "alltoall", "reducescatter", "join", "barrier", "broadcast_variables",
    "broadcast_global_variables", "broadcast_object", "allgather_object", "set_threads", "DistributedOptimizer",
    "ShardedOptimizer", "PartialDistributedOptimizer", "load_model", "SyncBatchNormalization", "callbacks", "elastic",
    "BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
    "LearningRateScheduleCallback", "CheckpointCallback", "CompressionEpochCallback",
]
