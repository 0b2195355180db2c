"""Gradient compression for TensorFlow: the core's compressors, plus Horovod-style ones.

``hvd.Compression.none`` / ``.fp16`` / ``.bf16`` / ``.int8`` / ``.topk(d)`` /
``.dgc(d)`` are ``hvps.compression.GradientCompression`` objects, each with Horovod's
``compress``/``decompress`` on tf.Tensors (as in the PyTorch adapter). Build a stateful one
(``topk``, ``dgc``: error feedback and momentum live in it) once and pass that
object to every step. A Horovod-style compressor (a class or object with
``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)`` on
tf.Tensors, such as ``FP16Compressor`` below) is accepted too, as a summable
transform.

Summable compressions (none, fp16, bf16, Horovod-style) run as TensorFlow ops
around the fused allreduce (``compress_tensor`` / ``decompress_tensor``);
the others (int8, top-k, DGC) only through ``DistributedGradientTape`` and the
Keras ``DistributedOptimizer``, which run them through the core pipeline.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from hvps.compression import CastCompressor, GradientCompression, summable
from hvps.compression import NoneCompressor as _CoreNone
from hvps.compression.framework_compressors import TensorCompressor
from hvps.compression.framework_compressors import as_gradient_compression as _as_gradient_compression

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "as_gradient_compression",
           "compress_tensor", "decompress_tensor", "compress_for_sum", "decompress_sum"]


class Compressor:
    """Horovod's interface for a summable transform of tf.Tensors; subclass it for your own."""

    @staticmethod
    def compress(tensor: tf.Tensor):
        """Return ``(compressed, ctx)``; ctx stays local."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx) -> tf.Tensor:
        """Undo ``compress``."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Horovod-style: send tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Horovod-style: send floating-point tensors as float16 (no prescaling; ``Compression.fp16`` prescales)."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


def _to_tensor(array: np.ndarray) -> tf.Tensor:
    return tf.convert_to_tensor(array)


def _to_array(tensor: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(tensor.numpy() if hasattr(tensor, "numpy") else tensor))


def as_gradient_compression(compression: Any) -> GradientCompression:
    """The core pipeline for ``compression`` (a GradientCompression, None, or a Horovod-style compressor)."""
    return _as_gradient_compression(compression, _to_tensor, _to_array)


def is_fusable(pipeline: GradientCompression) -> bool:
    """Whether ``pipeline`` runs as TensorFlow ops around a fused allreduce (none, casts, Horovod-style)."""
    return isinstance(pipeline.compressor, (_CoreNone, CastCompressor, TensorCompressor))


class _TensorFlowOps:
    """``hvps.compression.summable.CompressionOps`` (and so ``hvps.core.scaling.TensorOps``) for tf.Tensors."""

    pipeline_users = "DistributedGradientTape or the Keras DistributedOptimizer"
    is_floating = staticmethod(lambda t: t.dtype.is_floating)
    dtype = staticmethod(lambda t: t.dtype)
    dtype_named = staticmethod(lambda name: tf.as_dtype(name))
    cast = staticmethod(tf.cast)
    scale = staticmethod(lambda t, factor: t * tf.cast(factor, t.dtype))
    divide = staticmethod(lambda t, divisor: t / tf.cast(divisor, t.dtype))


OPS = _TensorFlowOps()


#: compress_tensor / decompress_tensor (Horovod's tensor interface) and compress_for_sum /
#: decompress_sum (around a grouped allreduce or reducescatter, with the cast's overflow guard)
_SUMMABLE = summable.Summable(OPS, as_gradient_compression)
compress_tensor = _SUMMABLE.compress_tensor
decompress_tensor = _SUMMABLE.decompress_tensor
compress_for_sum = _SUMMABLE.compress_for_sum
decompress_sum = _SUMMABLE.decompress_sum
#: ``hvd.Compression``: the core's compressions, each with Horovod's ``compress``/``decompress`` on tf.Tensors
Compression = summable.TensorNamespace(_SUMMABLE)
