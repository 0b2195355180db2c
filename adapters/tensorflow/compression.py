"""Horovod's gradient compression interface for tf.Tensors: ``Compression.none`` and ``Compression.fp16``."""

from __future__ import annotations

import tensorflow as tf


class Compressor:
    """Turns a tensor into what travels, and back; only summable transforms belong here."""

    @staticmethod
    def compress(tensor: tf.Tensor):
        """Return ``(compressed, ctx)``; ctx stays local."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx) -> tf.Tensor:
        """Undo ``compress``."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16, halving the bytes on the wire."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """Namespace of compressors, as in ``horovod.tensorflow.Compression``."""

    none = NoneCompressor
    fp16 = FP16Compressor
