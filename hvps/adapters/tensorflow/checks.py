"""Argument checks made while a collective is being built (eagerly or while tracing a tf.function).

Horovod raises argument errors before anything is submitted, the same way on every rank; inside a
graph that means at trace time, in Python, rather than from the stateful op when it runs. These
helpers make the core's own checks early: process-set membership, dtype and op together, Adasum's
rules (``hvps.adapters.common.ops`` resolves the op itself).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

import hvps
from hvps import ReduceOp
from hvps.api.collectives import _check_adasum
from hvps.core import dtypes
from hvps.runtime import process_sets

from .tensors import ArgumentError, check_dtype


def resolve(process_set: Any) -> tuple:
    """``hvps.runtime.process_sets.resolve``, whose ValueError (a set that is not registered, or that this
    rank is not a member of) is raised as Horovod's TensorFlow ops raise it: ``tf.errors.InvalidArgumentError``,
    still a ValueError (:class:`~hvps.adapters.tensorflow.tensors.ArgumentError`)."""
    try:
        return process_sets.resolve(process_set)
    except ValueError as err:
        raise ArgumentError(str(err)) from None


def members(process_set: Any) -> tuple:
    """``(set size, this rank's index in the set)``.

    Raises:
        ArgumentError: the set is unknown or excludes this rank (a ValueError and an InvalidArgumentError).
    """
    _, ranks = resolve(process_set)
    return len(ranks), ranks.index(hvps.rank())


def check_reduce(tensor: tf.Tensor, op: ReduceOp, process_set: Any) -> None:
    """Raise TypeError/ValueError/NotImplementedError where the core would refuse this reduction."""
    check_dtype(tensor)
    dtypes.check_reducible(np.dtype(tensor.dtype.as_numpy_dtype), op)
    set_id, ranks = resolve(process_set)
    if op is ReduceOp.Adasum:
        _check_adasum(set_id, len(ranks))


def check_rows(tensor: tf.Tensor, what: str) -> None:
    """Collectives along dim 0 need at least one dimension."""
    check_dtype(tensor)
    if tensor.shape.rank == 0:
        raise ValueError(f"{what} needs a tensor with at least one dimension")
