"""Horovod's gradient compression interface: ``Compression.none`` and ``Compression.fp16``."""

from __future__ import annotations

import torch


class Compressor:
    """Turns a tensor into what travels, and back; only summable transforms belong here."""

    @staticmethod
    def compress(tensor: torch.Tensor):
        """Return ``(compressed, ctx)``; ctx stays local."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx) -> torch.Tensor:
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
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """Namespace of compressors, as in ``horovod.torch.Compression``."""

    none = NoneCompressor
    fp16 = FP16Compressor
