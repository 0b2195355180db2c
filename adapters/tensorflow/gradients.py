"""Averaging a list of gradients over ranks: what DistributedGradientTape and the Keras
DistributedOptimizer share.

Dense gradients travel in one grouped allreduce (the core fuses them per dtype,
so a ResNet-50 step is one collective per dtype, one graph op); ``tf.IndexedSlices``
are allgathered as (values, indices), or densified first with ``sparse_as_dense``.
``None`` gradients stay ``None``: they come from the model's structure, which is
the same on every rank.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import tensorflow as tf

import hvps
from hvps import ReduceOp

from .compression import Compression
from .mpi_ops import Average, _resolve_op, _sparse_allreduce, grouped_allreduce


def scale_factors(op: ReduceOp, gradient_predivide_factor: float) -> tuple:
    """(prescale, postscale) for Horovod's gradient_predivide_factor (Average only)."""
    if gradient_predivide_factor != 1.0:
        if op is not ReduceOp.Average:
            raise ValueError("gradient_predivide_factor is only defined for op=Average")
        return 1.0 / gradient_predivide_factor, gradient_predivide_factor
    return 1.0, 1.0


def allreduce_gradients(grads: Sequence[Any], op: ReduceOp = Average, compression=Compression.none,
                        sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                        name: Optional[str] = None) -> list:
    """Reduce ``grads`` (tensors, IndexedSlices or None) over all ranks; same structure back."""
    op = _resolve_op(None, op)
    prescale, postscale = scale_factors(op, gradient_predivide_factor)
    grads = list(grads)
    if hvps.size() == 1 and prescale == postscale == 1.0:
        return grads  # every op is the identity on one rank
    out: list = [None] * len(grads)
    dense_index, dense = [], []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            if sparse_as_dense:
                g = tf.convert_to_tensor(g)
            else:
                out[i] = _sparse_allreduce(g, op, None if name is None else f"{name}.sparse.{i}")
                continue
        dense_index.append(i)
        dense.append(g)
    if dense:
        reduced = grouped_allreduce(dense, op=op, compression=compression, prescale_factor=prescale,
                                    postscale_factor=postscale, name=name)
        for i, r in zip(dense_index, reduced):
            out[i] = r
    return out
