"""PyTorch adapter with Horovod's API: ``import hvps.adapters.torch as hvd``.

Exports every name ``horovod.torch`` does (``elastic``: Horovod's elastic states and retry loop; see
the README's "Elastic training"), plus hvps's HDF5 checkpoints.
"""

from hvps.adapters.common.core_names import *  # noqa: F403  (Horovod's basics, listed once for every adapter)
from hvps.adapters.common.core_names import CORE_NAMES as _CORE_NAMES

from . import elastic
from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import _basics  # noqa: F401 - horovod.torch.mpi_ops._basics
from .mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from . import adasum_optimizer  # noqa: F401  (registers the Adasum kind of DistributedOptimizer)
from .optimizer import DistributedOptimizer
from .sharded_optimizer import ShardedOptimizer
from .state_tier import DiskStateTier
from .fully_sharded import fully_shard
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    *_CORE_NAMES,
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "Compression", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall",
    "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "synchronize", "poll", "join", "barrier", "broadcast_parameters",
    "broadcast_optimizer_state", "broadcast_object", "allgather_object", "DistributedOptimizer", "ShardedOptimizer", "fully_shard",
    "DiskStateTier",
    "SyncBatchNorm",
    "elastic", "CheckpointManager", "CheckpointError",
]

from .checkpoint import CheckpointError, CheckpointManager  # noqa: E402  (HDF5 checkpoints)
