"""Horovod's allreduce, allgather and broadcast on tf.Tensors, eagerly and inside ``tf.function``.

Every collective is the core's (``hvps.grouped_allreduce`` ...) run through :func:`tensors.run`:
a direct call eagerly, one stateful ``tf.numpy_function`` in a graph. Every one takes
``process_set=`` (default: every rank). Argument errors (dtype, op, process set, root rank) are
raised while the op is built, before anything is submitted, the same on every rank (see
``checks``). Gradients are Horovod's (``tf.custom_gradient``):

- allreduce / grouped_allreduce: the same allreduce of the output gradients (Sum, Average, Adasum);
- allgather / grouped_allgather: this rank's rows of the members' averaged output gradients;
- broadcast: the members' averaged output gradient on the root, zeros elsewhere.

Names: explicit names must be the same on every rank. Eagerly, unnamed collectives are numbered by
the core in submission order; in a graph, where TensorFlow chooses the order, they are named after
the op that runs them (``tensors.run``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

import hvps
from hvps import ProcessSet, ReduceOp, global_process_set
from hvps.adapters.common.ops import resolve_op
from hvps.api.collectives import check_name
from hvps.control.negotiation import ALLGATHER, ALLREDUCE, BROADCAST
from hvps.core import scaling
from hvps.runtime import basics as _basics  # noqa: F401 - Horovod's hvd.mpi_ops._basics

from .checks import check_reduce, check_rows, members
from .compression import OPS, Compression, compress_for_sum, decompress_sum
from .tensors import as_tensor, check_dtype, fails_everywhere, run

Average, Sum, Min, Max, Product, Adasum = hvps.Average, hvps.Sum, hvps.Min, hvps.Max, hvps.Product, hvps.Adasum

_DIFFERENTIABLE_OPS = (ReduceOp.Sum, ReduceOp.Average, ReduceOp.Adasum)


def _check_process_set(process_set: Any) -> None:
    """For wrappers that reduce over every rank only (compressed gradient pipelines)."""
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError("this wrapper reduces over the global process set only; pass process_set=None")


def _zeros_if_none(grad: Optional[tf.Tensor], like: tf.Tensor) -> tf.Tensor:
    return tf.zeros_like(like) if grad is None else as_tensor(grad)


def _rows_known(outs: Sequence[tf.Tensor], tensors: Sequence[tf.Tensor]) -> None:
    """Outputs of collectives along dim 0 keep every static dimension but the first."""
    for out, t in zip(outs, tensors):
        out.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))


# -- allreduce ------------------------------------------------------------------------------
def _grouped_allreduce_raw(tensors: Sequence[tf.Tensor], op: ReduceOp, name: Optional[str],
                           prescale_factor: float, postscale_factor: float,
                           observe: Optional[Callable[[Sequence[np.ndarray]], None]] = None,
                           process_set: Optional[ProcessSet] = None) -> list:
    """One core grouped_allreduce (fused per dtype) over ``tensors``; no gradient.

    ``observe(arrays)``, if given, sees the input arrays each time the op runs (byte accounting).
    """
    def reduce(*arrays):
        if observe is not None:
            observe(arrays)
        return hvps.grouped_allreduce(list(arrays), op=op, name=name, prescale_factor=prescale_factor,
                                      postscale_factor=postscale_factor, process_set=process_set)

    outs = run(reduce, tensors, [t.dtype for t in tensors], name="HvpsAllreduce")
    for out, t in zip(outs, tensors):
        out.set_shape(t.shape)
    return outs


def _grouped_allreduce(tensors: Sequence[tf.Tensor], op: ReduceOp, name: Optional[str],
                       prescale_factor: float, postscale_factor: float,
                       observe: Optional[Callable[[Sequence[np.ndarray]], None]] = None,
                       process_set: Optional[ProcessSet] = None) -> list:
    """Differentiable grouped allreduce: d/dx of allreduce is the same allreduce of dy."""
    tensors = [as_tensor(t) for t in tensors]
    for t in tensors:
        check_reduce(t, op, process_set)

    @tf.custom_gradient
    def forward(*xs):
        ys = _grouped_allreduce_raw(xs, op, name, prescale_factor, postscale_factor, observe, process_set)

        def grad(*dys):
            if op not in _DIFFERENTIABLE_OPS:
                raise NotImplementedError(f"allreduce has gradients for Sum, Average and Adasum, not {op.name}")
            dys = [_zeros_if_none(dy, y) for dy, y in zip(dys, ys)]
            return _grouped_allreduce(dys, op, None, prescale_factor, postscale_factor, process_set=process_set)

        return ys, grad

    return list(forward(*tensors))


def _sparse_allreduce(slices: tf.IndexedSlices, op: ReduceOp, name: Optional[str],
                      process_set: Optional[ProcessSet] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0) -> tf.IndexedSlices:
    """IndexedSlices travel as one grouped allgather of (values, indices), as in Horovod."""
    if op is ReduceOp.Adasum:
        raise NotImplementedError("Adasum does not support sparse tensors; pass sparse_as_dense=True")
    if op not in (ReduceOp.Sum, ReduceOp.Average):
        raise NotImplementedError(f"IndexedSlices can only be reduced with Sum or Average, not {op.name}")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("prescale_factor and postscale_factor are not supported with tf.IndexedSlices")
    values, indices = grouped_allgather([slices.values, slices.indices], name=name, process_set=process_set)
    values = scaling.averaged(values, op, members(process_set)[0], OPS)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


@fails_everywhere(ALLREDUCE)
def allreduce(tensor: Any, average: Optional[bool] = None, device_dense: str = "", device_sparse: str = "",
              compression=Compression.none, op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False) -> Any:
    """Reduce ``tensor`` over the set's ranks (differentiable for Sum, Average and Adasum).

    ``tf.IndexedSlices`` are allgathered (values and indices) instead; Average then divides the
    values by the set size.

    Args:
        tensor: a tensor (the same shape and dtype on every rank), or ``tf.IndexedSlices``.
        average: Horovod's deprecated flag: False means ``op=Sum``; give ``op`` instead.
        device_dense: Horovod's placement argument, accepted and ignored.
        device_sparse: Horovod's placement argument, accepted and ignored.
        compression: ``Compression.none``, ``fp16``, ``bf16`` or a compressor, applied on the wire.
        op: ``Average`` (the default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``.
        prescale_factor: each rank's tensor is multiplied by it before the reduction.
        postscale_factor: the result is multiplied by it.
        name: the collective's name, the same on every rank (default: numbered in call order).
        process_set: the ranks that reduce together (default: all).
        ignore_name_scope: Horovod's argument, accepted and ignored.

    Returns:
        The reduction (``tf.IndexedSlices`` for ``tf.IndexedSlices``).

    Raises:
        ValueError: arguments this rank refuses (``average`` with ``op``, a rank outside ``process_set``);
            the ranks that submitted the collective fail at once with this reason.
        NotImplementedError: ``tf.IndexedSlices`` with an op other than Sum and Average, or with scaling.
        HvpsError: the collective failed on every rank (disagreeing ranks, the stall check, a lost rank).
    """
    op = resolve_op(average, op)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, op, name, process_set, prescale_factor, postscale_factor)
    (compressed,), ctxs, plan = compress_for_sum(compression, [as_tensor(tensor)], op, lambda: members(process_set)[0],
                                                 prescale_factor, postscale_factor)
    reduced = _grouped_allreduce([compressed], plan.op, name, plan.prescale, plan.postscale, process_set=process_set)
    return decompress_sum(compression, reduced, ctxs, plan)[0]


@fails_everywhere(ALLREDUCE)
def grouped_allreduce(tensors: Sequence[Any], average: Optional[bool] = None, device_dense: str = "",
                      device_sparse: str = "", compression=Compression.none, op: Optional[ReduceOp] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                      name: Optional[str] = None) -> list:
    """Reduce several tensors as one fused collective (per dtype); IndexedSlices are allgathered.

    Args:
        tensors: the tensors (dtypes may differ); the other arguments are :func:`allreduce`'s, applied to each.

    Returns:
        The reductions, a list in input order.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    op = resolve_op(average, op)
    name = check_name(name)  # before it is built into the sparse tensors' names
    if not tensors:
        return list(tensors)
    out: list = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i in range(len(tensors)) if i not in sparse]
    for i in sparse:
        out[i] = _sparse_allreduce(tensors[i], op, None if name is None else f"{name}.sparse.{i}", process_set,
                                   prescale_factor, postscale_factor)
    if dense:
        payloads, ctxs, plan = compress_for_sum(compression, [as_tensor(tensors[i]) for i in dense], op,
                                                lambda: members(process_set)[0], prescale_factor, postscale_factor)
        reduced = _grouped_allreduce(payloads, plan.op, name, plan.prescale, plan.postscale, process_set=process_set)
        for i, r in zip(dense, decompress_sum(compression, reduced, ctxs, plan)):
            out[i] = r
    return out


# -- allgather ----------------------------------------------------------------------------
def _own_rows(dys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor], process_set: Optional[ProcessSet]) -> list:
    """Gradients of allgather inputs: this rank's block of the members' averaged output gradients."""
    set_rank = members(process_set)[1]
    rows = tf.stack([tf.shape(x, out_type=tf.int64)[0] for x in xs])

    def grad(*arrays):
        *grads, own = arrays
        averaged = hvps.grouped_allreduce(list(grads), op=Average, process_set=process_set)
        counts = hvps.allgather(np.asarray(own, dtype=np.int64).reshape(1, -1), process_set=process_set)
        starts = counts[:set_rank].sum(axis=0)
        return [np.ascontiguousarray(g[int(s): int(s) + int(n)]) for g, s, n in zip(averaged, starts, own)]

    outs = run(grad, [*dys, rows], [dy.dtype for dy in dys], name="HvpsAllgatherGrad")
    _rows_known(outs, dys)
    return outs


@fails_everywhere(ALLGATHER)
def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None, ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list:
    """Concatenate every member's tensors along dim 0, all submitted together (differentiable).

    Args:
        tensors: this rank's tensors (at least one); the other arguments are :func:`allgather`'s.

    Returns:
        One concatenation per tensor, in input order.

    Raises:
        ValueError: no tensors are given, or arguments this rank refuses (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    tensors = [as_tensor(t) for t in tensors]
    if not tensors:
        raise ValueError("grouped_allgather needs at least one tensor")
    for t in tensors:
        check_rows(t, "allgather")
    members(process_set)

    @tf.custom_gradient
    def forward(*xs):
        ys = run(lambda *arrays: hvps.grouped_allgather(list(arrays), name=name, process_set=process_set),
                 xs, [x.dtype for x in xs], name="HvpsAllgather")
        _rows_known(ys, xs)

        def grad(*dys):
            return _own_rows([_zeros_if_none(dy, y) for dy, y in zip(dys, ys)], xs, process_set)

        return ys, grad

    return list(forward(*tensors))


@fails_everywhere(ALLGATHER)
def allgather(tensor: Any, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate every member's tensor along dim 0 (which may differ by rank); differentiable.

    Args:
        tensor: this rank's rows (the other dimensions and the dtype equal on every rank).
        name: the collective's name, the same on every rank (default: numbered in call order).
        ignore_name_scope: Horovod's argument, accepted and ignored.
        process_set: the ranks that gather (default: all).

    Returns:
        The members' rows in rank order.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    return grouped_allgather([tensor], name=name, process_set=process_set)[0]


# -- broadcast ----------------------------------------------------------------------------
def _check_root(root_rank: int, process_set: Optional[ProcessSet]) -> None:
    ranks = process_set.ranks if process_set is not None else list(range(hvps.size()))
    if int(root_rank) not in ranks:
        raise ValueError(f"root_rank {root_rank} is not one of the ranks {list(ranks)} of the process set")


def _broadcast_raw(tensors: Sequence[tf.Tensor], root_rank: int, names: Sequence[Optional[str]],
                   process_set: Optional[ProcessSet] = None) -> list:
    """Broadcast several tensors from ``root_rank`` (all started, then all waited for)."""
    for t in tensors:
        check_dtype(t)
    members(process_set)
    _check_root(root_rank, process_set)

    def bcast(*arrays):
        handles = [hvps.broadcast_async(a, root_rank, name=n, process_set=process_set)
                   for a, n in zip(arrays, names)]
        return [h.wait() for h in handles]

    outs = run(bcast, tensors, [t.dtype for t in tensors], name="HvpsBroadcast")
    for out, t in zip(outs, tensors):
        out.set_shape(t.shape)
    return outs


@fails_everywhere(BROADCAST)
def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Return the root's tensor on every member; the gradient is the members' averaged dy on the root.

    Args:
        tensor: the root's data; on the other ranks, a tensor of the same shape and dtype.
        root_rank: the global rank whose tensor every member receives (a member of ``process_set``).
        name: the collective's name, the same on every rank (default: numbered in call order).
        ignore_name_scope: Horovod's argument, accepted and ignored.
        process_set: the ranks that take part (default: all).

    Returns:
        The root's values.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    tensor = as_tensor(tensor)

    @tf.custom_gradient
    def forward(x):
        (y,) = _broadcast_raw([x], root_rank, [name], process_set)

        def grad(dy):
            (averaged,) = _grouped_allreduce_raw([_zeros_if_none(dy, y)], Average, None, 1.0, 1.0,
                                                 process_set=process_set)
            if hvps.rank() == root_rank:
                return averaged
            with tf.control_dependencies([averaged]):  # in a graph, still run the others' allreduce here
                return tf.zeros_like(y)

        return y, grad

    return forward(tensor)


def broadcast_(variables: Any, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> Any:
    """Overwrite variables in place with the root's values.

    Args:
        variables: a variable or a list of them (the same shapes and dtypes on every rank).
        root_rank: the global rank whose values every member receives.
        name: the collectives' name prefix, the same on every rank.
        process_set: the ranks that take part (default: all).

    Returns:
        Their new values (a list for a list).

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    single = not isinstance(variables, (list, tuple))
    var_list = [variables] if single else list(variables)
    if not var_list:
        return []
    values = [tf.convert_to_tensor(v) for v in var_list]
    names = [None if name is None else f"{name}.{i}" for i in range(len(values))]
    outs = _broadcast_raw(values, root_rank, names, process_set)
    assigns = [v.assign(o) for v, o in zip(var_list, outs)]
    return assigns[0] if single else assigns


# -- control ---------------------------------------------------------------------------------
def join() -> int:
    """Stop contributing; other ranks' allreduces proceed with zeros until every rank has joined.

    Returns:
        The last rank to join.

    Raises:
        HvpsError: the ranks still training submitted another collective than allreduce, or the job failed.
    """
    return hvps.join()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every member of the set has called barrier().

    Args:
        process_set: the ranks that wait for each other (default: all).

    Raises:
        ArgumentError: the set is not registered, or this rank is not a member.
    """
    members(process_set)
    hvps.barrier(process_set)
