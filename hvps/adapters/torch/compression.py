"""Gradient compression for PyTorch: the core's compressors, plus Horovod-style ones.

``hvd.Compression.none`` / ``.fp16`` / ``.bf16`` / ``.int8`` / ``.topk(d)`` /
``.dgc(d)`` / ``.powersgd(rank)`` are ``hvps.compression.GradientCompression`` objects. A
Horovod-style compressor (a class with ``compress(tensor) -> (tensor, ctx)``
and ``decompress(tensor, ctx)``) is accepted too, as a summable transform.
"""

from __future__ import annotations

from typing import Any

import torch

from hvps.compression import GradientCompression, framework_compressors, summable
from hvps.core.views import as_tensor

from .tensors import to_numpy

__all__ = ["Compression", "as_gradient_compression", "compress_tensor", "decompress_tensor", "compress_for_sum",
           "decompress_sum", "OPS"]


def as_gradient_compression(compression: Any) -> GradientCompression:
    """The core pipeline for ``compression`` (a GradientCompression, None, or a Horovod-style compressor)."""
    return framework_compressors.as_gradient_compression(compression, as_tensor, lambda t: to_numpy(t.contiguous()))


class _TorchOps:
    """``hvps.compression.summable.CompressionOps`` (and so ``hvps.core.scaling.TensorOps``) for torch tensors."""

    pipeline_users = "DistributedOptimizer"
    is_floating = staticmethod(lambda t: t.is_floating_point())
    dtype = staticmethod(lambda t: t.dtype)
    dtype_named = staticmethod(lambda name: getattr(torch, name))
    cast = staticmethod(lambda t, dtype: t.to(dtype))
    scale = staticmethod(lambda t, factor: t * factor)
    divide = staticmethod(lambda t, divisor: t / divisor)


OPS = _TorchOps()


#: compress_tensor / decompress_tensor (Horovod's tensor interface) and compress_for_sum /
#: decompress_sum (around a grouped allreduce or reducescatter, with the cast's overflow guard)
_SUMMABLE = summable.Summable(OPS, as_gradient_compression)
compress_tensor = _SUMMABLE.compress_tensor
decompress_tensor = _SUMMABLE.decompress_tensor
compress_for_sum = _SUMMABLE.compress_for_sum
decompress_sum = _SUMMABLE.decompress_sum
#: ``hvd.Compression``: the core's compressions, each with Horovod's ``compress``/``decompress`` on torch tensors
Compression = summable.TensorNamespace(_SUMMABLE)
