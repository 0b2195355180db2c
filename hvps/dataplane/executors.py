"""How each agreed response runs on a backend: packing, fusion buffers, scaling.

One executor per kind, looked up in ``EXECUTORS``. Every executor receives the
local entries of the response (``None`` where this rank has joined and takes
part with zeros) and returns the per-entry results.
"""

from __future__ import annotations

import ctypes
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..control.negotiation import ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, REDUCESCATTER, Request
from ..core import arrays, devices, scaling
from ..core.dtypes import OPS_BY_VALUE, ReduceOp
from ..core.handle import Handle
from .adasum import adasum_allreduce
from .buffers import FusionBuffer


@dataclass
class Entry:
    """A collective submitted on this rank: its request, buffers and handle."""

    request: Request
    inputs: list
    outputs: list = field(default_factory=list)
    handle: Handle = None
    #: whether the result is the list of outputs (grouped allreduce) or the only one
    grouped: bool = False
    #: CUDA inputs: an event on the submitting stream after which they are ready
    ready_event: Any = None
    #: host inputs staged from CUDA memory by an asynchronous copy: events the engine synchronizes with
    #: before it reads them (the submitting thread, autograd's, never waits for the copy)
    host_ready: tuple = ()
    #: a gradient submitted during backward: it may wait in the queue for the rest of its bucket
    #: (``runtime/submission.py``, ``GRADIENT_BUCKET_BYTES``)
    bucketed: bool = False


class Context:
    """What executors need on one process set: its backend, this rank's index in it, its size, its
    global ranks (in set order) and the fusion buffer (shared by every set: one runs at a time)."""

    def __init__(self, backend, rank: int, size: int, ranks: tuple = (), fusion: FusionBuffer = None) -> None:
        self.backend = backend
        self.rank = rank
        self.size = size
        self.ranks = tuple(ranks) or tuple(range(size))
        self.fusion = fusion if fusion is not None else FusionBuffer()


def _span(ins: list, outs: list):
    """One flat array over ``ins`` if they are reduced in place and lie back to back in memory, in order.

    Tensors kept in one flat buffer fuse this way without being copied into and
    out of the fusion buffer. Whether a rank uses the span or the fusion buffer
    is a fact of its own memory, so it may differ between ranks: it must not
    change what travels (one backend call over the same elements either way).
    Host (numpy) arrays only.
    """
    if not all(arrays.is_numpy(a) for a in ins):
        return None
    address = ins[0].ctypes.data
    for array, out in zip(ins, outs):
        if out.ctypes.data != array.ctypes.data or array.ctypes.data != address or not array.flags.c_contiguous:
            return None
        address += array.nbytes
    nbytes = address - ins[0].ctypes.data
    if not nbytes:
        return None
    memory = (ctypes.c_char * nbytes).from_address(ins[0].ctypes.data)
    return np.frombuffer(memory, dtype=ins[0].dtype)


#: host tensors of at least this many bytes are reduced where they live, each in its own backend
#: call, instead of being copied into the fusion buffer and back: two memcpys of a large tensor
#: cost more than one more call (ResNet-50's 97.5 MiB: ~40 ms of copies on a 2-core host)
REDUCED_ALONE_BYTES = 1 << 20


def _reduced_alone(array, count: int) -> bool:
    """Whether ``array``, one of ``count`` tensors of a fused allreduce, skips the fusion buffer."""
    if count == 1:
        return True
    return arrays.device_of(array) == "cpu" and array.nbytes >= REDUCED_ALONE_BYTES


def _reduce_where_it_lives(ctx: Context, src, dst, op: ReduceOp, first: Request) -> None:
    """``dst = postscale * op(prescale * src)`` over the set, with no staging copy."""
    src = scaling.prescaled(src, first.prescale, out=dst)
    if arrays.numel(dst):
        ctx.backend.allreduce(src.reshape(-1), dst.reshape(-1), scaling.wire_op(op))
    scaling.finish(dst, op, ctx.size, first.postscale)


def _reduce_packed(ctx: Context, ins: list, outs: list, op: ReduceOp, first: Request) -> None:
    """Reduce ``ins`` into ``outs`` as one flat array in the fusion buffer."""
    flat = ctx.fusion.like(ins[0], sum(arrays.numel(a) for a in ins))
    if not arrays.is_numpy(flat):  # tensors: one launch to pack, one to unpack (not one per tensor)
        torch = sys.modules["torch"]
        torch.cat([a.reshape(-1) for a in ins], out=flat)
        _reduce_where_it_lives(ctx, flat, flat, op, first)
        torch._foreach_copy_([a.reshape(-1) for a in outs], list(flat.split([arrays.numel(a) for a in outs])))
        return
    offset = 0
    for array in ins:
        n = arrays.numel(array)
        flat[offset : offset + n] = array.reshape(-1)
        offset += n
    _reduce_where_it_lives(ctx, flat, flat, op, first)
    offset = 0
    for array in outs:
        n = arrays.numel(array)
        array.reshape(-1)[...] = flat[offset : offset + n]
        offset += n


def _zeros_for(req: Request) -> list:
    """A joined rank's zeros for ``req``: on this rank's GPU for a CUDA collective (``devices.zeros_device``),
    never on the engine thread's current device (cuda:0), where NCCL would open a communicator on
    another rank's GPU."""
    device = req.device
    if device == "cuda":
        device = devices.zeros_device(device, sys.modules["torch"].cuda.device_count())
    return [arrays.zeros(shape, req.dtype, device) for shape in req.shapes]


def run_allreduce(ctx: Context, response, entries: list) -> list:
    first = response.requests[0]
    op = OPS_BY_VALUE[first.op]
    if op is ReduceOp.Adasum:
        return run_adasum(ctx, response, entries)
    if len(entries) == 1 and entries[0] is not None and len(entries[0].inputs) == 1:  # one tensor: nothing to pack
        _reduce_where_it_lives(ctx, entries[0].inputs[0], entries[0].outputs[0], op, first)
    else:
        _reduce_together(ctx, response, entries, op, first)
    return [_result_of(entry) for entry in entries]


def _result_of(entry) -> Any:
    """What an allreduce's handle yields: the list of outputs (grouped), the only one, or None (joined)."""
    if entry is None:
        return None
    return list(entry.outputs) if entry.grouped else entry.outputs[0]


def _reduce_together(ctx: Context, response, entries: list, op: ReduceOp, first: Request) -> None:
    """Reduce every entry's tensors (zeros for a joined rank's): the large ones alone, the rest packed."""
    ins, outs = [], []
    for entry, req in zip(entries, response.requests):
        if entry is None:  # joined: contribute zeros, keep nothing
            zeros = _zeros_for(req)
            ins.extend(zeros)
            outs.extend(zeros)
        else:
            ins.extend(entry.inputs)
            outs.extend(entry.outputs)
    # Which tensors go alone depends only on the agreed response (sizes, devices), never on where
    # this rank's memory lies: every rank must make the same backend calls over the same elements.
    alone = [_reduced_alone(a, len(ins)) for a in ins]
    for a, out, single in zip(ins, outs, alone):
        if single:
            _reduce_where_it_lives(ctx, a, out, op, first)
    packed_ins = [a for a, single in zip(ins, alone) if not single]
    if packed_ins:
        packed_outs = [out for out, single in zip(outs, alone) if not single]
        span = _span(packed_ins, packed_outs)
        if span is not None:  # in place on tensors that lie back to back: no copies at all
            _reduce_where_it_lives(ctx, span, span, op, first)
        else:
            _reduce_packed(ctx, packed_ins, packed_outs, op, first)


def run_allgather(ctx: Context, response, entries: list) -> list:
    (entry,) = entries
    src = entry.inputs[0]
    row = math.prod(src.shape[1:])
    # the caller's ``out``, its rows checked by the coordinator, or a new array
    out = entry.outputs[0] if entry.outputs else arrays.empty(src, (sum(response.per_rank),) + tuple(src.shape[1:]))
    ctx.backend.allgatherv(src.reshape(-1), out.reshape(-1), [rows * row for rows in response.per_rank])
    return [out]


def run_broadcast(ctx: Context, response, entries: list) -> list:
    (entry,) = entries
    src, out = entry.inputs[0], entry.outputs[0]
    root = ctx.ranks.index(entry.request.root)  # the request names the root's global rank
    if out is not src and ctx.rank == root:
        out[...] = src
    if arrays.numel(out):
        ctx.backend.broadcast(out.reshape(-1), root)
    return [out]


def run_alltoall(ctx: Context, response, entries: list) -> list:
    (entry,) = entries
    src = entry.inputs[0]
    row = math.prod(src.shape[1:])
    received = [splits[ctx.rank] for splits in response.per_rank]
    out = arrays.empty(src, (sum(received),) + tuple(src.shape[1:]))
    ctx.backend.alltoallv(src.reshape(-1), [n * row for n in response.per_rank[ctx.rank]],
                          out.reshape(-1), [n * row for n in received])
    return [(out, np.asarray(received, dtype=np.int32))]


def reducescatter_rows(rows: int, size: int) -> list:
    """Rows each rank keeps: the first ``rows % size`` ranks take one extra."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def run_reducescatter(ctx: Context, response, entries: list) -> list:
    (entry,) = entries
    req = entry.request
    op = OPS_BY_VALUE[req.op]
    src = scaling.prescaled(entry.inputs[0], req.prescale)
    rows = reducescatter_rows(src.shape[0] if src.ndim else 1, ctx.size)
    row = math.prod(src.shape[1:])
    out = arrays.empty(src, (rows[ctx.rank],) + tuple(src.shape[1:]))
    ctx.backend.reducescatter(src.reshape(-1), out.reshape(-1), [n * row for n in rows],
                              scaling.wire_op(op))
    scaling.finish(out, op, ctx.size, req.postscale)
    return [out]


def run_adasum(ctx: Context, response, entries: list) -> list:
    """Adasum of one tensor (never fused: its coefficients are per tensor), see ``adasum.py``."""
    (entry,) = entries
    req = response.requests[0]
    if entry is None:  # joined: contribute zeros, keep nothing
        src = out = _zeros_for(req)[0]
    else:
        src, out = entry.inputs[0], entry.outputs[0]
    if out is not src:
        out[...] = src
    scaling.scale(out, req.prescale)
    if arrays.numel(out):
        adasum_allreduce(ctx.backend, out.reshape(-1), ctx.rank, ctx.size)
    scaling.scale(out, req.postscale)
    return [_result_of(entry)]


def run_barrier(ctx: Context, response, entries: list) -> list:
    # Negotiation already is the barrier: no rank gets this response before all submitted.
    return [None for _ in entries]


def _after_staging(run):
    """``run``, once every entry's asynchronous staging copies (``Entry.host_ready``) have landed."""
    def staged(ctx: Context, response, entries: list) -> list:
        for entry in entries:
            if entry is not None:
                for event in entry.host_ready:
                    event.synchronize()
        return run(ctx, response, entries)

    staged.__name__ = run.__name__
    return staged


EXECUTORS = {kind: _after_staging(run) for kind, run in {
    ALLREDUCE: run_allreduce,
    ALLGATHER: run_allgather,
    BROADCAST: run_broadcast,
    ALLTOALL: run_alltoall,
    REDUCESCATTER: run_reducescatter,
    BARRIER: run_barrier,
}.items()}
