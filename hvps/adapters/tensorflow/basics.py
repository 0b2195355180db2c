"""Horovod's ``rank_op``-style ops: the topology as int32 scalar tensors, usable in a graph.

hvps's topology is fixed for the life of a job (no elastic resizing), so each op is a constant
read when the op is built, after ``init()``.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

import hvps
from hvps.runtime.process_sets import _registry

#: Horovod's code for a process set id that is not registered (``process_set_included_op``)
PROCESS_SET_ERROR_UNKNOWN_SET = -3


def _scalar(value: int, name: Optional[str]) -> tf.Tensor:
    return tf.constant(value, dtype=tf.int32, name=name)


def rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank, as an int32 scalar tensor."""
    return _scalar(hvps.rank(), name)


def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's rank on its node, as an int32 scalar tensor."""
    return _scalar(hvps.local_rank(), name)


def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks on this node, as an int32 scalar tensor."""
    return _scalar(hvps.local_size(), name)


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks in the process set ``process_set_id`` (0: all), as an int32 scalar tensor."""
    process_set = _registry.sets.get(process_set_id) if hvps.size() else None
    if process_set is None:
        raise ValueError(f"process set {process_set_id} is not registered")
    return _scalar(process_set.size(), name)


def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """1 if this rank belongs to process set ``process_set_id``, 0 if not, -3 if the id is unknown."""
    hvps.size()  # raises HvpsError before init()
    process_set = _registry.sets.get(process_set_id)
    if process_set is None:
        return _scalar(PROCESS_SET_ERROR_UNKNOWN_SET, name)
    return _scalar(int(process_set.included()), name)
