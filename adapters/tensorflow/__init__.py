"""TensorFlow 2 adapter with Horovod's API: ``import hvps.adapters.tensorflow as hvd``.

Importing this module imports TensorFlow (the core and the torch adapter never
do). Collectives take and return ``tf.Tensor`` and work eagerly and inside
``tf.function``; Keras 3 users ``import hvps.adapters.tensorflow.keras as hvd``.
"""

from hvps import (
    HvpsError,
    ReduceOp,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)

from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_variables
from .gradients import allreduce_gradients
from .mpi_ops import (
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    grouped_allreduce,
    join,
    reducescatter,
)
from .tape import DistributedGradientTape
from .threads import set_threads

__all__ = [
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
    "cuda_built", "rocm_built", "ddl_built", "ccl_built",
    "HvpsError", "ReduceOp", "Average", "Sum", "Min", "Max", "Product", "Compression",
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "allreduce", "grouped_allreduce", "allgather", "broadcast", "broadcast_", "alltoall", "reducescatter",
    "join", "barrier",
    "broadcast_variables", "broadcast_object", "allgather_object", "allreduce_gradients",
    "DistributedGradientTape", "set_threads",
]
