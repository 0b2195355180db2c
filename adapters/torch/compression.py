"""Gradient compression for PyTorch: the core's compressors, plus Horovod-style ones.

``hvd.Compression.none`` / ``.fp16`` / ``.bf16`` / ``.int8`` / ``.topk(d)`` /
``.dgc(d)`` are ``hvps.compression.GradientCompression`` objects. A
Horovod-style compressor (a class with ``compress(tensor) -> (tensor, ctx)``
and ``decompress(tensor, ctx)``) is accepted too, as a summable transform.
"""

from __future__ import annotations

from typing import Any

import torch

from hvps.compression import CastCompressor, Compression, GradientCompression, NoneCompressor, horovod

from .tensors import from_numpy, to_numpy

__all__ = ["Compression", "as_gradient_compression", "compress_tensor", "decompress_tensor"]


def as_gradient_compression(compression: Any) -> GradientCompression:
    """The core pipeline for ``compression`` (a GradientCompression, None, or a Horovod-style compressor)."""
    return horovod.as_gradient_compression(compression, from_numpy, lambda t: to_numpy(t.contiguous()))


def compress_tensor(compression: Any, tensor: torch.Tensor) -> tuple:
    """Horovod's ``compress(tensor)`` for summable compressions, as torch ops (autograd flows through)."""
    pipeline = as_gradient_compression(compression)
    compressor = pipeline.compressor
    if isinstance(compressor, NoneCompressor):
        return tensor, None
    if isinstance(compressor, CastCompressor):
        if not tensor.dtype.is_floating_point:
            return tensor, None
        wire = torch.float16 if compressor.wire_dtype == "float16" else torch.bfloat16
        return tensor.to(wire), tensor.dtype
    if isinstance(compressor, horovod.TensorCompressor):
        return compressor.horovod.compress(tensor)
    raise ValueError(f"{pipeline!r} is not a summable compression: use it through DistributedOptimizer")


def decompress_tensor(compression: Any, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
    """Undo ``compress_tensor``."""
    compressor = as_gradient_compression(compression).compressor
    if isinstance(compressor, horovod.TensorCompressor):
        return compressor.horovod.decompress(tensor, ctx)
    return tensor if ctx is None else tensor.to(ctx)
