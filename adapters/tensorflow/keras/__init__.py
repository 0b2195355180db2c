"""Keras 3 adapter with Horovod's API: ``import hvps.adapters.tensorflow.keras as hvd``.

Everything of ``hvps.adapters.tensorflow`` plus the Keras ``DistributedOptimizer``
and callbacks (``hvd.callbacks.BroadcastGlobalVariablesCallback(0)``, ...).
"""

from .. import (
    Average,
    Compression,
    HvpsError,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
    cross_rank,
    cross_size,
    grouped_allreduce,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    rank,
    reducescatter,
    set_threads,
    shutdown,
    size,
)
from . import callbacks
from .callbacks import (
    BroadcastGlobalVariablesCallback,
    CheckpointCallback,
    CompressionEpochCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)
from .optimizer import DistributedOptimizer

__all__ = [
    "HvpsError", "ReduceOp", "Average", "Sum", "Min", "Max", "Product", "Compression",
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "join", "barrier",
    "broadcast_variables", "broadcast_object", "allgather_object", "set_threads",
    "DistributedOptimizer", "callbacks",
    "BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
    "LearningRateScheduleCallback", "CheckpointCallback", "CompressionEpochCallback",
]
