"""Horovod's tensor collectives for PyTorch: ``op``, ``op_``, ``op_async``, ``op_async_``."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

import hvps
from hvps import ReduceOp

from .compression import Compression, compress_tensor, decompress_tensor
from .tensors import core_buffer, core_input, from_core

Average, Sum, Min, Max, Product = hvps.Average, hvps.Sum, hvps.Min, hvps.Max, hvps.Product


class TorchHandle:
    """An in-flight collective on tensors; ``synchronize(handle)`` returns its output."""

    def __init__(self, core: hvps.Handle, finish: Callable[[Any], Any]) -> None:
        self._core = core
        self._finish = finish
        self._output: Any = None
        self._finished = False

    def poll(self) -> bool:
        """Whether the collective has completed."""
        return self._core.poll()

    def wait(self) -> Any:
        """Block until completion and return the output tensor(s)."""
        if not self._finished:
            result = self._core.wait()
            self._output = self._finish(result)
            self._finished = True
        return self._output


def synchronize(handle: TorchHandle) -> Any:
    """Wait for an asynchronous collective and return its output."""
    return handle.wait()


def poll(handle: TorchHandle) -> bool:
    """Whether an asynchronous collective has completed; ``synchronize`` then returns at once."""
    return handle.poll()


def _resolve_op(average: Optional[bool], op: Optional[ReduceOp]) -> ReduceOp:
    if average is not None and op is not None:
        raise ValueError("give either average (deprecated) or op, not both")
    if op is not None:
        return op
    return Sum if average is False else Average


def _check_process_set(process_set: Any) -> None:
    if process_set is not None:
        raise NotImplementedError("hvps runs collectives on the global process set only; pass process_set=None")


def _writeback(target: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """Make ``target`` hold ``buffer``'s values (no-op when they are the same memory)."""
    if buffer.data_ptr() != target.data_ptr() or buffer.device != target.device:
        target.data.copy_(buffer)
    return target


# -- allreduce ----------------------------------------------------------------
def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[ReduceOp] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = None) -> TorchHandle:
    """Reduce ``tensors`` in place as one fused collective."""
    _check_process_set(process_set)
    arrays, buffers = zip(*[core_buffer(t) for t in tensors]) if tensors else ((), ())
    core = hvps.grouped_allreduce_async(list(arrays), _resolve_op(average, op), name, prescale_factor,
                                        postscale_factor, outs=list(arrays))
    return TorchHandle(core, lambda _: [_writeback(t, b) for t, b in zip(tensors, buffers)])


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[ReduceOp] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = None) -> TorchHandle:
    """Reduce ``tensors`` as one fused collective into new tensors."""
    _check_process_set(process_set)
    arrays = [core_input(t) for t in tensors]
    core = hvps.grouped_allreduce_async(arrays, _resolve_op(average, op), name, prescale_factor, postscale_factor)
    return TorchHandle(core, lambda outs: [from_core(o, t.device) for o, t in zip(outs, tensors)])


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[ReduceOp] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = None) -> TorchHandle:
    """Start reducing ``tensor`` in place over all ranks."""
    handle = grouped_allreduce_async_([tensor], average, name, op, prescale_factor, postscale_factor, process_set)
    return TorchHandle(handle._core, lambda result: handle._finish(result)[0])


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[ReduceOp] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = None) -> TorchHandle:
    """Start reducing ``tensor`` over all ranks into a new tensor."""
    handle = grouped_allreduce_async([tensor], average, name, op, prescale_factor, postscale_factor, process_set)
    return TorchHandle(handle._core, lambda result: handle._finish(result)[0])


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor):
        ctx.op, ctx.prescale, ctx.postscale = op, prescale_factor, postscale_factor
        return allreduce_async(tensor, name=name, op=op, prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor).wait()

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce_async(grad_output.contiguous(), op=ctx.op, prescale_factor=ctx.prescale,
                               postscale_factor=ctx.postscale).wait()
        return grad, None, None, None, None


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression=Compression.none, op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (differentiable); ``compression`` applies on the wire."""
    _check_process_set(process_set)
    compressed, ctx = compress_tensor(compression, tensor)
    summed = _Allreduce.apply(compressed, name, _resolve_op(average, op), prescale_factor, postscale_factor)
    return decompress_tensor(compression, summed, ctx)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[ReduceOp] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` in place over all ranks."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set).wait()


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                      compression=Compression.none, op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None) -> list:
    """Reduce several tensors as one fused collective."""
    pairs = [compress_tensor(compression, t) for t in tensors]
    outs = grouped_allreduce_async([p[0] for p in pairs], average, name, op, prescale_factor, postscale_factor,
                                   process_set).wait()
    return [decompress_tensor(compression, o, ctx) for o, (_, ctx) in zip(outs, pairs)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                       op: Optional[ReduceOp] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = None) -> list:
    """Reduce several tensors in place as one fused collective."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                    process_set).wait()


# -- allgather, broadcast, alltoall, reducescatter ---------------------------------
def allgather_async(tensor: torch.Tensor, name: Optional[str] = None, process_set: Any = None) -> TorchHandle:
    """Start concatenating every rank's tensor along dim 0."""
    _check_process_set(process_set)
    core = hvps.allgather_async(core_input(tensor), name)
    return TorchHandle(core, lambda out: from_core(out, tensor.device))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name):
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        return allgather_async(tensor, name).wait()

    @staticmethod
    def backward(ctx, grad_output):
        summed = allreduce_async(grad_output.contiguous(), op=Sum).wait()
        rows = hvps.allgather(torch.tensor([ctx.rows], dtype=torch.int64).numpy())
        offset = int(rows[: hvps.rank()].sum())
        return summed.narrow(0, offset, ctx.rows), None


def allgather(tensor: torch.Tensor, name: Optional[str] = None, process_set: Any = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (differentiable)."""
    _check_process_set(process_set)
    return _Allgather.apply(tensor, name)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: Any = None) -> TorchHandle:
    """Start copying the root's tensor to a new tensor on every rank."""
    _check_process_set(process_set)
    core = hvps.broadcast_async(core_input(tensor), root_rank, name)
    return TorchHandle(core, lambda out: from_core(out, tensor.device))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: Any = None) -> TorchHandle:
    """Start overwriting ``tensor`` in place with the root's."""
    _check_process_set(process_set)
    array, buffer = core_buffer(tensor)
    core = hvps.broadcast_async(array, root_rank, name, out=array)
    return TorchHandle(core, lambda _: _writeback(tensor, buffer))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root_rank = root_rank
        return broadcast_async(tensor, root_rank, name).wait()

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce_async(grad_output.contiguous(), op=Sum).wait()
        if hvps.rank() != ctx.root_rank:
            grad = torch.zeros_like(grad)
        return grad, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: Any = None) -> torch.Tensor:
    """Return the root's tensor on every rank (differentiable)."""
    _check_process_set(process_set)
    return _Broadcast.apply(tensor, root_rank, name)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: Any = None) -> torch.Tensor:
    """Overwrite ``tensor`` in place with the root's."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


def alltoall_async(tensor: torch.Tensor, splits: Optional[Any] = None, name: Optional[str] = None,
                   process_set: Any = None) -> TorchHandle:
    """Start sending ``splits[r]`` rows to rank r; yields ``(output, received_splits)``."""
    _check_process_set(process_set)
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    core = hvps.alltoall_async(core_input(tensor), splits, name)
    return TorchHandle(core, lambda res: (from_core(res[0], tensor.device), from_core(res[1], torch.device("cpu"))))


def alltoall(tensor: torch.Tensor, splits: Optional[Any] = None, name: Optional[str] = None,
             process_set: Any = None) -> tuple:
    """Exchange rows with every rank: returns ``(output, received_splits)``."""
    return alltoall_async(tensor, splits, name, process_set).wait()


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: ReduceOp = Average,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        process_set: Any = None) -> TorchHandle:
    """Start reducing ``tensor`` and keeping this rank's block of dim 0."""
    _check_process_set(process_set)
    core = hvps.reducescatter_async(core_input(tensor), op, name, prescale_factor, postscale_factor)
    return TorchHandle(core, lambda out: from_core(out, tensor.device))


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression=Compression.none,
                  op: ReduceOp = Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` over ranks and return this rank's block of dim 0."""
    compressed, ctx = compress_tensor(compression, tensor)
    out = reducescatter_async(compressed, name, op, prescale_factor, postscale_factor, process_set).wait()
    return decompress_tensor(compression, out, ctx)


def join(device: int = -1) -> int:
    """Stop contributing; other ranks' allreduces proceed with zeros. Returns the last rank to join."""
    return hvps.join()


def barrier(process_set: Any = None) -> None:
    """Return once every rank has called barrier()."""
    _check_process_set(process_set)
    hvps.barrier()
