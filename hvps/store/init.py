"""Initial values that depend only on (seed, row id), never on how the table is sharded."""

from __future__ import annotations

import math

import torch

_M1, _M2, _GOLDEN = 0x5DEECE66D, 0x2545F4914F6CDD1D, 0x61C8864680B583EB


def _logical_shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def hash_uniform(ids: torch.Tensor, dim: int, seed: int, low: float, high: float) -> torch.Tensor:
    """A [len(ids), dim] tensor of uniform values in [low, high), a pure function of (seed, id, column).

    Counter-based (multiply, xorshift, multiply; int64 arithmetic wraps), so every rank can
    initialise exactly its own rows and a re-sharded table starts from the same values.
    """
    offset = (int(seed) * _GOLDEN + 1) % (1 << 64)
    x = ids.to(torch.int64).view(-1, 1) * dim + torch.arange(dim, dtype=torch.int64).view(1, -1)
    x.add_(offset - (1 << 64) if offset >= 1 << 63 else offset).mul_(_M2)
    x.bitwise_xor_(_logical_shift(x, 29)).mul_(_M1 | 1)
    unit = _logical_shift(x, 40).to(torch.float32).mul_(1.0 / (1 << 24))
    return unit.mul_(high - low).add_(low)


def default_bound(num_embeddings: int) -> float:
    """DLRM's initial range: uniform in +-sqrt(1 / num_embeddings)."""
    return math.sqrt(1.0 / num_embeddings)
