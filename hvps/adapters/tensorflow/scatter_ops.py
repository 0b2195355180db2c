"""Horovod's alltoall, reducescatter and grouped_reducescatter on tf.Tensors, with their gradients.

Like ``mpi_ops``: the core's collective in one stateful op, ``process_set=`` on each, argument
errors raised while the op is built. Gradients (Horovod's):

- alltoall: the output gradient sent back with the received splits;
- reducescatter: the members' output gradients allgathered, scaled as the forward pass scaled
  (prescale, postscale, and the set size for Sum), as the PyTorch adapter does.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf

import hvps
from hvps import ProcessSet, ReduceOp, global_process_set
from hvps.api.collectives import _scatter_op
from hvps.control.negotiation import ALLTOALL, REDUCESCATTER
from hvps.core import scaling

from .checks import check_reduce, check_rows, members
from .compression import Compression, compress_for_sum, decompress_sum
from .mpi_ops import Average, _rows_known, _zeros_if_none, grouped_allgather
from .tensors import as_tensor, fails_everywhere, run


# -- alltoall ----------------------------------------------------------------------------------
def _splits_tensor(splits: Any) -> tf.Tensor:
    splits = as_tensor(splits)
    if not splits.dtype.is_integer:
        raise ValueError(f"alltoall splits must be a tensor of integers, not {splits.dtype.name}")
    return tf.cast(tf.reshape(splits, [-1]), tf.int64)


def _alltoall_raw(tensor: tf.Tensor, splits: Optional[tf.Tensor], name: Optional[str],
                  process_set: Optional[ProcessSet]) -> tuple:
    set_size = members(process_set)[0]

    def exchange(a, *s):
        chosen = [int(x) for x in s[0]] if s else None
        out, received = hvps.alltoall(a, chosen, name=name, process_set=process_set)
        return [out, np.asarray(received, dtype=np.int32)]

    inputs = [tensor] if splits is None else [tensor, splits]
    out, received = run(exchange, inputs, [tensor.dtype, tf.int32], name="HvpsAlltoall")
    _rows_known([out], [tensor])
    received.set_shape([set_size])
    return out, received


@fails_everywhere(ALLTOALL)
def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None, ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows to the set's i-th rank (equal blocks without splits); differentiable.

    Args:
        tensor: this rank's rows, sent in consecutive blocks to the set's ranks in order.
        splits: rows for each rank (one int per member, summing to dim 0); None: equal blocks.
        name: the collective's name, the same on every rank (default: numbered in call order).
        ignore_name_scope: Horovod's argument, accepted and ignored.
        process_set: the ranks that exchange (default: all).

    Returns:
        The rows received, in rank order; with ``splits``, ``(tensor, received_splits)`` (int32).

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    tensor = as_tensor(tensor)
    check_rows(tensor, "alltoall")
    split_tensor = None if splits is None else _splits_tensor(splits)

    @tf.custom_gradient
    def forward(x):
        out, received = _alltoall_raw(x, split_tensor, name, process_set)

        def grad(dy, _unused=None):
            back, _ = _alltoall_raw(_zeros_if_none(dy, out), tf.cast(received, tf.int64), None, process_set)
            return back

        return (out, received), grad

    out, received = forward(tensor)
    return out if splits is None else (out, tf.stop_gradient(received))


# -- reducescatter -----------------------------------------------------------------------------
def _grouped_reducescatter(tensors: Sequence[tf.Tensor], op: ReduceOp, name: Optional[str],
                           prescale_factor: float, postscale_factor: float,
                           process_set: Optional[ProcessSet]) -> list:
    op = _scatter_op(op)
    for t in tensors:
        check_rows(t, "reducescatter")
        check_reduce(t, op, process_set)
    set_size = members(process_set)[0]
    factor = scaling.gradient_factor(op, set_size, prescale_factor, postscale_factor)

    @tf.custom_gradient
    def forward(*xs):
        ys = run(lambda *arrays: hvps.grouped_reducescatter(list(arrays), op=op, name=name,
                                                            prescale_factor=prescale_factor,
                                                            postscale_factor=postscale_factor,
                                                            process_set=process_set),
                 xs, [x.dtype for x in xs], name="HvpsReducescatter")
        _rows_known(ys, xs)

        def grad(*dys):
            gathered = grouped_allgather([_zeros_if_none(dy, y) for dy, y in zip(dys, ys)], process_set=process_set)
            return [g * tf.cast(factor, g.dtype) if factor != 1 else g for g in gathered]

        return ys, grad

    return list(forward(*tensors))


@fails_everywhere(REDUCESCATTER)
def reducescatter(tensor: Any, device_dense: str = "", compression=Compression.none, op: ReduceOp = Average,
                  name: Optional[str] = None, process_set: ProcessSet = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce ``tensor`` over the set's ranks and return this rank's block of dim 0 (first ranks get the
    remainder); differentiable.

    Args:
        tensor: the tensor to reduce (the same shape and dtype on every rank).
        device_dense: Horovod's placement argument, accepted and ignored.
        compression: ``Compression.none``, ``fp16``, ``bf16`` or a summable compressor, applied on the wire.
        op: ``Average`` (the default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        name: the collective's name, the same on every rank (default: numbered in call order).
        process_set: the ranks that reduce together (default: all).
        ignore_name_scope: Horovod's argument, accepted and ignored.
        prescale_factor: each rank's tensor is multiplied by it before the reduction.
        postscale_factor: the result is multiplied by it.

    Returns:
        This rank's block of the reduction's dim 0.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    (compressed,), ctxs, plan = compress_for_sum(compression, [as_tensor(tensor)], op, lambda: members(process_set)[0],
                                                 prescale_factor, postscale_factor)
    outs = _grouped_reducescatter([compressed], plan.op, name, plan.prescale, plan.postscale, process_set)
    return decompress_sum(compression, outs, ctxs, plan)[0]


@fails_everywhere(REDUCESCATTER)
def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "", compression=Compression.none,
                          op: ReduceOp = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list:
    """Reducescatter several tensors together (differentiable).

    Args:
        tensors: the tensors to reduce; the other arguments are :func:`reducescatter`'s, applied to each.

    Returns:
        This rank's blocks, a list in input order.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    if not tensors:
        return list(tensors)
    payloads, ctxs, plan = compress_for_sum(compression, [as_tensor(t) for t in tensors], op,
                                            lambda: members(process_set)[0], prescale_factor, postscale_factor)
    outs = _grouped_reducescatter(payloads, plan.op, None, plan.prescale, plan.postscale, process_set)
    return decompress_sum(compression, outs, ctxs, plan)
