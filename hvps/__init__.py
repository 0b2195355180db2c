"""hvps: ring all-reduce collectives on MPI with Horovod's API.

``import hvps`` gives the framework-neutral core on numpy buffers; PyTorch users
``import hvps.adapters.torch as hvd``.
"""

from .dtypes import ReduceOp
from .errors import HvpsError
from .handle import Handle
from .ops import (
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_async,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_async,
    broadcast_object,
    grouped_allreduce,
    grouped_allreduce_async,
    join,
    reducescatter,
    reducescatter_async,
)
from .runtime import (
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from .version import __version__

__all__ = [
    "__version__",
    "HvpsError",
    "Handle",
    "ReduceOp",
    "Average",
    "Sum",
    "Min",
    "Max",
    "Product",
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "allreduce",
    "allreduce_async",
    "grouped_allreduce",
    "grouped_allreduce_async",
    "allgather",
    "allgather_async",
    "broadcast",
    "broadcast_async",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "barrier",
    "join",
    "broadcast_object",
    "allgather_object",
]
