"""Collectives on numpy buffers, each synchronous and asynchronous (``*_async`` returns a Handle).

Every argument is checked before anything is submitted, the same way on every rank, and a
call submits all of its collectives or none. An unnamed call whose arguments this rank refuses
still takes its automatic name (numbered per process set and kind) and announces the failure
(:func:`fails_everywhere`): the names stay in step across ranks even when only one rank refuses,
and the ranks that did submit fail at once with its reason.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import math
import pickle
import threading
import weakref
from collections import defaultdict
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from ..control.negotiation import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BARRIER,
    BROADCAST,
    GLOBAL_SET,
    JOIN,
    REDUCESCATTER,
    Request,
)
from ..core import arrays, devices, dtypes
from ..core.dtypes import ReduceOp
from ..core.errors import DuplicateNameError, HvpsError, NotInitializedError
from ..core.handle import Handle
from ..dataplane.adasum import is_power_of_two
from ..dataplane.executors import Entry, reducescatter_rows
from ..runtime import state as runtime
from ..runtime.engine import waits_at_once
from ..runtime.process_sets import ProcessSet, global_process_set, resolve

Average, Sum, Min, Max, Product, Adasum = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max,
                                           ReduceOp.Product, ReduceOp.Adasum)

#: the numbers of unnamed collectives, per scope (kind and set), for one engine: a job's life from ``init`` to
#: ``shutdown``. A re-initialised job (shutdown and init; an elastic reset, which new ranks join numbering from 0)
#: numbers from 0 again on every rank, and a set id that the new engine gives to other ranks starts afresh.
_counters: dict = {"engine": None, "next": defaultdict(itertools.count)}
#: the thread numbering unnamed ops, and its unnamed ops not yet finished: automatic
#: names follow each rank's submission order, which is the same on every rank only while
#: one thread at a time submits them
_unnamed: dict = {"owner": None, "handles": []}
_unnamed_lock = threading.Lock()


def _check_unnamed_thread(kind: str) -> None:
    """Refuse an unnamed op from a second thread while another thread's unnamed ops are in
    flight (its automatic name could silently pair it with a different op on another rank).
    Handing over in turn, as TensorFlow's executor threads do, stays allowed."""
    me = threading.current_thread()
    with _unnamed_lock:
        owner = _unnamed["owner"]
        if owner is not me:
            _unnamed["handles"] = [h for h in _unnamed["handles"] if not h.finished]
            if owner is not None and owner.is_alive() and _unnamed["handles"]:
                owner = owner.name
            else:
                _unnamed["owner"], owner = me, None
        else:
            owner = None
    if owner is None:
        return
    raise HvpsError(
        f"an unnamed {kind} was submitted from thread {me.name!r} while unnamed collectives of thread "
        f"{owner!r} are in flight: automatic names follow each rank's submission order, which "
        "concurrent threads make differ between ranks; pass name=... (the same on every rank) to every "
        "collective submitted from more than one thread")


#: this thread's naming context (:func:`names_from`): a prefix and a counter, or None
_context = threading.local()


@contextlib.contextmanager
def names_from(prefix: str) -> Iterator[None]:
    """Name this thread's unnamed collectives ``<kind>.graph.<prefix>.<i>`` while the block runs.

    For callers whose ops run in an order of the runtime's choosing (TensorFlow's graph executor
    runs independent ops on several threads): ``prefix`` identifies the calling op the same way on
    every rank, and ``i`` counts within the block, so the names do not depend on which op ran first.
    """
    outer = getattr(_context, "names", None)
    _context.names = (prefix, itertools.count())
    try:
        yield
    finally:
        _context.names = outer


def _track_unnamed(handles: list) -> None:
    unnamed = [h for h in handles if ".noname." in h.name]
    if not unnamed:  # named collectives: nothing to track, and no lock to take
        return
    with _unnamed_lock:
        _unnamed["handles"].extend(unnamed)
        if len(_unnamed["handles"]) > 4096:  # forget finished ones now and then
            _unnamed["handles"] = [h for h in _unnamed["handles"] if not h.finished]


def check_name(name: Any) -> Optional[str]:
    """``name`` if it is a str or None; TypeError otherwise.

    The one check of a collective's name (the framework adapters pass names through it): anything
    else would be turned into text, and ``str(object())`` differs by rank, so the job would stall
    instead of failing at once on every rank.
    """
    if name is None or isinstance(name, str):
        return name
    raise TypeError(f"a collective's name must be a str (the same on every rank) or None, not "
                    f"{type(name).__name__} {name!r}")


def _scale(value: Any, what: str) -> float:
    """A pre/postscale factor as a float; ValueError, on the caller's rank, when it is not a finite number (a
    NaN, never equal to itself, was reported as a mismatch between ranks that all gave it: issue 38)."""
    try:
        factor = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number, not {type(value).__name__}") from None
    if not math.isfinite(factor):
        raise ValueError(f"{what}={factor!r} is not a finite number; give a finite scale (1.0 for none)")
    return factor


#: allreduce requests of recent calls, by their fields (at most ``_REQUESTS_KEPT``; all dropped when full): a
#: training loop submits the same ones every step, and one object per request spares making it again (a frozen
#: dataclass of 12 fields) and turns the response cache's look-ups of it into identity checks
_recent_requests: dict = {}
_REQUESTS_KEPT = 4096


def _allreduce_request(label: str, dtype: str, shapes: tuple, op: str, prescale_factor: Any, postscale_factor: Any,
                       device: str, set_id: int) -> Request:
    """The allreduce request with these fields: the one a recent call made, or a new one.

    Args:
        label: the collective's full name; ``dtype``, ``shapes``, ``op`` (``ReduceOp``'s value), the scale
            factors as the caller gave them (checked here), ``device`` and ``set_id`` (the engine's process set
            id): the request's fields.

    Returns:
        A ``Request`` equal to ``Request(label, ALLREDUCE, dtype, shapes, op, ...)`` (requests are immutable).

    Raises:
        TypeError, ValueError: a scale factor that is not a finite number.
    """
    prescale, postscale = _scale(prescale_factor, "prescale_factor"), _scale(postscale_factor, "postscale_factor")
    if not prescale or not postscale:  # -0.0 == 0.0 as keys, but the sign of the zeros they give differs
        return Request(label, ALLREDUCE, dtype, shapes, op, prescale=prescale, postscale=postscale, device=device,
                       process_set=set_id)
    key = (label, dtype, shapes, op, prescale, postscale, device, set_id)
    request = _recent_requests.get(key)
    if request is None:
        if len(_recent_requests) >= _REQUESTS_KEPT:
            _recent_requests.clear()
        request = _recent_requests[key] = Request(label, ALLREDUCE, dtype, shapes, op, prescale=prescale,
                                                  postscale=postscale, device=device, process_set=set_id)
    return request


def _name(kind: str, name: Optional[str], set_id: int = GLOBAL_SET) -> str:
    """User names are namespaced by kind (and set); unnamed ops are numbered per set and kind.

    Call it once every argument has been checked (or, refused, from :func:`fails_everywhere`): the
    counter must advance on every rank alike.
    """
    check_name(name)
    scope = kind if set_id == GLOBAL_SET else f"{kind}.set{set_id}"
    if name:
        return f"{scope}.{name}"
    context = getattr(_context, "names", None)
    if context is not None:
        label = f"{scope}.graph.{context[0]}.{next(context[1])}"
    else:
        _check_unnamed_thread(kind)
        label = f"{scope}.noname.{_unnamed_number(scope)}"
    _context.issued = getattr(_context, "issued", 0) + 1
    return label


def _unnamed_number(scope: str) -> int:
    """The next number of an unnamed collective in ``scope`` in this engine's life (see ``_counters``)."""
    engine = runtime.engine()
    known = _counters["engine"]
    if known is None or known() is not engine:
        _counters["engine"], _counters["next"] = weakref.ref(engine), defaultdict(itertools.count)
    return next(_counters["next"][scope])


def fails_everywhere(kind: str) -> Callable:
    """Decorate a collective's entry point (arguments ``name`` and ``process_set``): when this rank
    refuses its arguments before naming an unnamed collective, the collective is named anyway and
    announced as failed, so that every rank's automatic names stay in step and the ranks that
    submitted it fail at once, with this rank's reason, instead of waiting for the stall check.

    Named collectives are not announced (a refused name is free for the caller's retry); the
    others' submissions of it then end in the stall check's error.
    """
    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            issued = getattr(_context, "issued", 0)
            try:
                return fn(*args, **kwargs)
            except (TypeError, ValueError, NotImplementedError, HvpsError) as err:
                if getattr(_context, "issued", 0) == issued:
                    _announce_failure(kind, signature.bind(*args, **kwargs).arguments, err)
                raise

        return call

    return decorate


def synchronous(fn: Callable) -> Callable:
    """Decorate a synchronous entry point (it submits, then waits at once): its submissions leave the
    engine thread asleep, as the wait runs them (``engine.waits_at_once``)."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            with waits_at_once():
                return fn(*args, **kwargs)
        except BaseException:
            if runtime.is_initialized():
                runtime.engine().wake_if_queued()  # nothing waits for what it left queued
            raise

    return call


def _announce_failure(kind: str, arguments: dict, error: BaseException) -> None:
    """Name the unnamed collective that ``error`` kept from being submitted, and tell rank 0."""
    if arguments.get("name") is not None or isinstance(error, (DuplicateNameError, NotInitializedError)):
        return
    try:
        engine = runtime.engine()
        set_id = resolve(arguments.get("process_set"))[0]
        label = _name(kind, None, set_id)
    except (HvpsError, TypeError, ValueError):  # not initialized, an unknown set, another thread's names
        return
    engine.abandon(Request(label, kind, process_set=set_id, failure=f"{type(error).__name__}: {error}"))


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


def _check_out(out: Any, like: Any, shape: Optional[tuple] = None) -> Any:
    """``out`` if it is a writable C-contiguous array of ``like``'s kind, device and dtype and of ``shape``
    (default ``like``'s); ValueError saying what it must be otherwise."""
    shape = tuple(like.shape) if shape is None else shape
    same_kind = arrays.is_numpy(out) == arrays.is_numpy(like) and arrays.device_of(out) == arrays.device_of(like)
    if (not same_kind or tuple(out.shape) != shape or out.dtype != like.dtype
            or not _contiguous_writable(out)):
        raise ValueError(
            f"out must be a writable C-contiguous array of shape {shape} and dtype {like.dtype} "
            f"on {arrays.device_of(like)}; got shape {tuple(out.shape)}, dtype {out.dtype} on {arrays.device_of(out)}"
        )
    return out


def _describe(array: Any, set_id: int) -> dict:
    """The request fields that come from the array itself (and the set it runs on)."""
    return {"dtype": arrays.dtype_name(array), "shapes": (tuple(array.shape),), "device": arrays.device_of(array),
            "process_set": set_id}


def _submit_all(pairs: list, grouped: bool = False) -> list:
    """Submit ``(request, inputs, outputs)`` triples as one unit: all of them or, on an error, none."""
    tensors = [a for _, inputs, outputs in pairs for a in (*inputs, *outputs) if not arrays.is_numpy(a)]
    if tensors:  # one device per collective, and per rank (HvpsError before anything is enqueued)
        devices.check(", ".join(request.name for request, _, _ in pairs), tensors)
    entries = [Entry(request, list(inputs), list(outputs), grouped=grouped, ready_event=arrays.ready_event(inputs))
               for request, inputs, outputs in pairs]
    handles = runtime.engine().submit_all(entries)
    _track_unnamed(handles)
    return handles


def _as_op(op: Any) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    try:
        return ReduceOp(op)
    except ValueError:
        raise ValueError(f"unknown reduce op {op!r}; use one of {[o.name for o in ReduceOp]}") from None


def _check_reduction(op: ReduceOp, dtype_names: Any, set_id: int, size: int) -> None:
    """What an allreduce checks of its op: every dtype can take it, and Adasum's rules (``size``: the set's ranks)."""
    for dtype in dtype_names:
        dtypes.check_reducible(dtypes.BY_NAME[dtype], op)
    if op is ReduceOp.Adasum:
        _check_adasum(set_id, size)


def _check_adasum(set_id: int, size: int) -> None:
    """Horovod's rules for Adasum: the global set only, and a power-of-two number of ranks."""
    if set_id != GLOBAL_SET:
        raise NotImplementedError("Adasum does not support non-global process sets")
    if not is_power_of_two(size):
        raise NotImplementedError(f"Adasum needs a power-of-two number of ranks, not {size}")


class GroupHandle(Handle):
    """Several collectives submitted together, seen as one handle yielding a list in input order."""

    __slots__ = ("_parts", "_count")

    def __init__(self, name: str, parts: list, count: int) -> None:
        super().__init__(name)
        self._parts = parts
        self._count = count

    @classmethod
    def of(cls, name: str, handles: list) -> "GroupHandle":
        """One handle yielding the results of ``handles``, in order."""
        return cls(name, [([i], h) for i, h in enumerate(handles)], len(handles))

    def poll(self) -> bool:
        return all(handle.poll() for _, handle in self._parts)

    done = poll

    def wait(self, timeout: Optional[float] = None) -> list:
        results: list = [None] * self._count
        for indices, handle in self._parts:
            outputs = handle.wait(timeout)
            if len(indices) == 1 and not isinstance(outputs, list):
                outputs = [outputs]
            for index, output in zip(indices, outputs):
                results[index] = output
        return results


# -- allreduce ------------------------------------------------------------------
def grouped_allreduce_async(
    arrays: Sequence[Any],
    op: Any = Average,
    name: Optional[str] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    outs: Optional[Sequence[Any]] = None,
    process_set: Optional[ProcessSet] = None,
) -> Handle:
    """Start reducing several arrays as one collective per dtype.

    Args:
        arrays: the arrays; the other arguments are :func:`grouped_allreduce`'s.

    Returns:
        A :class:`~hvps.Handle`; ``wait()`` returns the reductions, a list in input order.
    """
    return _grouped_allreduce_async(arrays, op, name, prescale_factor, postscale_factor, outs, process_set)


@fails_everywhere(ALLREDUCE)
def _grouped_allreduce_async(values, op, name, prescale_factor, postscale_factor, outs, process_set) -> Handle:
    op = _as_op(op)
    runtime.engine()
    set_id, ranks = resolve(process_set)
    inputs = [_prepare(a) for a in values]
    if not inputs:
        raise ValueError("grouped_allreduce needs at least one array")
    if outs is not None and len(outs) != len(inputs):
        raise ValueError(f"{len(outs)} outputs given for {len(inputs)} inputs")
    devices = {arrays.device_of(array) for array in inputs}
    if len(devices) > 1:  # Horovod refuses a group that mixes host and device tensors (a RuntimeError)
        raise HvpsError(f"grouped_allreduce needs all tensors on one device, got {sorted(devices)}")
    by_kind: dict = {}  # one collective per dtype
    for index, array in enumerate(inputs):
        by_kind.setdefault((arrays.dtype_name(array), arrays.device_of(array)), []).append(index)
    _check_reduction(op, (dtype for dtype, _ in by_kind), set_id, len(ranks))
    outputs = ([_check_out(o, a) for o, a in zip(outs, inputs)] if outs is not None
               else [arrays.empty(a, tuple(a.shape)) for a in inputs])
    base = _name(ALLREDUCE, name, set_id)
    parts, plan = [], []
    for (dtype, device), indices in by_kind.items():
        suffix = dtype if device == "cpu" else f"{dtype}.{device}"
        # Adasum combines each tensor with its own coefficients: one collective per tensor
        groups = [[i] for i in indices] if op is ReduceOp.Adasum and len(indices) > 1 else [indices]
        for number, group in enumerate(groups):
            label = base if len(by_kind) == 1 else f"{base}.{suffix}"
            label = label if len(groups) == 1 else f"{label}.{number}"
            request = _allreduce_request(label, dtype, tuple(tuple(inputs[i].shape) for i in group), op.value,
                                         prescale_factor, postscale_factor, device, set_id)
            parts.append((request, [inputs[i] for i in group], [outputs[i] for i in group]))
            plan.append(group)
    handles = _submit_all(parts, grouped=True)
    if len(handles) == 1:
        return handles[0]
    return GroupHandle(base, list(zip(plan, handles)), len(inputs))


def allreduce_gradients_async(buffers: list, dtype: str, name: str, op: ReduceOp, prescale_factor: float,
                              postscale_factor: float, process_set: Optional[ProcessSet] = None,
                              host_ready: tuple = (), bucketed: bool = False) -> Handle:
    """Start reducing ``buffers`` in place as one collective: the short path of a gradient hook.

    The caller has prepared them: C-contiguous, all of hvps dtype ``dtype`` on one device (numpy
    arrays, or tensors the backend takes, as ``_prepare`` gives), ``op`` one of Sum and Average
    (no Adasum), ``name`` given. The collective is named and scaled as ``grouped_allreduce_async``
    names and scales it; the handle yields the only buffer, or the list of them. ``host_ready``: events
    of asynchronous copies into host ``buffers`` (staged CUDA gradients) the engine waits for first.
    ``bucketed``: a gradient submitted during backward, which may wait in the queue for more to fuse with
    until its bucket is full or a ``wait()`` wants it (``runtime/submission.py``).
    """
    engine = runtime.engine()
    check_name(name)
    if process_set is None or process_set is global_process_set:
        set_id, label = GLOBAL_SET, f"{ALLREDUCE}.{name}"
    else:
        set_id = resolve(process_set)[0]
        label = _name(ALLREDUCE, name, set_id)
    first = buffers[0]
    device = "cpu" if isinstance(first, np.ndarray) else first.device.type
    if device != "cpu":
        devices.check(label, buffers)
    shapes = (tuple(first.shape),) if len(buffers) == 1 else tuple(tuple(b.shape) for b in buffers)
    request = _allreduce_request(label, dtype, shapes, op._value_, prescale_factor, postscale_factor, device, set_id)
    entry = Entry(request, buffers, list(buffers), grouped=len(buffers) > 1,
                  ready_event=None if device == "cpu" else arrays.ready_event(buffers), host_ready=tuple(host_ready),
                  bucketed=bucketed)
    return engine.submit_all([entry])[0]


def allreduce_async(array: Any, op: Any = Average, name: Optional[str] = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, out: Optional[Any] = None,
                    process_set: Optional[ProcessSet] = None) -> Handle:
    """Start reducing ``array`` over the set's ranks; pass ``out=array`` to reduce in place.

    Args:
        array: a numpy array (or a buffer numpy takes); the other arguments are :func:`allreduce`'s.

    Returns:
        A :class:`~hvps.Handle`; ``wait()`` returns the reduction (``out`` when given).
    """
    return _allreduce_one(array, op, name, prescale_factor, postscale_factor, out, process_set)


@fails_everywhere(ALLREDUCE)
def _allreduce_one(array, op, name, prescale_factor, postscale_factor, out, process_set) -> Handle:
    """``_grouped_allreduce_async`` of one array, without its grouping by dtype and device (the path of every synchronous
    ``allreduce``): the same checks (``_check_reduction``), in the same order, and the same request."""
    op = _as_op(op)
    runtime.engine()
    set_id, ranks = resolve(process_set)
    src = _prepare(array)
    dtype = arrays.dtype_name(src)
    _check_reduction(op, (dtype,), set_id, len(ranks))
    dst = _check_out(out, src) if out is not None else arrays.empty(src, tuple(src.shape))
    request = _allreduce_request(_name(ALLREDUCE, name, set_id), dtype, (tuple(src.shape),), op.value,
                                 prescale_factor, postscale_factor, arrays.device_of(src), set_id)
    return _submit_all([(request, [src], [dst])])[0]


@synchronous
def allreduce(array: Any, op: Any = Average, name: Optional[str] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, out: Optional[Any] = None,
              process_set: Optional[ProcessSet] = None) -> Any:
    """Reduce ``array`` over the set's ranks: ``postscale * op(prescale * array)``.

    Args:
        array: a numpy array of the same shape and dtype on every rank.
        op: ``Average`` (the default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``.
        name: a name every rank gives this collective; unnamed ones are numbered in call order.
        prescale_factor: ``prescale``, applied to each rank's array first.
        postscale_factor: ``postscale``, applied to the result.
        out: an array to write the result into (``out=array``: in place).
        process_set: the ranks that take part; None: every rank.

    Returns:
        The reduction, a new array (or ``out``).

    Raises:
        ValueError: arguments this rank refuses (an unknown op, an op the dtype cannot take, a rank outside
            ``process_set``); the ranks that submitted the collective fail at once with this reason.
        HvpsError: the collective failed on every rank: the ranks disagree on it, a rank never submits it
            (the stall check), or a rank is lost.
    """
    return allreduce_async(array, op, name, prescale_factor, postscale_factor, out, process_set).wait()


@synchronous
def grouped_allreduce(arrays: Sequence[Any], op: Any = Average, name: Optional[str] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      outs: Optional[Sequence[Any]] = None, process_set: Optional[ProcessSet] = None) -> list:
    """Reduce several arrays in one fused collective.

    Args:
        arrays: the arrays (dtypes may differ); ``outs``: arrays to write the results into. The other
            arguments are :func:`allreduce`'s.

    Returns:
        The reductions, a list in input order.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    return grouped_allreduce_async(arrays, op, name, prescale_factor, postscale_factor, outs, process_set).wait()


# -- allgather ----------------------------------------------------------------------
def _gather_source(array: Any) -> Any:
    src = _prepare(array)
    return src.reshape(1) if src.ndim == 0 else src


@fails_everywhere(ALLGATHER)
def grouped_allgather_async(values: Sequence[Any], name: Optional[str] = None,
                            process_set: Optional[ProcessSet] = None) -> Handle:
    """Start allgathering several arrays together.

    Args:
        values: this rank's arrays; the other arguments are :func:`allgather`'s.

    Returns:
        A :class:`~hvps.Handle`; ``wait()`` returns the concatenations, a list in input order.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
    """
    runtime.engine()
    set_id, _ = resolve(process_set)
    sources = [_gather_source(a) for a in values]
    if not sources:
        raise ValueError("grouped_allgather needs at least one array")
    base = _name(ALLGATHER, name, set_id)
    parts = [(Request(f"{base}.{i}", ALLGATHER, **_describe(src, set_id)), [src], []) for i, src in enumerate(sources)]
    handles = _submit_all(parts)
    return GroupHandle.of(base, handles)


@fails_everywhere(ALLGATHER)
def allgather_async(array: Any, name: Optional[str] = None, process_set: Optional[ProcessSet] = None,
                    out: Optional[Any] = None) -> Handle:
    """Start concatenating every member's ``array`` along dim 0 (dim 0 may differ by rank).

    Args:
        array: this rank's rows; the other arguments are :func:`allgather`'s.

    Returns:
        A :class:`~hvps.Handle`; ``wait()`` returns the concatenation (``out``, when given).

    Raises:
        ValueError: refused arguments, ``out`` among them (see :func:`allgather`).
    """
    runtime.engine()
    set_id, _ = resolve(process_set)
    src = _gather_source(array)
    outputs, rows = [], ()
    if out is not None:
        outputs, rows = [_check_gather_out(out, src)], (int(out.shape[0]),)
    request = Request(_name(ALLGATHER, name, set_id), ALLGATHER, splits=rows, **_describe(src, set_id))
    return _submit_all([(request, [src], outputs)])[0]


def _check_gather_out(out: Any, src: Any) -> Any:
    """``out`` if it can take an allgather of ``src``: its rows are checked against every member's once all
    have submitted (the request carries them; ``Coordinator``), the rest here."""
    trailing = tuple(src.shape[1:])
    if getattr(out, "ndim", 0) != src.ndim or tuple(out.shape[1:]) != trailing:
        shape = ", ".join(["rows", *map(str, trailing)])
        raise ValueError(f"out must have the shape ({shape}) of the concatenation of every member's rows; got "
                         f"shape {tuple(getattr(out, 'shape', ()))}")
    return _check_out(out, src, (int(out.shape[0]),) + trailing)


@synchronous
def allgather(array: Any, name: Optional[str] = None, process_set: Optional[ProcessSet] = None,
              out: Optional[Any] = None) -> Any:
    """Concatenate every member's ``array`` along dim 0.

    Args:
        array: this rank's rows (dim 0 may differ by rank; the other dimensions and the dtype may not).
        name: a name every rank gives this collective; unnamed ones are numbered in call order.
        process_set: the ranks that take part; None: every rank.
        out: an array to write the concatenation into: writable, C-contiguous, of ``array``'s dtype and
            kind, its dim 0 the members' rows added up. A wrong dim 0 on any rank fails the collective on
            every member, naming the ranks, before anything moves.

    Returns:
        The members' rows in rank order: a new array, or ``out``.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`), or an ``out`` of another dtype, kind or shape.
        HvpsError: the collective failed (see :func:`allreduce`), or ``out``'s rows differ from the members'.
    """
    return allgather_async(array, name, process_set, out).wait()


@synchronous
def grouped_allgather(values: Sequence[Any], name: Optional[str] = None,
                      process_set: Optional[ProcessSet] = None) -> list:
    """Allgather several arrays together.

    Args:
        values: this rank's arrays; the other arguments are :func:`allgather`'s.

    Returns:
        The concatenations, a list in input order.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    return grouped_allgather_async(values, name, process_set).wait()


# -- broadcast ------------------------------------------------------------------------
@fails_everywhere(BROADCAST)
def broadcast_async(array: Any, root_rank: int, name: Optional[str] = None, out: Optional[Any] = None,
                    process_set: Optional[ProcessSet] = None) -> Handle:
    """Start copying the root's ``array`` to every member; ``root_rank`` is a global rank; ``out=array``
    for in place.

    Args:
        array: the root's data (elsewhere, its shape and dtype); the other arguments are :func:`broadcast`'s.

    Returns:
        A :class:`~hvps.Handle`; ``wait()`` returns the root's values.

    Raises:
        ValueError: ``root_rank`` is not in the set, or other refused arguments.
    """
    runtime.engine()
    set_id, ranks = resolve(process_set)
    src = _prepare(array)
    if int(root_rank) not in ranks:
        raise ValueError(f"root_rank {root_rank} is not one of the ranks {list(ranks)} of the process set")
    output = _check_out(out, src) if out is not None else arrays.empty(src, tuple(src.shape))
    request = Request(_name(BROADCAST, name, set_id), BROADCAST, root=int(root_rank), **_describe(src, set_id))
    return _submit_all([(request, [src], [output])])[0]


@synchronous
def broadcast(array: Any, root_rank: int, name: Optional[str] = None, out: Optional[Any] = None,
              process_set: Optional[ProcessSet] = None) -> Any:
    """Copy the root's ``array`` to every member.

    Args:
        array: the root's data; on the other ranks, an array of the same shape and dtype.
        root_rank: the global rank whose array every member receives.
        name: a name every rank gives this collective; unnamed ones are numbered in call order.
        out: an array to write the result into (``out=array``: in place).
        process_set: the ranks that take part; None: every rank.

    Returns:
        The root's values, a new array (or ``out``).

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    return broadcast_async(array, root_rank, name, out, process_set).wait()


# -- alltoall ---------------------------------------------------------------------------
def _check_splits(splits: Any, rows: int, members: int) -> list:
    if splits is None:
        if rows % members:
            raise ValueError(f"alltoall without splits needs dim 0 ({rows}) divisible by the set size ({members})")
        return [rows // members] * members
    values = np.asarray(splits)
    if values.dtype.kind not in "iu":
        raise ValueError(f"alltoall splits must be integers, not {values.dtype}")
    values = [int(s) for s in values.reshape(-1)]
    if len(values) != members or min(values) < 0 or sum(values) != rows:
        raise ValueError(f"splits {values} must have {members} non-negative entries summing to dim 0 ({rows})")
    return values


@fails_everywhere(ALLTOALL)
def alltoall_async(array: Any, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
                   process_set: Optional[ProcessSet] = None) -> Handle:
    """Start sending ``splits[i]`` rows of ``array`` to the set's i-th rank.

    Args:
        array: this rank's rows; the other arguments are :func:`alltoall`'s.

    Returns:
        A :class:`~hvps.Handle`; ``wait()`` returns ``(output, received_splits)``.

    Raises:
        ValueError: ``splits`` does not fit ``array`` and the set (see :func:`alltoall`).
    """
    runtime.engine()
    set_id, ranks = resolve(process_set)
    src = _prepare(array)
    if src.ndim == 0:
        raise ValueError("alltoall needs an array with at least one dimension")
    splits = _check_splits(splits, src.shape[0], len(ranks))
    request = Request(_name(ALLTOALL, name, set_id), ALLTOALL, splits=tuple(splits), **_describe(src, set_id))
    return _submit_all([(request, [src], [])])[0]


@synchronous
def alltoall(array: Any, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
             process_set: Optional[ProcessSet] = None) -> tuple:
    """Scatter rows of ``array`` to the set's ranks and gather theirs.

    Args:
        array: this rank's rows, sent in consecutive blocks to the set's ranks in order.
        splits: rows for each rank, one non-negative int per member summing to dim 0; None: equal blocks
            (dim 0 must divide by the set's size).
        name: a name every rank gives this collective; unnamed ones are numbered in call order.
        process_set: the ranks that take part; None: every rank.

    Returns:
        ``(output, received_splits)``: the rows received, in rank order, and how many came from each rank.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    return alltoall_async(array, splits, name, process_set).wait()


# -- reducescatter ------------------------------------------------------------------------
def _scatter_source(array: Any, op: ReduceOp) -> Any:
    src = _prepare(array)
    if src.ndim == 0:
        raise ValueError("reducescatter needs arrays with at least one dimension, not a scalar")
    dtypes.check_reducible(dtypes.BY_NAME[arrays.dtype_name(src)], op)
    return src


def _scatter_op(op: Any) -> ReduceOp:
    op = _as_op(op)
    if op is ReduceOp.Adasum:
        raise NotImplementedError("reducescatter does not support Adasum; use Sum or Average")
    return op


@fails_everywhere(REDUCESCATTER)
def grouped_reducescatter_async(values: Sequence[Any], op: Any = Average, name: Optional[str] = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                process_set: Optional[ProcessSet] = None) -> Handle:
    """Start reducescattering several arrays together.

    Args:
        values: the arrays to reduce; the other arguments are :func:`reducescatter`'s.

    Returns:
        A :class:`~hvps.Handle`; ``wait()`` returns this rank's blocks, a list in input order.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
    """
    op = _scatter_op(op)
    runtime.engine()
    set_id, _ = resolve(process_set)
    sources = [_scatter_source(a, op) for a in values]
    if not sources:
        raise ValueError("grouped_reducescatter needs at least one array")
    base = _name(REDUCESCATTER, name, set_id)
    parts = [(Request(f"{base}.{i}", REDUCESCATTER, op=op.value, prescale=_scale(prescale_factor, "prescale_factor"),
                      postscale=_scale(postscale_factor, "postscale_factor"), **_describe(src, set_id)), [src], [])
             for i, src in enumerate(sources)]
    handles = _submit_all(parts)
    return GroupHandle.of(base, handles)


@fails_everywhere(REDUCESCATTER)
def reducescatter_async(array: Any, op: Any = Average, name: Optional[str] = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        process_set: Optional[ProcessSet] = None) -> Handle:
    """Start reducing ``array`` and keeping this rank's block of dim 0 (first ranks get the remainder).

    Args:
        array: the array to reduce; the other arguments are :func:`reducescatter`'s.

    Returns:
        A :class:`~hvps.Handle`; ``wait()`` returns this rank's block.
    """
    op = _scatter_op(op)
    runtime.engine()
    set_id, _ = resolve(process_set)
    src = _scatter_source(array, op)
    request = Request(_name(REDUCESCATTER, name, set_id), REDUCESCATTER, op=op.value,
                      prescale=_scale(prescale_factor, "prescale_factor"),
                      postscale=_scale(postscale_factor, "postscale_factor"), **_describe(src, set_id))
    return _submit_all([(request, [src], [])])[0]


@synchronous
def reducescatter(array: Any, op: Any = Average, name: Optional[str] = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, process_set: Optional[ProcessSet] = None) -> Any:
    """Reduce ``array`` over the set's ranks and return this rank's block of dim 0.

    Args:
        array: a numpy array of the same shape and dtype on every rank.
        op: ``Average`` (the default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        name: a name every rank gives this collective; unnamed ones are numbered in call order.
        prescale_factor: applied to each rank's array first.
        postscale_factor: applied to the result.
        process_set: the ranks that take part; None: every rank.

    Returns:
        This rank's block of the reduction's dim 0 (the first ranks get the remainder rows).

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    return reducescatter_async(array, op, name, prescale_factor, postscale_factor, process_set).wait()


@synchronous
def grouped_reducescatter(values: Sequence[Any], op: Any = Average, name: Optional[str] = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          process_set: Optional[ProcessSet] = None) -> list:
    """Reducescatter several arrays together.

    Args:
        values: the arrays to reduce; the other arguments are :func:`reducescatter`'s.

    Returns:
        This rank's blocks, a list in input order.

    Raises:
        ValueError: refused arguments (see :func:`allreduce`).
        HvpsError: the collective failed (see :func:`allreduce`).
    """
    return grouped_reducescatter_async(values, op, name, prescale_factor, postscale_factor, process_set).wait()


def scattered_rows(rows: int, process_set: Optional[ProcessSet] = None) -> list:
    """Rows of dim 0 each member keeps after a reducescatter of ``rows`` rows, in set order."""
    _, ranks = resolve(process_set)
    return reducescatter_rows(rows, len(ranks))


# -- synchronisation and objects -------------------------------------------------
@synchronous
def barrier(process_set: Optional[ProcessSet] = None) -> None:
    """Return once every member of the set has called barrier().

    Args:
        process_set: the ranks that wait for each other; None: every rank.

    Raises:
        HvpsError: a rank is lost, or one never arrives (the stall check).
    """
    runtime.engine()
    set_id, _ = resolve(process_set)
    _submit_all([(Request(_name(BARRIER, None, set_id), BARRIER, process_set=set_id), [], [])])[0].wait()


@synchronous
def join(device: Optional[int] = None) -> int:
    """Stop contributing data: allreduces of other ranks proceed with zeros from this rank.

    Args:
        device: the CUDA device index on which this rank makes those zeros for collectives on CUDA
            tensors (Horovod's argument); by default the device of this rank's CUDA tensors, else the
            local rank's GPU.

    Returns:
        The rank that joined last, once every rank has joined.

    Raises:
        HvpsError: the ranks still training submitted another collective than allreduce, or the job failed.
    """
    runtime.engine()
    devices.set_join_device(device)
    return _submit_all([(Request("join", JOIN), [], [])])[0].wait()


@synchronous
def broadcast_object(obj: Any = None, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Optional[ProcessSet] = None) -> Any:
    """Pickle ``obj`` on the root and return a copy of it on every member.

    Args:
        obj: the root's object (ignored elsewhere).
        root_rank: the global rank whose object every member receives.
        name: a name every rank gives this collective; unnamed ones are numbered in call order.
        process_set: the ranks that take part; None: every rank.

    Returns:
        ``obj`` on the root, an unpickled copy of it elsewhere.

    Raises:
        ValueError: ``root_rank`` is not in the set.
        HvpsError: the collective failed; also, at once, on the other ranks when the root's object cannot be
            pickled (the root raises pickle's own error).
    """
    set_id, ranks = resolve(process_set)
    if root_rank not in ranks:
        raise ValueError(f"root_rank {root_rank} is not one of the ranks {list(ranks)} of the process set")
    name = _name("object", name, set_id)
    payload = _pickled(obj, BROADCAST, f"{name}.len", set_id) if runtime.rank() == root_rank else None
    length = broadcast(np.array([0 if payload is None else payload.size], dtype=np.int64), root_rank, f"{name}.len",
                       process_set=process_set)
    data = broadcast(payload if payload is not None else np.empty(int(length[0]), np.uint8), root_rank,
                     f"{name}.data", process_set=process_set)
    return pickle.loads(data.tobytes()) if runtime.rank() != root_rank else obj


def _pickled(obj: Any, kind: str, first: str, set_id: int) -> np.ndarray:
    """``obj`` pickled, as bytes to send; when it cannot be pickled, the object collective's first step
    (``first``, of ``kind``) is announced as failed with the reason, so that the other ranks fail at once
    instead of waiting out the stall time (issue 38), and the error is raised here."""
    try:
        return np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    except Exception as error:  # PicklingError, TypeError, AttributeError ("Can't pickle local object")
        try:
            engine = runtime.engine()
            label = _name(kind, first, set_id)
        except (HvpsError, TypeError, ValueError):
            raise error from None
        engine.abandon(Request(label, kind, process_set=set_id,
                               failure=f"{type(error).__name__}: the object cannot be pickled: {error}"))
        raise


@synchronous
def allgather_object(obj: Any, name: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> list:
    """Pickle ``obj`` on every member and return the list of all members' objects, in rank order.

    Args:
        obj: this rank's object.
        name: a name every rank gives this collective; unnamed ones are numbered in call order.
        process_set: the ranks that take part; None: every rank.

    Returns:
        The members' objects, a list in rank order.

    Raises:
        HvpsError: the collective failed; also, at once, on the other ranks when a rank's object cannot be
            pickled (that rank raises pickle's own error).
    """
    set_id, _ = resolve(process_set)
    name = _name("object", name, set_id)
    payload = _pickled(obj, ALLGATHER, f"{name}.len", set_id)
    lengths = allgather(np.array([payload.size], dtype=np.int64), f"{name}.len", process_set)
    data = allgather(payload, f"{name}.data", process_set).tobytes()
    bounds = np.concatenate(([0], np.cumsum(lengths)))
    return [pickle.loads(data[bounds[i] : bounds[i + 1]]) for i in range(len(lengths))]


__all__ = [
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "HvpsError",
    "allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "barrier", "join", "broadcast_object", "allgather_object",
]
