"""Keras 3 adapter with Horovod's API: ``import hvps.adapters.tensorflow.keras as hvd``.

Every name ``horovod.tensorflow.keras`` exports (``elastic``: its states, retry loop and callbacks): the basics of
``hvps.adapters.tensorflow``, value-level ``allreduce``/``allgather``/``broadcast``/``reducescatter``
with Keras's signatures, the ``DistributedOptimizer`` and the callbacks
(``hvd.callbacks.BroadcastGlobalVariablesCallback(0)``, ...).
"""

from .. import (
    Adasum,
    Average,
    Compression,
    HorovodInternalError,
    HvpsError,
    Max,
    Min,
    ProcessSet,
    Product,
    ReduceOp,
    Sum,
    SyncBatchNormalization,
    add_process_set,
    allgather_object,
    alltoall,
    barrier,
    broadcast_global_variables,
    broadcast_object,
    broadcast_variables,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    elastic,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allreduce,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    set_threads,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from ..keras_optimizer import DistributedOptimizer, PartialDistributedOptimizer, load_model
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
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
    "cuda_built", "rocm_built", "ddl_built", "ccl_built", "is_homogeneous",
    "HvpsError", "HorovodInternalError", "ReduceOp", "Average", "Sum", "Min", "Max", "Product", "Adasum",
    "Compression", "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "start_timeline", "stop_timeline",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "join", "barrier",
    "broadcast_variables", "broadcast_global_variables", "broadcast_object", "allgather_object", "set_threads",
    "DistributedOptimizer", "PartialDistributedOptimizer", "load_model", "SyncBatchNormalization", "callbacks",
    "elastic",
    "BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
    "LearningRateScheduleCallback", "CheckpointCallback", "CompressionEpochCallback",
]
