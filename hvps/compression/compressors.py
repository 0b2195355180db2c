"""The compressors: none, fp16/bf16 casts, 8-bit quantisation, top-k sparsification."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np

from ..core import dtypes, scaling
from .base import Compressor
from .selection import exact_topk, sampled_topk


class Ctx(NamedTuple):
    """What decompress needs, kept on the sending rank."""

    shape: tuple
    dtype: np.dtype
    extra: Any = None


class NoneCompressor(Compressor):
    """Send gradients as they are (the payload is the gradient itself: no copy)."""

    summable = True

    def compress(self, array, name):
        return [array], Ctx(array.shape, array.dtype)

    def decompress(self, payloads, ctx):
        return payloads[0].reshape(ctx.shape)

    def check(self, array):
        dtypes.check_dtype(array.dtype)


class CastCompressor(Compressor):
    """Send floating-point gradients as float16 or bfloat16, halving the bytes.

    Averaging scales by 1/size (``scaling.overflow_guard``) in the gradient's own dtype before the
    cast, so that the half-precision sum cannot overflow where the average would not. PyTorch's
    ``fp16_compress_hook`` casts first and divides the float16 copy.
    """

    summable = True

    def __init__(self, wire_dtype) -> None:
        self.wire_dtype = np.dtype(wire_dtype)

    def compress(self, array, name):
        self.check(array)
        return [dtypes.cast(array, self.wire_dtype)], Ctx(array.shape, array.dtype)

    def decompress(self, payloads, ctx):
        return dtypes.cast(payloads[0], ctx.dtype).reshape(ctx.shape)

    def prescale(self, size):
        return scaling.overflow_guard(size)


class Int8Compressor(Compressor):
    """8-bit linear quantisation with one float32 scale per chunk (about 3.9x fewer bytes).

    ``stochastic=True`` rounds up with probability equal to the fraction, which
    makes the quantiser unbiased (QSGD); the default rounds to nearest.
    """

    def __init__(self, chunk: int = 256, stochastic: bool = False, seed: int = 0) -> None:
        if chunk < 1:
            raise ValueError("chunk must be a positive number of elements")
        self.chunk = chunk
        self.stochastic = stochastic
        self._rng = np.random.default_rng(seed)

    def compress(self, array, name):
        self.check(array)
        flat = array.reshape(-1).astype(np.float32, copy=False)
        n = flat.size
        padded = np.zeros(-(-n // self.chunk) * self.chunk, dtype=np.float32)
        padded[:n] = flat
        blocks = padded.reshape(-1, self.chunk)
        scales = np.abs(blocks).max(axis=1) / 127.0
        scales[scales == 0] = 1.0
        scaled = blocks / scales[:, None]
        if self.stochastic:
            scaled = np.floor(scaled + self._rng.random(scaled.shape, dtype=np.float32))
        quantised = np.clip(np.rint(scaled), -127, 127).astype(np.int8).reshape(-1)
        # int8 travels as its bytes (uint8), which every backend moves.
        return [quantised.view(np.uint8), scales.astype(np.float32)], Ctx(array.shape, array.dtype, n)

    def decompress(self, payloads, ctx):
        quantised, scales = payloads
        blocks = quantised.view(np.int8).reshape(-1, self.chunk).astype(np.float32) * scales[:, None]
        return blocks.reshape(-1)[: ctx.extra].astype(ctx.dtype).reshape(ctx.shape)


class TopKCompressor(Compressor):
    """Keep the ``density`` fraction of largest-magnitude entries, sent as (indices, values).

    ``selection="sampled"`` estimates the threshold from a sample (DGC), much
    faster than an exact selection on large tensors; ``"exact"`` is exact.
    """

    def __init__(self, density: float, selection: str = "sampled", seed: int = 0) -> None:
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if selection not in ("sampled", "exact"):
            raise ValueError(f"selection must be 'sampled' or 'exact', got {selection!r}")
        self.density = density
        self.selection = selection
        self._rng = np.random.default_rng(seed)

    def k_for(self, n: int) -> int:
        """How many entries a tensor of ``n`` elements keeps."""
        return max(1, int(n * self.density))

    def select(self, flat: np.ndarray, k: int) -> np.ndarray:
        magnitudes = np.abs(flat)
        if self.selection == "exact":
            return exact_topk(magnitudes, k)
        return sampled_topk(magnitudes, k, rng=self._rng)

    def compress(self, array, name):
        self.check(array)
        flat = array.reshape(-1)
        if flat.size == 0:
            return [np.empty(0, np.int32), np.empty(0, flat.dtype)], Ctx(array.shape, array.dtype, 0)
        indices = self.select(flat, self.k_for(flat.size))
        indices = np.sort(indices).astype(np.int32 if flat.size < 2**31 else np.int64)
        return [indices, flat[indices]], Ctx(array.shape, array.dtype, flat.size)

    def decompress(self, payloads, ctx):
        indices, values = payloads
        dense = np.zeros(ctx.extra, dtype=ctx.dtype)
        dense[indices] = values
        return dense.reshape(ctx.shape)

    def residual(self, compensated, payloads, ctx):
        # What was sent is exact, so the residual is the input with those entries zeroed.
        compensated.reshape(-1)[payloads[0]] = 0
        return compensated

    def aggregate(self, gathered, ctx, size):
        indices, values = gathered
        summed = np.zeros(ctx.extra, dtype=ctx.dtype)
        np.add.at(summed, indices, values)  # in rank order: every rank gets the same bits
        return summed.reshape(ctx.shape)


class DensitySchedule:
    """DGC's warm-up: density per epoch from a list, then the final density."""

    def __init__(self, final: float, warmup: Optional[list] = None) -> None:
        self.final = final
        self.warmup = list(warmup or [])
        for d in [final, *self.warmup]:
            if not 0 < d <= 1:
                raise ValueError(f"densities must be in (0, 1], got {d}")

    def at(self, epoch: int) -> float:
        """The density for ``epoch`` (0-based)."""
        return self.warmup[epoch] if 0 <= epoch < len(self.warmup) else self.final
