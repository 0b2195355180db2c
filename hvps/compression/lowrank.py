"""PowerSGD's compressor: rank-r approximation ``M ~ P Q^T`` by one power iteration (hyper-parameters only).

Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization" (NeurIPS 2019), Algorithm 1. The exchange runs in two rounds, so the pipeline
(``powersgd.PowerSGDCompression``) calls the steps below between its two allreduces; the
per-tensor state (Q, error, step count) lives in ``powersgd_state.PowerSGDState``.
"""

from __future__ import annotations

import zlib
from typing import Optional

import numpy as np

from .base import Compressor
from .compressors import Ctx


class PowerSGDCompressor(Compressor):
    """Rank-``rank`` factors of every gradient matrix that gains at least ``min_compression_rate``.

    A tensor of shape ``(n, *rest)`` is viewed as the matrix ``(n, prod(rest))``; tensors with
    fewer than 2 dimensions, or with ``n * m <= min_compression_rate * (n + m) * rank``, travel
    dense. Both factors are summable (they go through allreduce), so this rank's bytes per step
    stay the same as ranks are added.
    """

    #: P and Q are summed by allreduce
    summable = True

    def __init__(self, rank: int = 1, min_compression_rate: float = 2.0, epsilon: float = 1e-8,
                 seed: int = 0) -> None:
        if isinstance(rank, float) and rank.is_integer():
            rank = int(rank)  # from_name("powersgd(2)") passes a float
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
            raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
        if not min_compression_rate >= 1:
            raise ValueError(f"min_compression_rate must be >= 1 (below 1 a factorisation sends more bytes than "
                             f"the dense tensor), got {min_compression_rate!r}")
        if not epsilon >= 0:
            raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
        self.rank = int(rank)
        self.min_compression_rate = float(min_compression_rate)
        self.epsilon = float(epsilon)
        self.seed = int(seed)

    # -- which tensors, as which matrix ----------------------------------------------------------
    def matrix_shape(self, shape: tuple) -> Optional[tuple]:
        """``(n, m)`` when a tensor of ``shape`` is compressed, None when it travels dense."""
        if len(shape) < 2:
            return None
        n = int(shape[0])
        m = int(np.prod(shape[1:], dtype=np.int64))
        if n * m <= self.min_compression_rate * (n + m) * self.rank:
            return None
        return n, m

    def check_shape(self, shape: tuple, name: str) -> None:
        """ValueError naming ``rank`` when a matrix big enough to compress at rank 1 has a side
        shorter than ``rank`` (it cannot have that rank)."""
        if len(shape) < 2:
            return
        n, m = int(shape[0]), int(np.prod(shape[1:], dtype=np.int64))
        if self.rank > min(n, m) and n * m > self.min_compression_rate * (n + m):
            raise ValueError(f"rank={self.rank} is larger than the smallest dimension ({min(n, m)}) of {name!r}, "
                             f"viewed as a {n}x{m} matrix; choose rank <= {min(n, m)}")

    @staticmethod
    def work_dtype(dtype: np.dtype) -> np.dtype:
        """float64 gradients are factored in float64, every other float dtype in float32."""
        return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)

    # -- the power iteration --------------------------------------------------------------------
    def draw_q(self, name: str, m: int, draw: int, dtype: np.dtype) -> np.ndarray:
        """A standard-normal ``(m, rank)`` start for Q, the same on every rank: seeded by the
        seed, the tensor's name and ``draw`` (how many times this tensor has drawn before)."""
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode()), draw])
        return rng.standard_normal((m, self.rank)).astype(dtype)

    def orthogonalize(self, p: np.ndarray) -> np.ndarray:
        """Gram-Schmidt on ``p``'s columns, in place; ``epsilon`` keeps vanishing columns finite."""
        for i in range(p.shape[1]):
            col = p[:, i]
            col /= np.linalg.norm(col) + self.epsilon
            if i + 1 < p.shape[1]:
                rest = p[:, i + 1:]
                rest -= np.outer(col, col @ rest)
        return p

    def compress(self, array, name):
        raise NotImplementedError("PowerSGD exchanges in two rounds (P, then Q): use it through "
                                  "Compression.powersgd(...), which runs both")

    def decompress(self, payloads, ctx):
        """``P Q^T`` in the gradient's shape and dtype (``ctx.extra``, when set, is that product already)."""
        approximation = ctx.extra if ctx.extra is not None else payloads[0] @ payloads[1].T
        return approximation.reshape(ctx.shape).astype(ctx.dtype, copy=False)

    def residual(self, compensated, payloads, ctx):
        approximation = ctx.extra if ctx.extra is not None else payloads[0] @ payloads[1].T
        return np.subtract(compensated, approximation, out=compensated)

    def settings(self) -> tuple:
        """The hyper-parameters every rank must share."""
        return (self.rank, self.min_compression_rate, self.epsilon, self.seed)


def approximation_ctx(shape: tuple, dtype: np.dtype, approximation: np.ndarray) -> Ctx:
    """What ``decompress`` and ``residual`` need once ``P Q^T`` has been computed."""
    return Ctx(tuple(shape), np.dtype(dtype), approximation)


__all__ = ["PowerSGDCompressor", "approximation_ctx"]
