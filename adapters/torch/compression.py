"""Gradient compression for PyTorch: the core's compressors, plus Horovod-style ones.

``hvd.Compression.none`` / ``.fp16`` / ``.bf16`` / ``.int8`` / ``.topk(d)`` /
``.dgc(d)`` are ``hvps.compression.GradientCompression`` objects. A
Horovod-style compressor (a class with ``compress(tensor) -> (tensor, ctx)``
and ``decompress(tensor, ctx)``) is accepted too, as a summable transform.
"""

from __future__ import annotations

from typing import Any

import torch

from hvps import dtypes
from hvps.compression import CastCompressor, Compression, Compressor, GradientCompression, NoneCompressor

from .tensors import from_numpy, to_numpy

__all__ = ["Compression", "as_gradient_compression", "compress_tensor", "decompress_tensor"]


class HorovodCompressor(Compressor):
    """Runs a Horovod-style tensor compressor inside the core's pipeline (summable payloads)."""

    summable = True

    def __init__(self, horovod_compressor: Any) -> None:
        self.horovod = horovod_compressor

    def compress(self, array, name):
        compressed, ctx = self.horovod.compress(from_numpy(array))
        return [to_numpy(compressed.contiguous())], (ctx, array.shape)

    def decompress(self, payloads, ctx):
        tensor = self.horovod.decompress(from_numpy(payloads[0]), ctx[0])
        return to_numpy(tensor.contiguous()).reshape(ctx[1])

    def check(self, array):
        dtypes.check_dtype(array.dtype)


def as_gradient_compression(compression: Any) -> GradientCompression:
    """The core pipeline for ``compression`` (a GradientCompression or a Horovod-style compressor)."""
    if isinstance(compression, GradientCompression):
        return compression
    if callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None)):
        name = getattr(compression, "__name__", type(compression).__name__)
        return GradientCompression(f"horovod:{name}", HorovodCompressor(compression))
    raise TypeError(
        f"compression must be one of hvd.Compression.none/fp16/bf16/int8/topk(...)/dgc(...) or a Horovod-style "
        f"compressor with compress/decompress; got {compression!r}"
    )


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
    if isinstance(compressor, HorovodCompressor):
        return compressor.horovod.compress(tensor)
    raise ValueError(f"{pipeline!r} is not a summable compression: use it through DistributedOptimizer")


def decompress_tensor(compression: Any, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
    """Undo ``compress_tensor``."""
    compressor = as_gradient_compression(compression).compressor
    if isinstance(compressor, HorovodCompressor):
        return compressor.horovod.decompress(tensor, ctx)
    return tensor if ctx is None else tensor.to(ctx)
