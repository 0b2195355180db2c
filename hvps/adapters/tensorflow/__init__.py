"""TensorFlow 2 adapter with Horovod's API: ``import hvps.adapters.tensorflow as hvd``.

Exports every name ``horovod.tensorflow`` does except its TF1-only session hook
(``BroadcastGlobalVariablesHook``); ``elastic`` holds Horovod's
elastic states, retry loop and Keras callbacks. Importing this module imports TensorFlow (the core and the torch
adapter never do). Collectives take and return ``tf.Tensor`` and work eagerly and inside
``tf.function``; Keras 3 users ``import hvps.adapters.tensorflow.keras as hvd``.
"""

from hvps import (
    DuplicateNameError,
    HorovodInternalError,
    HvpsError,
    ProcessSet,
    ReduceOp,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    gpu_available,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from hvps.runtime.state import is_homogeneous

from . import elastic, util
from .basics import local_rank_op, local_size_op, process_set_included_op, rank_op, size_op
from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_object_fn, broadcast_variables
from .gradients import allreduce_gradients
from .mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allreduce,
    barrier,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    join,
)
from .optimizer import DistributedOptimizer, broadcast_global_variables
from .scatter_ops import alltoall, grouped_reducescatter, reducescatter
from .sync_batch_norm import SyncBatchNormalization
from .tape import DistributedGradientTape, PartialDistributedGradientTape
from .threads import ensure_inter_op_threads, set_threads
from .util import _executing_eagerly  # noqa: F401 - scripts (and Horovod's tests) call hvd._executing_eagerly()

ensure_inter_op_threads()

__all__ = [
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
    "cuda_built", "rocm_built", "ddl_built", "ccl_built", "gpu_available", "is_homogeneous",
    "HvpsError", "HorovodInternalError", "DuplicateNameError", "ReduceOp",
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "Compression",
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "rank_op", "size_op", "local_rank_op", "local_size_op", "process_set_included_op",
    "start_timeline", "stop_timeline",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall",
    "reducescatter", "grouped_reducescatter", "join", "barrier",
    "broadcast_variables", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
    "allgather_object", "allreduce_gradients",
    "DistributedGradientTape", "PartialDistributedGradientTape", "DistributedOptimizer", "SyncBatchNormalization",
    "elastic", "set_threads", "util",
]
