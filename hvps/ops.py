"""Collectives on numpy buffers, each synchronous and asynchronous (``*_async`` returns a Handle)."""

from __future__ import annotations

import itertools
import pickle
from collections import defaultdict
from typing import Any, Optional, Sequence

import numpy as np

from . import arrays, dtypes, runtime
from .collectives import Entry
from .dtypes import ReduceOp
from .errors import HvpsError
from .handle import Handle
from .negotiation import ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, JOIN, REDUCESCATTER, Request

Average, Sum, Min, Max, Product = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product)

_counters: dict = defaultdict(itertools.count)


def _name(kind: str, name: Optional[str]) -> str:
    """User names are namespaced by kind; unnamed ops are numbered in submission order."""
    return f"{kind}.{name}" if name else f"{kind}.noname.{next(_counters[kind])}"


def _prepare(array: Any):
    """A contiguous numpy array, or a torch tensor when the backend moves tensors of its kind."""
    if arrays.is_tensor(array):
        name = arrays.dtype_name(array)
        if name not in dtypes.BY_NAME:
            raise TypeError(f"hvps does not support dtype {array.dtype}; supported: {', '.join(dtypes.BY_NAME)}")
        backend = runtime.engine().backend
        if not backend.takes(arrays.device_of(array), name):
            raise TypeError(
                f"the {backend.name} backend does not move {arrays.device_of(array)} tensors of dtype {name}; "
                "pass a numpy array, or set HVPS_BACKEND=tdist"
            )
        return array if array.is_contiguous() and not array.requires_grad else array.detach().contiguous()
    array = np.asarray(array)
    dtypes.check_dtype(array.dtype)
    return np.ascontiguousarray(array).reshape(array.shape)  # ascontiguousarray makes 0-d arrays 1-d


def _contiguous_writable(array: Any) -> bool:
    if arrays.is_numpy(array):
        return array.flags.c_contiguous and array.flags.writeable
    return array.is_contiguous()


def _check_out(out: Any, like: Any) -> Any:
    same_kind = arrays.is_numpy(out) == arrays.is_numpy(like) and arrays.device_of(out) == arrays.device_of(like)
    if (not same_kind or tuple(out.shape) != tuple(like.shape) or out.dtype != like.dtype
            or not _contiguous_writable(out)):
        raise ValueError(
            f"out must be a writable C-contiguous array of shape {tuple(like.shape)} and dtype {like.dtype} "
            f"on {arrays.device_of(like)}; got shape {tuple(out.shape)}, dtype {out.dtype} on {arrays.device_of(out)}"
        )
    return out


def _describe(array: Any) -> dict:
    """The request fields that come from the array itself."""
    return {"dtype": arrays.dtype_name(array), "shapes": (tuple(array.shape),), "device": arrays.device_of(array)}


def _submit(request: Request, inputs: list, outputs: list = (), grouped: bool = False) -> Handle:
    entry = Entry(request, list(inputs), list(outputs), grouped=grouped, ready_event=arrays.ready_event(inputs))
    return runtime.engine().submit(entry)


def _as_op(op: Any) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    try:
        return ReduceOp(op)
    except ValueError:
        raise ValueError(f"unknown reduce op {op!r}; use one of {[o.name for o in ReduceOp]}") from None


# -- allreduce ------------------------------------------------------------------
def grouped_allreduce_async(
    arrays: Sequence[Any],
    op: Any = Average,
    name: Optional[str] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    outs: Optional[Sequence[np.ndarray]] = None,
) -> Handle:
    """Reduce several arrays as one collective per dtype; the handle yields a list in input order."""
    return _allreduce_async(arrays, op, name, prescale_factor, postscale_factor, outs, grouped=True)


def _allreduce_async(values, op, name, prescale_factor, postscale_factor, outs, grouped: bool) -> Handle:
    op = _as_op(op)
    runtime.engine()
    inputs = [_prepare(a) for a in values]
    if not inputs:
        raise ValueError("grouped_allreduce needs at least one array")
    by_kind: dict = {}  # one collective per (dtype, device)
    for index, array in enumerate(inputs):
        by_kind.setdefault((arrays.dtype_name(array), arrays.device_of(array)), []).append(index)
    for dtype, _ in by_kind:
        dtypes.check_reducible(dtypes.BY_NAME[dtype], op)
    outputs = ([_check_out(o, a) for o, a in zip(outs, inputs)] if outs is not None
               else [arrays.empty(a, tuple(a.shape)) for a in inputs])
    base = _name(ALLREDUCE, name)
    handles = []
    for (dtype, device), indices in by_kind.items():
        suffix = dtype if device == "cpu" else f"{dtype}.{device}"
        request = Request(
            base if len(by_kind) == 1 else f"{base}.{suffix}", ALLREDUCE,
            dtype, tuple(tuple(inputs[i].shape) for i in indices), op.value,
            prescale=float(prescale_factor), postscale=float(postscale_factor), device=device,
        )
        handles.append((indices, _submit(request, [inputs[i] for i in indices], [outputs[i] for i in indices],
                                         grouped)))
    if len(handles) == 1:
        return handles[0][1]
    return GroupHandle(base, handles, len(inputs))


class GroupHandle(Handle):
    """Several per-dtype collectives of one grouped allreduce, seen as one handle."""

    __slots__ = ("_parts", "_count")

    def __init__(self, name: str, parts: list, count: int) -> None:
        super().__init__(name)
        self._parts = parts
        self._count = count

    def poll(self) -> bool:
        return all(handle.poll() for _, handle in self._parts)

    def wait(self, timeout: Optional[float] = None) -> list:
        results: list = [None] * self._count
        for indices, handle in self._parts:
            outputs = handle.wait(timeout)
            for index, output in zip(indices, outputs):
                results[index] = output
        return results


def allreduce_async(
    array: Any,
    op: Any = Average,
    name: Optional[str] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    out: Optional[np.ndarray] = None,
) -> Handle:
    """Start reducing ``array`` over all ranks; pass ``out=array`` to reduce in place."""
    outs = None if out is None else [out]
    return _allreduce_async([array], op, name, prescale_factor, postscale_factor, outs, grouped=False)


def allreduce(array: Any, op: Any = Average, name: Optional[str] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Reduce ``array`` over all ranks: ``postscale * op(prescale * array)``."""
    return allreduce_async(array, op, name, prescale_factor, postscale_factor, out).wait()


def grouped_allreduce(arrays: Sequence[Any], op: Any = Average, name: Optional[str] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      outs: Optional[Sequence[np.ndarray]] = None) -> list:
    """Reduce several arrays in one fused collective."""
    return grouped_allreduce_async(arrays, op, name, prescale_factor, postscale_factor, outs).wait()


# -- allgather, broadcast, alltoall, reducescatter ------------------------------
def allgather_async(array: Any, name: Optional[str] = None) -> Handle:
    """Start concatenating every rank's ``array`` along dim 0 (dim 0 may differ by rank)."""
    runtime.engine()
    src = _prepare(array)
    if src.ndim == 0:
        src = src.reshape(1)
    request = Request(_name(ALLGATHER, name), ALLGATHER, **_describe(src))
    return _submit(request, [src])


def allgather(array: Any, name: Optional[str] = None) -> np.ndarray:
    """Concatenate every rank's ``array`` along dim 0."""
    return allgather_async(array, name).wait()


def broadcast_async(array: Any, root_rank: int, name: Optional[str] = None,
                    out: Optional[np.ndarray] = None) -> Handle:
    """Start copying the root's ``array`` to every rank; pass ``out=array`` for in place."""
    runtime.engine()
    src = _prepare(array)
    if not 0 <= root_rank < runtime.size():
        raise ValueError(f"root_rank {root_rank} is out of range for {runtime.size()} ranks")
    output = _check_out(out, src) if out is not None else arrays.empty(src, tuple(src.shape))
    request = Request(_name(BROADCAST, name), BROADCAST, root=int(root_rank), **_describe(src))
    return _submit(request, [src], [output])


def broadcast(array: Any, root_rank: int, name: Optional[str] = None, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Copy the root's ``array`` to every rank."""
    return broadcast_async(array, root_rank, name, out).wait()


def alltoall_async(array: Any, splits: Optional[Sequence[int]] = None, name: Optional[str] = None) -> Handle:
    """Start sending ``splits[r]`` rows of ``array`` to rank r; yields ``(output, received_splits)``."""
    runtime.engine()
    src = _prepare(array)
    if src.ndim == 0:
        raise ValueError("alltoall needs an array with at least one dimension")
    world = runtime.size()
    if splits is None:
        if src.shape[0] % world:
            raise ValueError(f"alltoall without splits needs dim 0 ({src.shape[0]}) divisible by size ({world})")
        splits = [src.shape[0] // world] * world
    splits = [int(s) for s in np.asarray(splits).reshape(-1)]
    if len(splits) != world or min(splits) < 0 or sum(splits) != src.shape[0]:
        raise ValueError(f"splits {splits} must have {world} non-negative entries summing to dim 0 ({src.shape[0]})")
    request = Request(_name(ALLTOALL, name), ALLTOALL, splits=tuple(splits), **_describe(src))
    return _submit(request, [src])


def alltoall(array: Any, splits: Optional[Sequence[int]] = None, name: Optional[str] = None) -> tuple:
    """Scatter rows of ``array`` to all ranks and gather theirs: ``(output, received_splits)``."""
    return alltoall_async(array, splits, name).wait()


def reducescatter_async(array: Any, op: Any = Average, name: Optional[str] = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start reducing ``array`` and keeping this rank's block of dim 0 (first ranks get the remainder)."""
    op = _as_op(op)
    runtime.engine()
    src = _prepare(array)
    if src.ndim == 0:
        raise ValueError("reducescatter needs an array with at least one dimension")
    dtypes.check_reducible(dtypes.BY_NAME[arrays.dtype_name(src)], op)
    request = Request(_name(REDUCESCATTER, name), REDUCESCATTER, op=op.value, prescale=float(prescale_factor),
                      postscale=float(postscale_factor), **_describe(src))
    return _submit(request, [src])


def reducescatter(array: Any, op: Any = Average, name: Optional[str] = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> np.ndarray:
    """Reduce ``array`` over ranks and return this rank's block of dim 0."""
    return reducescatter_async(array, op, name, prescale_factor, postscale_factor).wait()


# -- synchronisation and objects -------------------------------------------------
def barrier() -> None:
    """Return once every rank has called barrier()."""
    _submit(Request(_name(BARRIER, None), BARRIER), []).wait()


def join() -> int:
    """Stop contributing data: allreduces of other ranks proceed with zeros from this rank.

    Returns the rank that joined last, once every rank has joined.
    """
    return _submit(Request("join", JOIN), []).wait()


def broadcast_object(obj: Any = None, root_rank: int = 0, name: Optional[str] = None) -> Any:
    """Pickle ``obj`` on the root and return a copy of it on every rank."""
    name = _name("object", name)
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if runtime.rank() == root_rank else None
    length = broadcast(np.array([0 if payload is None else payload.size], dtype=np.int64), root_rank, f"{name}.len")
    data = broadcast(payload if payload is not None else np.empty(int(length[0]), np.uint8), root_rank, f"{name}.data")
    return pickle.loads(data.tobytes()) if runtime.rank() != root_rank else obj


def allgather_object(obj: Any, name: Optional[str] = None) -> list:
    """Pickle ``obj`` on every rank and return the list of all ranks' objects, in rank order."""
    name = _name("object", name)
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    lengths = allgather(np.array([payload.size], dtype=np.int64), f"{name}.len")
    data = allgather(payload, f"{name}.data").tobytes()
    bounds = np.concatenate(([0], np.cumsum(lengths)))
    return [pickle.loads(data[bounds[i] : bounds[i + 1]]) for i in range(len(lengths))]


__all__ = [
    "Average", "Sum", "Min", "Max", "Product", "HvpsError",
    "allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async",
    "allgather", "allgather_async", "broadcast", "broadcast_async", "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "barrier", "join", "broadcast_object", "allgather_object",
]
