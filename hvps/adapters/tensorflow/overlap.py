"""Gradient allreduces that overlap the backward pass: buckets, each a "start" and a "finish" op.

Inside a ``tf.function``, one stateful op over every dense gradient could run only once the whole
backward pass had produced every gradient. ``allreduce_gradients`` (DistributedGradientTape, the
Keras DistributedOptimizer) therefore groups the gradients into buckets of
about :func:`bucket_bytes` bytes, in *reverse* variable order (the backward pass produces the
last layers' gradients first), and every bucket gets two stateful ``tf.numpy_function`` ops:

- ``start(*bucket) -> token`` submits ``hvps.grouped_allreduce_async`` and returns at once, an
  int64 token under which the handle waits in this module's registry;
- ``finish(token) -> reduced bucket`` waits for that handle.

All starts are created first (bucket order), then all finishes. TensorFlow's automatic control
dependencies run a function's stateful ops in creation order, so start k waits only for its own
gradients and for start k-1, and runs while the backward pass is still computing the earlier
layers' gradients; the finishes (which block) come after the last start, i.e. after the backward
pass. The order of submission is the same on every rank.

Names: buckets are named collectives, ``<name or "grads">.bucket<k>`` (the core scopes them by
kind and process set). Named, because the start ops may run on different executor threads
while earlier buckets are in flight, which the core refuses for unnamed collectives. The names
carry neither variable names (Keras numbers layers per process, so they can differ between
ranks) nor shapes: ranks whose gradients differ in shape then meet under the same name and get
the coordinator's prompt mismatch error instead of a stall. Calls of one function run one after
the other (the control dependencies again), so reusing a name in the next call or step is safe.

Errors: a finish that fails (a rank died, shapes differ between ranks) raises the core's
HvpsError, with the local variable names of the bucket appended. A start whose finish never ran
(another op of the step raised in between, or a later start failed) leaves its handle here;
the next start of a collective with the same name first waits for that leftover (its error, if
any, is dropped: it was already reported or belongs to an abandoned step) and forgets it, so
nothing accumulates across steps and no DuplicateNameError follows. Eagerly, an exception
between starts and finishes drains the started buckets at once.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

import hvps
from hvps import HvpsError, ReduceOp
from hvps.core.settings import env_number
from hvps.core.user_warnings import warn

from .checks import check_reduce
from .mpi_ops import _grouped_allreduce, _zeros_if_none
from .tensors import run
from .threads import chosen_inter_op_threads

#: like PyTorch DDP's default bucket_cap_mb: a few buckets for ResNet-50's 97.5 MiB of gradients
#: (the first, the classifier's 8 MiB plus the last block, can start early), each still large
#: enough for the engine's per-collective cost (negotiation, one numpy_function op) to be small
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
BUCKET_ENV = "HVPS_TF_BUCKET_BYTES"

_lock = threading.Lock()
#: whether this process has warned that its buckets cannot overlap the backward pass (``_warn_if_no_overlap``)
_warned_no_overlap = False
_tokens = itertools.count(1)
#: token -> (registry key, handle, variable labels) for buckets started and not yet finished
_pending: dict = {}
#: registry key (collective name, process set) -> token of its pending bucket
_by_key: dict = {}


def bucket_bytes() -> int:
    """The bucket size in bytes: ``$HVPS_TF_BUCKET_BYTES`` or 25 MiB; read when a function is traced
    (eagerly: at every call). A bucket is closed once it holds at least this many bytes (0: one
    gradient per bucket)."""
    return int(env_number(BUCKET_ENV, DEFAULT_BUCKET_BYTES, int))


def _nbytes(t: tf.Tensor, limit: int) -> int:
    if not t.shape.is_fully_defined():
        return max(limit, 1)  # unknown size: a bucket of its own (the same decision on every rank)
    return int(t.shape.num_elements()) * t.dtype.size


def plan_buckets(tensors: Sequence[tf.Tensor], limit: int) -> list:
    """Indices into ``tensors`` grouped into buckets, last tensor first (the backward's order)."""
    buckets: list = []
    current: list = []
    size = 0
    for i in reversed(range(len(tensors))):
        current.append(i)
        size += _nbytes(tensors[i], limit)
        if size >= limit:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def pending_count() -> int:
    """Buckets started and not finished (tests: 0 after every completed step)."""
    with _lock:
        return len(_pending)


#: (bucket name, time.monotonic() of submission) of the latest starts, for tests and diagnosis
submissions: list = []


def _drain(token: int) -> None:
    """Wait for an abandoned bucket and forget it (its error was reported elsewhere, or nobody asks)."""
    with _lock:
        entry = _pending.pop(token, None)
        if entry is not None and _by_key.get(entry[0]) == token:
            del _by_key[entry[0]]
    if entry is not None:
        try:
            entry[1].wait()
        except Exception:
            pass


def forget_finished() -> int:
    """Claim and forget every bucket whose collective has finished (failed, after an elastic reset)
    without its finish having run: its step was abandoned. Returns how many. A bucket still running
    stays registered: the next start under its name waits for it, as after any abandoned step."""
    with _lock:
        done = [token for token, (_, handle, _) in _pending.items() if handle.poll()]
    for token in done:
        _drain(token)
    return len(done)


def _start(arrays: Sequence[np.ndarray], name: str, set_key: Any, op: ReduceOp, prescale: float,
           postscale: float, process_set: Any, labels: Sequence[str],
           observe: Optional[Callable[[Sequence[np.ndarray]], None]]) -> int:
    key = (name, set_key)
    with _lock:
        stale = _by_key.get(key)
    if stale is not None:
        _drain(stale)
    if observe is not None:
        observe(arrays)
    handle = hvps.grouped_allreduce_async(list(arrays), op=op, name=name, prescale_factor=prescale,
                                          postscale_factor=postscale, process_set=process_set)
    token = next(_tokens)
    with _lock:
        _pending[token] = (key, handle, tuple(labels))
        _by_key[key] = token
        submissions.append((name, handle.submitted_at))
        del submissions[:-256]
    return token


def _finish(token: int) -> list:
    with _lock:
        entry = _pending.pop(token, None)
        if entry is not None and _by_key.get(entry[0]) == token:
            del _by_key[entry[0]]
    if entry is None:
        raise HvpsError(f"hvps gradient bucket {token} was never started or was already finished")
    key, handle, labels = entry
    try:
        result = handle.wait()
    except HvpsError as err:
        raise HvpsError(f"{err} (gradient bucket '{key[0]}' of {', '.join(labels)})") from err
    return list(result) if isinstance(result, (list, tuple)) else [result]


class Started:
    """Buckets whose start ops exist (graph) or ran (eagerly); :func:`finish_buckets` finishes them."""

    def __init__(self, tensors: list, buckets: list, tokens: list, op: ReduceOp, prescale: float,
                 postscale: float, process_set: Any) -> None:
        self.tensors, self.buckets, self.tokens = tensors, buckets, tokens
        self.op, self.prescale, self.postscale, self.process_set = op, prescale, postscale, process_set

    def abandon(self) -> None:
        """Eagerly: wait for and forget the started buckets (an exception came between start and finish).
        In a graph nothing ran yet; the registry cleans up after a step that failed at run time."""
        if tf.executing_eagerly():
            for token in self.tokens:
                if token is not None:
                    _drain(int(token.numpy()))
            self.tokens = [None] * len(self.tokens)


def start_buckets(tensors: Sequence[tf.Tensor], op: ReduceOp, name: Optional[str], prescale: float,
                  postscale: float, process_set: Any = None, labels: Optional[Sequence[str]] = None,
                  observe: Optional[Callable[[Sequence[np.ndarray], Sequence[int]], None]] = None,
                  limit: Optional[int] = None) -> Started:
    """Start allreducing ``tensors`` in buckets, each as soon as its tensors exist (see the module).

    ``labels[i]`` names tensor i in error messages; ``observe(arrays, indices)`` sees each
    bucket's inputs (tensors ``indices``) when it starts.
    """
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for t in tensors:
        check_reduce(t, op, process_set)
    labels = list(labels) if labels is not None else [f"tensor {i}" for i in range(len(tensors))]
    limit = bucket_bytes() if limit is None else limit
    buckets = plan_buckets(tensors, limit)
    _warn_if_no_overlap(len(buckets))
    base = f"{name or 'grads'}.bucket"
    set_key = None if process_set is None else tuple(process_set.ranks)
    started = Started(tensors, buckets, [], op, prescale, postscale, process_set)
    try:
        for number, bucket in enumerate(buckets):
            bucket_name = f"{base}{number}"
            see = None if observe is None else (lambda arrays, bucket=bucket: observe(arrays, bucket))

            def start(*arrays, bucket_name=bucket_name, bucket=bucket, see=see):
                token = _start(arrays, bucket_name, set_key, op, prescale, postscale, process_set,
                               [labels[i] for i in bucket], see)
                return [np.asarray(token, dtype=np.int64)]

            (token,) = run(start, [tensors[i] for i in bucket], [tf.int64], name="HvpsAllreduceStart")
            started.tokens.append(token)
    except BaseException:
        started.abandon()
        raise
    return started


def _warn_if_no_overlap(buckets: int) -> None:
    """Once per process, on rank 0: a graph whose buckets cannot overlap its backward pass. With one inter-op
    thread TensorFlow's executor runs the backward's chain of kernels inline and queues each start op behind it
    (measured: ResNet-50's four starts all within 3 ms after the backward), so every bucket waits for the end."""
    global _warned_no_overlap
    if (_warned_no_overlap or buckets < 2 or tf.executing_eagerly()
            or chosen_inter_op_threads() != 1 or hvps.rank() != 0):
        return
    _warned_no_overlap = True
    warn(f"hvps: TensorFlow has one inter-op thread, so none of the {buckets} gradient buckets starts its allreduce "
         "before the backward pass ends; give it 2 or more (tf.config.threading.set_inter_op_parallelism_threads, "
         "TF_NUM_INTEROP_THREADS) for the allreduces to overlap the backward pass")


def finish_buckets(started: Started) -> list:
    """The reduced tensors of :func:`start_buckets`, in input order. Differentiable like
    ``mpi_ops._grouped_allreduce``: the gradient is the same allreduce of the output gradients."""
    xs = started.tensors
    outs: list = [None] * len(xs)
    try:
        for number, (token, bucket) in enumerate(zip(started.tokens, started.buckets)):
            reduced = run(_finish_arrays, [token], [xs[i].dtype for i in bucket], name="HvpsAllreduceFinish")
            started.tokens[number] = None
            for i, r in zip(bucket, reduced):
                r.set_shape(xs[i].shape)
                outs[i] = r
    except BaseException:
        started.abandon()
        raise
    op, prescale, postscale, process_set = started.op, started.prescale, started.postscale, started.process_set
    n = len(xs)

    @tf.custom_gradient
    def attach(*args):
        def grad(*dys):
            if op not in (ReduceOp.Sum, ReduceOp.Average, ReduceOp.Adasum):
                raise NotImplementedError(f"allreduce has gradients for Sum, Average and Adasum, not {op.name}")
            dys = [_zeros_if_none(dy, y) for dy, y in zip(dys, args[n:])]
            return [*_grouped_allreduce(dys, op, None, prescale, postscale, process_set=process_set), *([None] * n)]

        return [tf.identity(y) for y in args[n:]], grad

    return list(attach(*xs, *outs))


def _finish_arrays(token: np.ndarray) -> list:
    return _finish(int(np.asarray(token)))
