"""Averaging a list of gradients over ranks: what DistributedGradientTape and the Keras
DistributedOptimizer share.

Dense gradients go one of two ways, depending on the compression:

- none, fp16, bf16 and Horovod-style compressors are summable TensorFlow ops
  around bucketed grouped allreduces that overlap the backward pass (``overlap``):
  buckets of ~25 MiB (``HVPS_TF_BUCKET_BYTES``), last variables first, each started
  by its own stateful op as soon as the backward has produced its gradients and
  finished (waited for) once every bucket has started; ``tf.IndexedSlices`` are
  allgathered between the starts and the finishes;
- int8, top-k and DGC run through the core's ``GradientCompression`` pipeline
  inside one stateful op: every gradient is compressed and its exchange started
  (allgather of the sparse or quantised payloads), then every exchange is
  finished, so the exchanges overlap each other. Error feedback and DGC
  momentum are kept per gradient name (``<prefix>.<index>.<variable path>``).

Either way the pipeline's ``stats`` count the bytes on the wire.
``tf.IndexedSlices`` are allgathered as (values, indices), uncompressed, or
densified first with ``sparse_as_dense``. ``None`` gradients stay ``None``:
they come from the model's structure, which is the same on every rank.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf

import hvps
from hvps import ReduceOp
from hvps.adapters.common import options
from hvps.api.collectives import check_name
from hvps.compression import GradientCompression

from . import overlap
from .compression import OPS, as_gradient_compression, compress_for_sum, decompress_sum, is_fusable
from .mpi_ops import Average, _check_process_set, _sparse_allreduce
from .tensors import run


def gradient_options(op: Any, gradient_predivide_factor: float, compression: Any,
                     backward_passes_per_step: int = 1) -> options.GradientOptions:
    """``(op, pipeline, prescale, postscale)`` for reducing gradients, every argument checked
    (``hvps.adapters.common.options.gradient_options``): ValueError for a predivide factor without
    Average or a compression that cannot use ``op``, TypeError for something that is not a compression."""
    return options.gradient_options(op, gradient_predivide_factor, compression, as_gradient_compression,
                                    backward_passes_per_step=backward_passes_per_step, fusable=is_fusable)


def variable_name(variable: Any, fallback: str = "tensor") -> str:
    """A name for ``variable`` that is the same on every rank and every trace: the Keras path, the
    tf.Variable name, else ``fallback`` (tensors' graph names change between traces)."""
    path = getattr(variable, "path", None)
    if isinstance(path, str) and path:
        return path
    if isinstance(variable, tf.Variable):
        return variable.name.split(":")[0]
    return fallback


def reduce_shared_gradients(grads: Sequence[Any], variables: Sequence[Any], local: set, reduce: Any,
                            scale_local: bool, process_set: Any = None) -> list:
    """``reduce(grads, variables)`` for the shared variables only; the gradients of ``local`` ones
    (a set of :func:`variable_key`) stay on this rank, divided by the set size when ``scale_local``
    (Horovod's PartialDistributedGradientTape / PartialDistributedOptimizer)."""
    grads, variables = list(grads), list(variables)
    is_local = [v is not None and variable_key(v) in local for v in variables]
    if not any(is_local):
        return reduce(grads, variables)
    shared = [i for i, here in enumerate(is_local) if not here]
    out = list(grads)
    for i, g in zip(shared, reduce([grads[i] for i in shared], [variables[i] for i in shared])):
        out[i] = g
    if scale_local:
        set_size = hvps.size() if process_set is None else process_set.size()
        out = [_divided(g, set_size) if here and g is not None else g for g, here in zip(out, is_local)]
    return out


def variable_key(variable: Any) -> Any:
    """A hashable identity for a tf.Variable (its ``ref()``) or a Keras 3 variable (the object)."""
    return variable.ref() if hasattr(variable, "ref") else id(variable)


def _divided(grad: Any, divisor: int) -> Any:
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(OPS.divide(grad.values, divisor), grad.indices, grad.dense_shape)
    return OPS.divide(grad, divisor)


def allreduce_gradients(grads: Sequence[Any], op: ReduceOp = Average, compression: Any = None,
                        sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                        name: Optional[str] = None, names: Optional[Sequence[str]] = None,
                        process_set: Any = None) -> list:
    """Reduce ``grads`` (tensors, IndexedSlices or None) over the set's ranks; same structure back.

    ``names[i]`` names gradient i (its variable's path): the key of compression state
    (error feedback) and of the exchanges; give the same names on every rank and step.
    Ranks outside ``process_set`` get their gradients back unreduced, as in Horovod.
    """
    op, pipeline, prescale, postscale = gradient_options(op, gradient_predivide_factor, compression)
    name = check_name(name)  # before it is built into the gradients' names
    fused = is_fusable(pipeline)
    if not fused:
        _check_process_set(process_set)
    grads = list(grads)
    if names is not None and len(names) != len(grads):
        raise ValueError(f"{len(names)} names for {len(grads)} gradients")
    if process_set is not None and not process_set.included():
        return grads
    set_size = hvps.size() if process_set is None else process_set.size()
    if set_size == 1 and fused and prescale == postscale == 1.0:
        return grads  # every op is the identity on one rank
    out: list = [None] * len(grads)
    dense_index, dense, sparse_index = [], [], []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            if sparse_as_dense:
                g = tf.convert_to_tensor(g)
            else:
                sparse_index.append(i)
                continue
        dense_index.append(i)
        dense.append(tf.convert_to_tensor(g))

    def reduce_sparse():
        for i in sparse_index:
            out[i] = _sparse_allreduce(grads[i], op, None if name is None else f"{name}.sparse.{i}", process_set)

    if not dense:
        reduce_sparse()
        return out
    if not fused:
        reduce_sparse()
        prefix = name or "grad"
        labels = [f"{prefix}.{i}.{names[i] if names is not None else 'tensor'}" for i in dense_index]
        reduced = _compressed_allreduce(dense, labels, pipeline, op)
    else:
        # the dense buckets start first (each as soon as the backward has produced its gradients),
        # the sparse allgathers run while they are in flight, then the buckets finish
        labels = [names[i] if names is not None else f"gradient {i}" for i in dense_index]
        reduced = _fused_allreduce(dense, pipeline, op, prescale, postscale, name, process_set, labels,
                                   between=reduce_sparse)
    for i, r in zip(dense_index, reduced):
        out[i] = r
    return out


def _fused_allreduce(dense: list, pipeline: GradientCompression, op: ReduceOp, prescale: float,
                     postscale: float, name: Optional[str], process_set: Any = None,
                     labels: Optional[list] = None, between: Any = None) -> list:
    """Summable compression as TensorFlow ops around bucketed allreduces that overlap the backward
    pass (``overlap``: a start op per bucket as soon as its gradients exist, then the finishes);
    differentiable. ``between()`` runs after the starts and before the finishes."""
    dense_itemsizes = [g.dtype.size for g in dense]
    payloads, ctxs, plan = compress_for_sum(pipeline, dense, op,
                                            lambda: hvps.size() if process_set is None else process_set.size(),
                                            prescale, postscale)

    def observe(arrays, indices):
        for array, i in zip(arrays, indices):
            pipeline.record(array.size * dense_itemsizes[i], [array])

    started = overlap.start_buckets(payloads, plan.op, name, plan.prescale, plan.postscale, process_set, labels,
                                    observe)
    try:
        if between is not None:
            between()
    except BaseException:
        started.abandon()
        raise
    reduced = overlap.finish_buckets(started)
    return decompress_sum(pipeline, reduced, ctxs, plan)


def _compressed_allreduce(dense: list, labels: list, pipeline: GradientCompression, op: ReduceOp) -> list:
    """Every gradient through ``pipeline``: start all exchanges, then finish all (one stateful op).
    The compressors exchange float32 values and average after decompressing, so a predivide
    factor would cancel out: none is applied (as in the torch DistributedOptimizer)."""
    for g in dense:
        if not g.dtype.is_floating:
            raise TypeError(f"{pipeline!r} compresses floating-point gradients only, not {g.dtype.name}")

    def exchange(*arrays):
        pending = []
        try:
            for array, label in zip(arrays, labels):
                pending.append(pipeline.start(np.asarray(array), label, op))
        except BaseException:
            for handle in pending:  # let the started exchanges complete before reporting
                try:
                    handle.wait()
                except Exception:
                    pass
            raise
        return [handle.wait() for handle in pending]

    outs = run(exchange, dense, [g.dtype for g in dense], name="HvpsCompressedAllreduce")
    for out, g in zip(outs, dense):
        out.set_shape(g.shape)
    return outs
