"""Horovod's collectives on tf.Tensors, eagerly and inside ``tf.function``.

Every collective is the core's (``hvps.allreduce`` ...) run through
:func:`tensors.run`: a direct call eagerly, one stateful ``tf.numpy_function``
in a graph. Gradients are registered with ``tf.custom_gradient`` for
allreduce (Sum/Average), grouped_allreduce, allgather and broadcast.

Ordering inside a graph: the numpy_function ops are stateful, so TensorFlow's
automatic control dependencies execute them in the order the Python code
created them (gradient collectives in the order ``tape.gradient`` created
them), the same on every rank. Unnamed collectives are numbered by the core in
submission order; explicit names must be the same on every rank.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

import hvps
from hvps import ReduceOp

from .compression import Compression, compress_tensor, decompress_tensor
from .tensors import as_tensor, check_dtype, run

Average, Sum, Min, Max, Product = hvps.Average, hvps.Sum, hvps.Min, hvps.Max, hvps.Product

_DIFFERENTIABLE_OPS = (ReduceOp.Sum, ReduceOp.Average)


def _resolve_op(average: Optional[bool], op: Optional[ReduceOp]) -> ReduceOp:
    if average is not None and op is not None:
        raise ValueError("give either average (deprecated) or op, not both")
    if op is not None:
        return ReduceOp(op) if not isinstance(op, ReduceOp) else op
    return Sum if average is False else Average


def _check_process_set(process_set: Any) -> None:
    if process_set is not None:
        raise NotImplementedError("hvps runs collectives on the global process set only; pass process_set=None")


def _zeros_if_none(grad: Optional[tf.Tensor], like: tf.Tensor) -> tf.Tensor:
    return tf.zeros_like(like) if grad is None else as_tensor(grad)


# -- allreduce ------------------------------------------------------------------------------
def _grouped_allreduce_raw(tensors: Sequence[tf.Tensor], op: ReduceOp, name: Optional[str],
                           prescale_factor: float, postscale_factor: float,
                           observe: Optional[Callable[[Sequence[np.ndarray]], None]] = None) -> list:
    """One core grouped_allreduce (fused per dtype) over ``tensors``; no gradient.

    ``observe(arrays)``, if given, sees the input arrays each time the op runs (byte accounting).
    """
    def reduce(*arrays):
        if observe is not None:
            observe(arrays)
        return hvps.grouped_allreduce(list(arrays), op=op, name=name, prescale_factor=prescale_factor,
                                      postscale_factor=postscale_factor)

    outs = run(reduce, tensors, [t.dtype for t in tensors], name="HvpsAllreduce")
    for out, t in zip(outs, tensors):
        out.set_shape(t.shape)
    return outs


def _grouped_allreduce(tensors: Sequence[tf.Tensor], op: ReduceOp, name: Optional[str],
                       prescale_factor: float, postscale_factor: float,
                       observe: Optional[Callable[[Sequence[np.ndarray]], None]] = None) -> list:
    """Differentiable grouped allreduce: d/dx of allreduce is the same allreduce of dy."""
    tensors = [as_tensor(t) for t in tensors]
    for t in tensors:
        check_dtype(t)

    @tf.custom_gradient
    def forward(*xs):
        ys = _grouped_allreduce_raw(xs, op, name, prescale_factor, postscale_factor, observe)

        def grad(*dys):
            if op not in _DIFFERENTIABLE_OPS:
                raise NotImplementedError(f"hvps registers allreduce gradients for Sum and Average only, not {op.name}")
            dys = [_zeros_if_none(dy, y) for dy, y in zip(dys, ys)]
            return _grouped_allreduce(dys, op, None, prescale_factor, postscale_factor)

        return ys, grad

    return list(forward(*tensors))


def _sparse_allreduce(slices: tf.IndexedSlices, op: ReduceOp, name: Optional[str]) -> tf.IndexedSlices:
    """IndexedSlices travel as allgathered (values, indices), as in Horovod."""
    if op not in _DIFFERENTIABLE_OPS:
        raise ValueError(f"IndexedSlices can only be reduced with Sum or Average, not {op.name}")
    values = allgather(slices.values, name=None if name is None else f"{name}.values")
    indices = allgather(slices.indices, name=None if name is None else f"{name}.indices")
    if op is ReduceOp.Average:
        values = values / tf.cast(hvps.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allreduce(tensor: Any, average: Optional[bool] = None, device_dense: str = "", device_sparse: str = "",
              compression=Compression.none, op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None, process_set: Any = None,
              ignore_name_scope: bool = False) -> Any:
    """Reduce ``tensor`` over all ranks (differentiable for Sum and Average).

    ``tf.IndexedSlices`` are allgathered (values and indices) instead; Average
    then divides the values by the number of ranks.
    """
    _check_process_set(process_set)
    op = _resolve_op(average, op)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, op, name)
    compressed, ctx = compress_tensor(compression, as_tensor(tensor))
    (reduced,) = _grouped_allreduce([compressed], op, name, prescale_factor, postscale_factor)
    return decompress_tensor(compression, reduced, ctx)


def grouped_allreduce(tensors: Sequence[Any], average: Optional[bool] = None, device_dense: str = "",
                      device_sparse: str = "", compression=Compression.none, op: Optional[ReduceOp] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: Optional[str] = None,
                      process_set: Any = None) -> list:
    """Reduce several tensors as one fused collective (per dtype); differentiable for Sum and Average."""
    _check_process_set(process_set)
    op = _resolve_op(average, op)
    if not tensors:
        return []
    pairs = [compress_tensor(compression, as_tensor(t)) for t in tensors]
    reduced = _grouped_allreduce([p[0] for p in pairs], op, name, prescale_factor, postscale_factor)
    return [decompress_tensor(compression, r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


# -- allgather ----------------------------------------------------------------------------
def _allgather_raw(tensor: tf.Tensor, name: Optional[str]) -> tf.Tensor:
    (out,) = run(lambda a: [hvps.allgather(a, name=name)], [tensor], [tensor.dtype], name="HvpsAllgather")
    out.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    return out


def _allgather_grad(dy: tf.Tensor, rows: tf.Tensor) -> tf.Tensor:
    """This rank's rows of the sum over ranks of ``dy``."""
    def grad(d, n):
        summed = hvps.allreduce(d, op=Sum)
        counts = hvps.allgather(np.asarray([n], dtype=np.int64))
        start = int(counts[: hvps.rank()].sum())
        return [np.ascontiguousarray(summed[start : start + int(n)])]

    (out,) = run(grad, [dy, tf.cast(rows, tf.int64)], [dy.dtype], name="HvpsAllgatherGrad")
    out.set_shape(tf.TensorShape([None]).concatenate(dy.shape[1:]))
    return out


def allgather(tensor: Any, name: Optional[str] = None, process_set: Any = None,
              ignore_name_scope: bool = False) -> tf.Tensor:
    """Concatenate every rank's tensor along dim 0 (which may differ by rank); differentiable."""
    _check_process_set(process_set)
    tensor = as_tensor(tensor)
    check_dtype(tensor)
    if tensor.shape.rank == 0:
        raise ValueError("allgather needs a tensor with at least one dimension")

    @tf.custom_gradient
    def forward(x):
        y = _allgather_raw(x, name)

        def grad(dy):
            return _allgather_grad(_zeros_if_none(dy, y), tf.shape(x)[0])

        return y, grad

    return forward(tensor)


# -- broadcast ----------------------------------------------------------------------------
def _broadcast_raw(tensors: Sequence[tf.Tensor], root_rank: int, names: Sequence[Optional[str]]) -> list:
    """Broadcast several tensors from ``root_rank`` (all started, then all waited for)."""
    def bcast(*arrays):
        handles = [hvps.broadcast_async(a, root_rank, name=n) for a, n in zip(arrays, names)]
        return [h.wait() for h in handles]

    outs = run(bcast, tensors, [t.dtype for t in tensors], name="HvpsBroadcast")
    for out, t in zip(outs, tensors):
        out.set_shape(t.shape)
    return outs


def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None, process_set: Any = None,
              ignore_name_scope: bool = False) -> tf.Tensor:
    """Return the root's tensor on every rank; the gradient sums dy onto the root (zeros elsewhere)."""
    _check_process_set(process_set)
    tensor = as_tensor(tensor)
    check_dtype(tensor)

    @tf.custom_gradient
    def forward(x):
        (y,) = _broadcast_raw([x], root_rank, [name])

        def grad(dy):
            (summed,) = _grouped_allreduce_raw([_zeros_if_none(dy, y)], Sum, None, 1.0, 1.0)
            return summed if hvps.rank() == root_rank else tf.zeros_like(summed)

        return y, grad

    return forward(tensor)


def broadcast_(variables: Any, root_rank: int, name: Optional[str] = None, process_set: Any = None) -> Any:
    """Overwrite a variable (or a list of them) in place with the root's values."""
    _check_process_set(process_set)
    single = not isinstance(variables, (list, tuple))
    var_list = [variables] if single else list(variables)
    if not var_list:
        return variables
    values = [tf.convert_to_tensor(v) for v in var_list]
    for v in values:
        check_dtype(v, "variable")
    base = name or "broadcast_"
    outs = _broadcast_raw(values, root_rank, [f"{base}.{i}" for i in range(len(values))])
    assigns = [v.assign(o) for v, o in zip(var_list, outs)]
    return assigns[0] if single else assigns


# -- alltoall, reducescatter ----------------------------------------------------------------
def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None, ignore_name_scope: bool = False,
             process_set: Any = None) -> tuple:
    """Send ``splits[r]`` rows to rank r (equal blocks without splits): ``(output, received_splits)``."""
    _check_process_set(process_set)
    tensor = as_tensor(tensor)
    check_dtype(tensor)
    if splits is None:
        def exchange(a):
            out, received = hvps.alltoall(a, None, name=name)
            return [out, np.asarray(received, dtype=np.int32)]
        inputs = [tensor]
    else:
        def exchange(a, s):
            out, received = hvps.alltoall(a, [int(x) for x in np.asarray(s).reshape(-1)], name=name)
            return [out, np.asarray(received, dtype=np.int32)]
        inputs = [tensor, tf.cast(as_tensor(splits), tf.int64)]
    out, received = run(exchange, inputs, [tensor.dtype, tf.int32], name="HvpsAlltoall")
    out.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    received.set_shape([hvps.size()])
    return out, received


def reducescatter(tensor: Any, device_dense: str = "", compression=Compression.none, op: ReduceOp = Average,
                  name: Optional[str] = None, process_set: Any = None, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce ``tensor`` over ranks and return this rank's block of dim 0 (first ranks get the remainder)."""
    _check_process_set(process_set)
    op = _resolve_op(None, op)
    compressed, ctx = compress_tensor(compression, as_tensor(tensor))
    check_dtype(compressed)
    (out,) = run(lambda a: [hvps.reducescatter(a, op=op, name=name, prescale_factor=prescale_factor,
                                               postscale_factor=postscale_factor)],
                 [compressed], [compressed.dtype], name="HvpsReducescatter")
    out.set_shape(tf.TensorShape([None]).concatenate(compressed.shape[1:]))
    return decompress_tensor(compression, out, ctx)


# -- control ---------------------------------------------------------------------------------
def join() -> int:
    """Stop contributing; other ranks' allreduces proceed with zeros. Returns the last rank to join."""
    return hvps.join()


def barrier(process_set: Any = None) -> None:
    """Return once every rank has called barrier()."""
    _check_process_set(process_set)
    hvps.barrier()
