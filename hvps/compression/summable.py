"""Summable compressions (none, fp16/bf16 casts, Horovod-style compressors) as framework tensor ops.

When an adapter runs the allreduce itself, on the framework's own tensors (a grouped allreduce,
``hvd.allreduce(..., compression=...)``, a fused gradient op), the compression runs as tensor ops
around it. This module is that one implementation for every adapter, which supplies only a small
:class:`CompressionOps` (cast, scale, dtype questions). The scaling steps (the casts' overflow
guard, Average, the caller's prescale and postscale) are planned by ``hvps.core.scaling.sum_plan``,
as ``GradientCompression.start`` plans them for numpy arrays.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Protocol

from ..core import scaling
from ..core.dtypes import ReduceOp
from ..core.scaling import SumPlan
from .base import Compressor
from .compressors import CastCompressor, NoneCompressor
from .framework_compressors import TensorCompressor
from .pipeline import GradientCompression


class CompressionOps(scaling.TensorOps, Protocol):
    """What the summable compressions need from a framework's tensors, beyond scaling."""

    #: where non-summable compressions run instead, for the error message
    pipeline_users: str

    def dtype(self, tensor: Any) -> Any: ...

    def dtype_named(self, name: str) -> Any:
        """The framework's dtype called ``name`` ("float16", "bfloat16")."""

    def cast(self, tensor: Any, dtype: Any) -> Any: ...


def summable_plan(compressor: Compressor, op: ReduceOp, size: Callable[[], int], prescale: float = 1.0,
                  postscale: float = 1.0, all_floating: bool = True) -> SumPlan:
    """``scaling.sum_plan`` for reducing tensors through ``compressor``, whose ``prescale`` is the
    guard. The guard needs every tensor to be floating point (casts leave integers alone, and a
    sum of integers would then not be divided)."""
    guarded = all_floating and not isinstance(compressor, NoneCompressor)
    return scaling.sum_plan(op, size, compressor.prescale if guarded else None, prescale, postscale)


def compress_tensor(pipeline: GradientCompression, tensor: Any, ops: CompressionOps) -> tuple:
    """Horovod's ``compress(tensor) -> (tensor, ctx)`` for a summable ``pipeline``, as ``ops``."""
    compressor = pipeline.compressor
    if isinstance(compressor, NoneCompressor):
        return tensor, None
    if isinstance(compressor, CastCompressor):
        wire = ops.dtype_named(compressor.wire_dtype.name)
        if not ops.is_floating(tensor) or ops.dtype(tensor) == wire:
            return tensor, None
        return ops.cast(tensor, wire), ops.dtype(tensor)
    if isinstance(compressor, TensorCompressor):
        return compressor.horovod.compress(tensor)
    raise ValueError(f"{pipeline!r} is not a summable compression: use it through {ops.pipeline_users}")


def decompress_tensor(pipeline: GradientCompression, tensor: Any, ctx: Any, ops: CompressionOps) -> Any:
    """Undo :func:`compress_tensor`."""
    if isinstance(pipeline.compressor, TensorCompressor):
        return pipeline.compressor.horovod.decompress(tensor, ctx)
    return tensor if ctx is None else ops.cast(tensor, ctx)


def compress_for_sum(pipeline: GradientCompression, tensors: list, ops: CompressionOps, op: ReduceOp,
                     size: Callable[[], int],
                     prescale: float = 1.0, postscale: float = 1.0) -> tuple:
    """``(payloads, ctxs, plan)``: ``tensors`` scaled and compressed for one (grouped) allreduce
    or reducescatter that ``plan`` describes."""
    plan = summable_plan(pipeline.compressor, op, size, prescale, postscale,
                         all_floating=all(ops.is_floating(t) for t in tensors))
    pairs = [compress_tensor(pipeline, t, ops) for t in scaling.scale_all(tensors, plan.before, ops)]
    return [c for c, _ in pairs], [ctx for _, ctx in pairs], plan


def decompress_sum(pipeline: GradientCompression, outputs: list, ctxs: list, plan: SumPlan,
                   ops: CompressionOps) -> list:
    """Undo :func:`compress_for_sum` on the collective's ``outputs``."""
    out = [decompress_tensor(pipeline, o, ctx, ops) for o, ctx in zip(outputs, ctxs)]
    return scaling.scale_all(out, plan.after, ops)


class Summable:
    """The functions above bound to one adapter's ``ops``, taking what users pass as
    ``compression=`` (``as_pipeline`` turns it into a ``GradientCompression``)."""

    def __init__(self, ops: CompressionOps, as_pipeline: Callable[[Any], GradientCompression]) -> None:
        self.ops, self.as_pipeline = ops, as_pipeline

    def compress_tensor(self, compression: Any, tensor: Any) -> tuple:
        """Horovod's ``compress(tensor)`` for summable compressions, as tensor ops (gradients flow through)."""
        return compress_tensor(self.as_pipeline(compression), tensor, self.ops)

    def decompress_tensor(self, compression: Any, tensor: Any, ctx: Any) -> Any:
        """Undo ``compress_tensor``."""
        return decompress_tensor(self.as_pipeline(compression), tensor, ctx, self.ops)

    def compress_for_sum(self, compression: Any, tensors: list, op: ReduceOp, size: Callable[[], int],
                         prescale: float = 1.0, postscale: float = 1.0) -> tuple:
        """``(payloads, ctxs, plan)`` for one (grouped) allreduce or reducescatter of ``tensors``."""
        return compress_for_sum(self.as_pipeline(compression), tensors, self.ops, op, size, prescale, postscale)

    def decompress_sum(self, compression: Any, outputs: list, ctxs: list, plan: SumPlan) -> list:
        """Undo ``compress_for_sum`` on the collective's ``outputs``."""
        return decompress_sum(self.as_pipeline(compression), outputs, ctxs, plan, self.ops)


class TensorNamespace:
    """An adapter's ``hvd.Compression``: each of the core's compressions (``.fp16``, ``.topk(0.01)``, ...),
    built fresh on every access as the core's namespace builds them, with Horovod's tensor interface
    added: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)`` on the framework's
    tensors (summable compressions only: none, fp16, bf16)."""

    def __init__(self, summable: Summable) -> None:
        class WithTensorInterface(GradientCompression):
            def compress(self, tensor: Any) -> tuple:
                """Horovod's ``Compression.X.compress(tensor)``: the tensor as it travels, and what undoes it."""
                return summable.compress_tensor(self, tensor)

            def decompress(self, tensor: Any, ctx: Any) -> Any:
                """Horovod's ``Compression.X.decompress(tensor, ctx)``."""
                return summable.decompress_tensor(self, tensor, ctx)

        self._kind = WithTensorInterface

    def _with_interface(self, pipeline: GradientCompression) -> GradientCompression:
        """``pipeline`` with the tensor interface, if it is a plain one (PowerSGD's two rounds have none)."""
        if type(pipeline) is GradientCompression:
            pipeline.__class__ = self._kind  # freshly built and unshared: safe to re-class
        return pipeline

    def __getattr__(self, name: str) -> Any:
        from .registry import Compression

        if name.startswith("_"):
            raise AttributeError(name)
        made = getattr(Compression, name)  # AttributeError for names the core lacks
        if isinstance(made, GradientCompression):
            return self._with_interface(made)

        @functools.wraps(made)
        def build(*args: Any, **kwargs: Any) -> GradientCompression:
            return self._with_interface(made(*args, **kwargs))

        return build

    def __dir__(self) -> list:
        from .registry import Compression

        return [name for name in dir(Compression) if not name.startswith("_")]
