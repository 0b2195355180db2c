"""Adasum: adaptive summation of gradients (Maleki et al., "Scaling Distributed Training with
Adaptive Summation", MLSys 2021), as Horovod's ``op=Adasum``.

Two gradients combine as ``(1 - a·b/(2‖a‖²))·a + (1 - a·b/(2‖b‖²))·b``: orthogonal ones add,
parallel ones average. Across ``2^k`` ranks the combination runs by recursive vector halving:

1. at level ``l`` (distance ``d = 2^l``) each rank pairs with ``rank ^ d``; the pair splits its
   current segment, the lower rank keeps the first half and the upper one the second, and they
   swap the halves they give away, so each holds its half of both vectors;
2. the three dot products ``a·b``, ``‖a‖²``, ``‖b‖²`` are summed over the ``2^(l+1)`` ranks that
   together hold the whole of both vectors (recursive doubling of three scalars), and every rank
   combines its half with the same coefficients;
3. after ``k`` levels each rank holds ``1/2^k`` of the result; the halvings are undone in reverse
   (each pair swaps its pieces) until every rank has all of it.

Level ``l`` combines the results of blocks of ``2^l`` adjacent ranks: the tree is
``combine(combine(x0, x1), combine(x2, x3))`` for four ranks. Dot products accumulate in float64.
The data plane only needs ``Backend.sendrecv``.
"""

from __future__ import annotations

import numpy as np

from ..core import arrays


def is_power_of_two(n: int) -> bool:
    """Whether ``n`` is 1, 2, 4, 8, ..."""
    return n > 0 and n & (n - 1) == 0


def combine(a: np.ndarray, b: np.ndarray, dots: tuple) -> np.ndarray:
    """Adasum's combination of ``a`` and ``b`` given ``(a·b, ‖a‖², ‖b‖²)`` of the whole vectors."""
    ab, aa, bb = dots
    ca = 1.0 - ab / (2.0 * aa) if aa > 0 else 1.0
    cb = 1.0 - ab / (2.0 * bb) if bb > 0 else 1.0
    return ca * a + cb * b


def _sum_scalars(backend, values: np.ndarray, rank: int, levels: int) -> np.ndarray:
    """Sum ``values`` over the ``2^levels`` ranks that differ from ``rank`` in the low ``levels`` bits.

    Every rank adds the same two partial sums at each step, so all get bitwise the same result.
    """
    total = values.copy()
    incoming = np.empty_like(total)
    for bit in range(levels):
        partner = rank ^ (1 << bit)
        backend.sendrecv(total, partner, incoming, partner)
        total = total + incoming if rank < partner else incoming + total
    return total


def adasum_allreduce(backend, buffer, rank: int, size: int) -> None:
    """Replace the 1-D floating-point ``buffer`` on every rank by the Adasum of all ranks' buffers."""
    if not is_power_of_two(size):
        raise ValueError(f"Adasum needs a power-of-two number of ranks, not {size}")
    if arrays.is_numpy(buffer):
        work = buffer.astype(np.float64)
    else:  # a tensor the backend moves as it is (tdist): the arithmetic runs on a float64 host copy
        import torch

        work = buffer.detach().to("cpu", torch.float64).numpy().copy()
    start, end = 0, work.size
    steps = []
    level = 0
    while (1 << level) < size:
        distance = 1 << level
        partner = rank ^ distance
        middle = start + (end - start) // 2
        lower = not rank & distance
        keep, give = ((start, middle), (middle, end)) if lower else ((middle, end), (start, middle))
        received = np.empty(keep[1] - keep[0], dtype=np.float64)
        backend.sendrecv(work[give[0]:give[1]], partner, received, partner)
        mine = work[keep[0]:keep[1]]
        left, right = (mine, received) if lower else (received, mine)
        partial = np.array([np.dot(left, right), np.dot(left, left), np.dot(right, right)])
        dots = _sum_scalars(backend, partial, rank, level + 1)
        work[keep[0]:keep[1]] = combine(left, right, tuple(dots))
        steps.append((partner, keep, give))
        start, end = keep
        level += 1
    for partner, keep, give in reversed(steps):
        backend.sendrecv(work[keep[0]:keep[1]], partner, work[give[0]:give[1]], partner)
    if arrays.is_numpy(buffer):
        buffer[...] = work.astype(buffer.dtype)
    else:
        buffer.copy_(torch.from_numpy(work))  # copy_ casts to the tensor's dtype and device


def reference(vectors: list) -> np.ndarray:
    """Adasum of ``vectors`` (one per rank, a power-of-two count) by the pairwise tree, in float64."""
    level = [np.asarray(v, dtype=np.float64) for v in vectors]
    while len(level) > 1:
        level = [combine(a, b, (np.dot(a, b), np.dot(a, a), np.dot(b, b))) for a, b in zip(level[::2], level[1::2])]
    return level[0]
