"""Horovod's tensor collectives for PyTorch: ``op``, ``op_``, ``op_async``, ``op_async_``.

Every function takes ``process_set=`` (default: every rank). The differentiable ones
(``allreduce``, ``grouped_allreduce``, ``allgather``, ``grouped_allgather``, ``broadcast``,
``alltoall``, ``reducescatter``, ``grouped_reducescatter``) have Horovod's gradients.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

import hvps
from hvps import ProcessSet, ReduceOp, global_process_set
from hvps.adapters.common.ops import resolve_op
from hvps.api.collectives import check_name, fails_everywhere, synchronous
from hvps.control.negotiation import ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, REDUCESCATTER
from hvps.core import scaling
from hvps.runtime import basics as _basics  # noqa: F401 - Horovod's hvd.mpi_ops._basics

from .compression import OPS, Compression, compress_for_sum, decompress_sum
from .tensors import core_buffer, core_input, from_core

Average, Sum, Min, Max, Product, Adasum = hvps.Average, hvps.Sum, hvps.Min, hvps.Max, hvps.Product, hvps.Adasum


def synchronize(handle: hvps.Handle) -> Any:
    """Wait for an asynchronous collective and return its output.

    Args:
        handle: what an ``*_async`` function returned.

    Returns:
        The collective's output (a tensor, a list of them, or what the function says).

    Raises:
        HvpsError: the collective failed (on every rank that submitted it).
    """
    return handle.wait()


def poll(handle: hvps.Handle) -> bool:
    """Whether an asynchronous collective has completed; ``synchronize`` then returns at once.

    Args:
        handle: what an ``*_async`` function returned.

    Returns:
        True once it has completed (or failed).
    """
    return handle.poll()


def _set_size(process_set: ProcessSet) -> int:
    return hvps.size() if process_set is None else process_set.size()


def _set_rank(process_set: ProcessSet) -> int:
    return hvps.rank() if process_set is None else process_set.rank()


def _writeback(target: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """Make ``target`` hold ``buffer``'s values (no-op when they are the same memory)."""
    if buffer.data_ptr() != target.data_ptr() or buffer.device != target.device:
        target.data.copy_(buffer)
    return target


def _outputs(tensors: Sequence[torch.Tensor]) -> Callable[[list], list]:
    return lambda outs: [from_core(o, t.device) for o, t in zip(outs, tensors)]


# -- allreduce ----------------------------------------------------------------
def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[ReduceOp] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> hvps.Handle:
    """Start reducing ``tensors`` in place as one fused collective.

    Args:
        tensors: the tensors, each overwritten with its reduction; the other arguments are
            :func:`grouped_allreduce`'s.

    Returns:
        A handle: :func:`synchronize` waits for it and returns the tensors; :func:`poll` says whether it is done.
    """
    pairs = [core_buffer(t) for t in tensors]
    arrays = [array for array, _ in pairs]
    core = hvps.grouped_allreduce_async(arrays, resolve_op(average, op), name, prescale_factor,
                                        postscale_factor, outs=arrays, process_set=process_set)
    return core.then(lambda _: [_writeback(t, buffer) for t, (_, buffer) in zip(tensors, pairs)])


@fails_everywhere(ALLREDUCE)
def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[ReduceOp] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> hvps.Handle:
    """Start reducing ``tensors`` as one fused collective into new tensors.

    Args:
        tensors: the tensors to reduce; the other arguments are :func:`grouped_allreduce`'s.

    Returns:
        A handle: :func:`synchronize` waits for it and returns the reduced tensors; :func:`poll` says whether it is done.
    """
    core = hvps.grouped_allreduce_async([core_input(t) for t in tensors], resolve_op(average, op), name,
                                        prescale_factor, postscale_factor, process_set=process_set)
    return core.then(_outputs(tensors))


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[ReduceOp] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> hvps.Handle:
    """Start reducing ``tensor`` in place over the set's ranks.

    Args:
        tensor: overwritten with the reduction; the other arguments are :func:`allreduce`'s.

    Returns:
        A handle: :func:`synchronize` waits for it and returns ``tensor``; :func:`poll` says whether it is done.
    """
    return grouped_allreduce_async_([tensor], average, name, op, prescale_factor, postscale_factor,
                                    process_set).then(lambda outs: outs[0])


@fails_everywhere(ALLREDUCE)
def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[ReduceOp] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> hvps.Handle:
    """Start reducing ``tensor`` over the set's ranks into a new tensor.

    Args:
        tensor: the tensor to reduce; the other arguments are :func:`allreduce`'s.

    Returns:
        A handle: :func:`synchronize` waits for it and returns the reduced tensor; :func:`poll` says whether it is done.
    """
    core = hvps.allreduce_async(core_input(tensor), resolve_op(average, op), name, prescale_factor,
                                postscale_factor, process_set=process_set)
    return core.then(lambda out: from_core(out, tensor.device))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return allreduce_async(tensor, name=name, op=op, prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor, process_set=process_set).wait()

    @staticmethod
    def backward(ctx, grad_output):
        op, pre, post, process_set = ctx.args
        grad = allreduce_async(grad_output.contiguous(), op=op, prescale_factor=pre, postscale_factor=post,
                               process_set=process_set).wait()
        return grad, None, None, None, None, None


@synchronous
def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression=Compression.none, op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the set's ranks (differentiable); ``compression`` applies on the wire.

    Args:
        tensor: the tensor to reduce (same shape and dtype on every rank).
        average: Horovod's deprecated flag: False means ``op=Sum``; give ``op`` instead.
        name: the collective's name, the same on every rank (default: numbered in call order).
        compression: ``Compression.none``, ``fp16``, ``bf16``, ``int8`` or a compressor, applied on the wire.
        op: ``Average`` (the default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``.
        prescale_factor: each rank's tensor is multiplied by it before the reduction.
        postscale_factor: the result is multiplied by it.
        process_set: the ranks that reduce together (default: all).

    Returns:
        A new tensor holding the reduction, on ``tensor``'s device.

    Raises:
        ValueError: arguments this rank refuses (``average`` with ``op``, an unknown op, a rank outside
            ``process_set``); the ranks that submitted the collective fail at once with this reason.
        HvpsError: the collective failed on every rank: the ranks disagree on it, a rank never submits it
            (the stall check), or a rank is lost.
    """
    op = resolve_op(average, op)
    (compressed,), ctxs, plan = compress_for_sum(compression, [tensor], op, lambda: _set_size(process_set), prescale_factor,
                                                 postscale_factor)
    summed = _Allreduce.apply(compressed, name, plan.op, plan.prescale, plan.postscale, process_set)
    return decompress_sum(compression, [summed], ctxs, plan)[0]


@synchronous
def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[ReduceOp] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place over the set's ranks.

    Args:
        tensor: overwritten with the reduction; the other arguments are :func:`allreduce`'s.

    Returns:
        ``tensor``.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set).wait()


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return tuple(grouped_allreduce_async(list(tensors), name=name, op=op, prescale_factor=prescale_factor,
                                             postscale_factor=postscale_factor, process_set=process_set).wait())

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, process_set = ctx.args
        reduced = grouped_allreduce_async([g.contiguous() for g in grads], op=op, prescale_factor=pre,
                                          postscale_factor=post, process_set=process_set).wait()
        return (None, None, None, None, None, *reduced)


@synchronous
def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                      compression=Compression.none, op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list:
    """Reduce several tensors as one fused collective (differentiable).

    Args:
        tensors: the tensors to reduce (dtypes may differ); the other arguments are :func:`allreduce`'s,
            applied to each.

    Returns:
        A list of new tensors, the reductions of ``tensors`` in order.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    op = resolve_op(average, op)
    payloads, ctxs, plan = compress_for_sum(compression, list(tensors), op, lambda: _set_size(process_set), prescale_factor,
                                            postscale_factor)
    outs = _GroupedAllreduce.apply(name, plan.op, plan.prescale, plan.postscale, process_set, *payloads)
    return decompress_sum(compression, list(outs), ctxs, plan)


@synchronous
def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                       op: Optional[ReduceOp] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list:
    """Reduce several tensors in place as one fused collective.

    Args:
        tensors: each overwritten with its reduction; the other arguments are :func:`allreduce`'s.

    Returns:
        ``tensors``, as a list.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                    process_set).wait()


def sparse_allreduce_handle(tensor: torch.Tensor, name: str, op: ReduceOp,
                            process_set: ProcessSet = global_process_set) -> hvps.Handle:
    """Start reducing a sparse COO tensor by allgathering its indices and values; the handle
    yields the reduced sparse tensor."""
    sparse = tensor.coalesce() if not tensor.is_coalesced() else tensor
    # indices and values travel as one grouped allgather: both are submitted, or neither
    handle = grouped_allgather_async([sparse._indices().t().contiguous(), sparse._values().contiguous()],
                                     name=f"sparse.{check_name(name)}", process_set=process_set)
    size = _set_size(process_set)

    def result(gathered: list) -> torch.Tensor:
        gathered_indices, gathered_values = gathered
        return torch.sparse_coo_tensor(gathered_indices.t(), scaling.averaged(gathered_values, op, size, OPS),
                                       tensor.shape)

    return handle.then(result)


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: ReduceOp,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse COO tensor (Horovod's interface): every rank's indices and values are
    allgathered, and the result is their sum (or average) as a sparse tensor.

    Args:
        tensor: a sparse COO tensor of the same dense shape on every rank.
        name: the collective's name, the same on every rank.
        op: ``Average`` or ``Sum``.
        process_set: the ranks that reduce together.

    Returns:
        A function that waits and returns the reduced sparse tensor.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    return sparse_allreduce_handle(tensor, name, op, process_set).wait


# -- allgather ------------------------------------------------------------------------
@fails_everywhere(ALLGATHER)
def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> hvps.Handle:
    """Start concatenating every member's tensor along dim 0.

    Args:
        tensor: this rank's rows; the other arguments are :func:`allgather`'s.

    Returns:
        A handle: :func:`synchronize` waits for it and returns the concatenation; :func:`poll` says whether it is done.
    """
    core = hvps.allgather_async(core_input(tensor), name, process_set)
    return core.then(lambda out: from_core(out, tensor.device))


@fails_everywhere(ALLGATHER)
def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> hvps.Handle:
    """Start allgathering several tensors together.

    Args:
        tensors: this rank's tensors; the other arguments are :func:`allgather`'s.

    Returns:
        A handle: :func:`synchronize` waits for it and returns a list of the concatenations; :func:`poll` says whether it is done.
    """
    core = hvps.grouped_allgather_async([core_input(t) for t in tensors], name, process_set)
    return core.then(_outputs(tensors))


def _own_rows(grads: Sequence[torch.Tensor], rows: Sequence[int], process_set: ProcessSet) -> list:
    """The gradients of allgather inputs: each member's block of the averaged output gradients."""
    reduced = grouped_allreduce_async([g.contiguous() for g in grads], op=Average, process_set=process_set).wait()
    counts = allgather_async(torch.tensor([list(rows)], dtype=torch.int64), process_set=process_set).wait()
    before = counts[: _set_rank(process_set)].sum(dim=0).tolist()
    return [g.narrow(0, int(offset), n) for g, offset, n in zip(reduced, before, rows)]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.process_set = process_set
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        return tuple(grouped_allgather_async(list(tensors), name, process_set).wait())

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_own_rows(grads, ctx.rows, ctx.process_set))


@synchronous
def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every member's tensor along dim 0 (differentiable).

    Args:
        tensor: this rank's rows: the same shape past dim 0 and dtype on every rank; dim 0 may differ.
        name: the collective's name, the same on every rank (default: numbered in call order).
        process_set: the ranks that gather (default: all).

    Returns:
        A new tensor: the members' tensors in rank order, along dim 0.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    return _Allgather.apply(name, process_set, tensor)[0]


@synchronous
def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> list:
    """Allgather several tensors together (differentiable).

    Args:
        tensors: this rank's tensors; the other arguments are :func:`allgather`'s.

    Returns:
        A list of new tensors, one concatenation per tensor.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    return list(_Allgather.apply(name, process_set, *tensors))


# -- broadcast ------------------------------------------------------------------------
@fails_everywhere(BROADCAST)
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> hvps.Handle:
    """Start copying the root's tensor to a new tensor on every member.

    Args:
        tensor: the root's data (elsewhere: its shape and dtype); the other arguments are :func:`broadcast`'s.

    Returns:
        A handle: :func:`synchronize` waits for it and returns the root's tensor; :func:`poll` says whether it is done.
    """
    core = hvps.broadcast_async(core_input(tensor), root_rank, name, process_set=process_set)
    return core.then(lambda out: from_core(out, tensor.device))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> hvps.Handle:
    """Start overwriting ``tensor`` in place with the root's.

    Args:
        tensor: the root's data, overwritten elsewhere; the other arguments are :func:`broadcast`'s.

    Returns:
        A handle: :func:`synchronize` waits for it and returns ``tensor``; :func:`poll` says whether it is done.
    """
    array, buffer = core_buffer(tensor)
    core = hvps.broadcast_async(array, root_rank, name, out=array, process_set=process_set)
    return core.then(lambda _: _writeback(tensor, buffer))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return broadcast_async(tensor, root_rank, name, process_set).wait()

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce_async(grad_output.contiguous(), op=Average, process_set=ctx.process_set).wait()
        if hvps.rank() != ctx.root_rank:
            grad = torch.zeros_like(grad)
        return grad, None, None, None


@synchronous
def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return the root's tensor on every member (differentiable).

    Args:
        tensor: the root's data; on the other ranks, a tensor of the same shape and dtype.
        root_rank: the rank whose tensor every member receives (a rank of ``process_set``).
        name: the collective's name, the same on every rank (default: numbered in call order).
        process_set: the ranks that take part (default: all).

    Returns:
        A new tensor holding the root's values.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    return _Broadcast.apply(tensor, root_rank, name, process_set)


@synchronous
def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` in place with the root's.

    Args:
        tensor: the root's data, overwritten elsewhere; the other arguments are :func:`broadcast`'s.

    Returns:
        ``tensor``.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


# -- alltoall -------------------------------------------------------------------------
def _splits_list(splits: Any) -> Any:
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype.is_complex or splits.dtype == torch.bool:
            raise ValueError(f"alltoall splits must be a tensor of integers, not {splits.dtype}")
        return splits.tolist()
    return splits


@fails_everywhere(ALLTOALL)
def alltoall_async(tensor: torch.Tensor, splits: Optional[Any] = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> hvps.Handle:
    """Start sending ``splits[i]`` rows to the set's i-th rank.

    Args:
        tensor: this rank's rows; the other arguments are :func:`alltoall`'s.

    Returns:
        A handle: :func:`synchronize` waits for it and returns ``(output, received_splits)``; :func:`poll` says whether it is done.
    """
    core = hvps.alltoall_async(core_input(tensor), _splits_list(splits), name, process_set)
    splits_device = splits.device if isinstance(splits, torch.Tensor) else torch.device("cpu")
    return core.then(lambda res: (from_core(res[0], tensor.device),
                                          torch.as_tensor(res[1], dtype=torch.int32).to(splits_device)))


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = alltoall_async(tensor, splits, name, process_set).wait()
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, _unused):
        grad, _ = alltoall_async(grad_output.contiguous(), ctx.received, process_set=ctx.process_set).wait()
        return grad, None, None, None


@synchronous
def alltoall(tensor: torch.Tensor, splits: Optional[Any] = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Exchange rows with every member (differentiable).

    Args:
        tensor: this rank's rows, sent in consecutive blocks to the set's ranks in order.
        splits: how many rows go to each rank (a list or an int tensor of the set's size); default: equal
            blocks (dim 0 must then divide by the set's size).
        name: the collective's name, the same on every rank (default: numbered in call order).
        process_set: the ranks that exchange (default: all).

    Returns:
        The rows received from every rank, in rank order; with ``splits``, ``(tensor, received_splits)``.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    output, received = _Alltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


# -- reducescatter ----------------------------------------------------------------------
@fails_everywhere(REDUCESCATTER)
def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: ReduceOp = Average,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        process_set: ProcessSet = global_process_set) -> hvps.Handle:
    """Start reducing ``tensor`` and keeping this rank's block of dim 0.

    Args:
        tensor: the tensor to reduce; the other arguments are :func:`reducescatter`'s.

    Returns:
        A handle: :func:`synchronize` waits for it and returns this rank's block; :func:`poll` says whether it is done.
    """
    core = hvps.reducescatter_async(core_input(tensor), op, name, prescale_factor, postscale_factor, process_set)
    return core.then(lambda out: from_core(out, tensor.device))


@fails_everywhere(REDUCESCATTER)
def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None, op: ReduceOp = Average,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                process_set: ProcessSet = global_process_set) -> hvps.Handle:
    """Start reducescattering several tensors together.

    Args:
        tensors: the tensors to reduce; the other arguments are :func:`reducescatter`'s.

    Returns:
        A handle: :func:`synchronize` waits for it and returns a list of this rank's blocks; :func:`poll` says whether it is done.
    """
    core = hvps.grouped_reducescatter_async([core_input(t) for t in tensors], op, name, prescale_factor,
                                            postscale_factor, process_set)
    return core.then(_outputs(tensors))


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        # Horovod's gradient: the members' output gradients gathered back, scaled as the forward
        # pass scaled (a Sum counts every member's contribution)
        ctx.process_set = process_set
        ctx.factor = scaling.gradient_factor(op, _set_size(process_set), prescale_factor, postscale_factor)
        return tuple(grouped_reducescatter_async(list(tensors), name, op, prescale_factor, postscale_factor,
                                                 process_set).wait())

    @staticmethod
    def backward(ctx, *grads):
        gathered = grouped_allgather_async([g.contiguous() for g in grads], process_set=ctx.process_set).wait()
        return (None, None, None, None, None, *[g * ctx.factor if ctx.factor != 1 else g for g in gathered])


@synchronous
def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression=Compression.none,
                  op: ReduceOp = Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the set's ranks and return this rank's block of dim 0 (differentiable).

    Args:
        tensor: the tensor to reduce (same shape and dtype on every rank).
        name: the collective's name, the same on every rank (default: numbered in call order).
        compression: ``Compression.none``, ``fp16``, ``bf16`` or a summable compressor, applied on the wire.
        op: ``Average`` (the default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: each rank's tensor is multiplied by it before the reduction.
        postscale_factor: the result is multiplied by it.
        process_set: the ranks that reduce together (default: all).

    Returns:
        This rank's block of the reduction's dim 0 (blocks as even as possible; the first ranks get the
        remainder).

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    (compressed,), ctxs, plan = compress_for_sum(compression, [tensor], op, lambda: _set_size(process_set), prescale_factor,
                                                 postscale_factor)
    out = _Reducescatter.apply(name, plan.op, plan.prescale, plan.postscale, process_set, compressed)[0]
    return decompress_sum(compression, [out], ctxs, plan)[0]


@synchronous
def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None, compression=Compression.none,
                          op: ReduceOp = Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          process_set: ProcessSet = global_process_set) -> list:
    """Reducescatter several tensors together (differentiable).

    Args:
        tensors: the tensors to reduce; the other arguments are :func:`reducescatter`'s.

    Returns:
        A list of this rank's blocks, one per tensor.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    payloads, ctxs, plan = compress_for_sum(compression, list(tensors), op, lambda: _set_size(process_set), prescale_factor,
                                            postscale_factor)
    outs = _Reducescatter.apply(name, plan.op, plan.prescale, plan.postscale, process_set, *payloads)
    return decompress_sum(compression, list(outs), ctxs, plan)


# -- synchronisation --------------------------------------------------------------------
@synchronous
def join(device: int = -1) -> int:
    """Stop contributing; other ranks' allreduces proceed with zeros until every rank has joined.

    Args:
        device: the GPU index on which this rank makes the zeros it contributes to collectives on CUDA
            tensors (Horovod's argument); -1, the default, means the device of this rank's CUDA tensors, else
            its local rank's GPU.

    Returns:
        The last rank to join.

    Raises:
        HvpsError: a collective other than allreduce was submitted by the ranks still training, or the job
            failed meanwhile.
    """
    return hvps.join(device)


@synchronous
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every member of the set has called barrier().

    Args:
        process_set: the ranks that wait for each other (default: all).

    Raises:
        HvpsError: a rank is lost or never arrives (the stall check).
    """
    hvps.barrier(process_set)
