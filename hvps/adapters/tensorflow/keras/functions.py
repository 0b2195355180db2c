"""``horovod.tensorflow.keras``'s value-level collectives (their own signatures: ``name`` second)."""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from hvps import ProcessSet, global_process_set

from .. import mpi_ops, scatter_ops
from ..compression import Compression


def allreduce(value: Any, name: Optional[str] = None, average: Optional[bool] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: Any = None, compression: Any = Compression.none,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Reduce a tensor-compatible value over the set's ranks (default: Average)."""
    return mpi_ops.allreduce(tf.convert_to_tensor(value), average=average, compression=compression, op=op,
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor, name=name,
                             process_set=process_set)


def allgather(value: Any, name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate every member's value along dim 0."""
    return mpi_ops.allgather(tf.convert_to_tensor(value), name=name, process_set=process_set)


def broadcast(value: Any, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """The root's value on every member."""
    return mpi_ops.broadcast(tf.convert_to_tensor(value), root_rank, name=name, process_set=process_set)


def reducescatter(value: Any, name: Optional[str] = None, op: Any = mpi_ops.Average,
                  process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Reduce a value over the set's ranks and keep this rank's block of dim 0."""
    return scatter_ops.reducescatter(tf.convert_to_tensor(value), op=op, name=name, process_set=process_set)
