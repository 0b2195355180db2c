"""The names of hvps's core that every framework adapter re-exports unchanged, listed once.

Horovod's basics (initialisation, ranks and sizes, build and runtime queries, errors, process
sets, the timeline), the same objects as ``hvps``'s own.  Each adapter takes them with
``from hvps.adapters.common.core_names import *`` and lists ``*CORE_NAMES`` first in its
``__all__``, then adds only its framework's names (ops, collectives on its tensors, optimizers).
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

__all__ = [
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
    "cuda_built", "rocm_built", "ddl_built", "ccl_built", "gpu_available", "is_homogeneous",
    "HvpsError", "HorovodInternalError", "DuplicateNameError", "ReduceOp",
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "start_timeline", "stop_timeline",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
]

#: every adapter's core names, in the order its ``__all__`` lists them
CORE_NAMES = tuple(__all__)
