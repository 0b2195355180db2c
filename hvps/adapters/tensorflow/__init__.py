"""TensorFlow 2 adapter with Horovod's API: ``import hvps.adapters.tensorflow as hvd``.

Exports every name ``horovod.tensorflow`` does except its TF1-only session hook
(``BroadcastGlobalVariablesHook``); ``elastic`` holds Horovod's
elastic states, retry loop and Keras callbacks. Importing this module imports TensorFlow (the core and the torch
adapter never do). Collectives take and return ``tf.Tensor`` and work eagerly and inside
``tf.function``; Keras 3 users ``import hvps.adapters.tensorflow.keras as hvd``.
"""

from hvps.adapters.common.core_names import *  # noqa: F403  (Horovod's basics, listed once for every adapter)
from hvps.adapters.common.core_names import CORE_NAMES as _CORE_NAMES

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
    *_CORE_NAMES,
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "Compression", "rank_op", "size_op", "local_rank_op",
    "local_size_op", "process_set_included_op", "allreduce", "grouped_allreduce", "allgather", "grouped_allgather",
    "broadcast", "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier",
    "broadcast_variables", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
    "allgather_object", "allreduce_gradients", "DistributedGradientTape", "PartialDistributedGradientTape",
    "DistributedOptimizer", "SyncBatchNormalization", "elastic", "set_threads", "util",
]
