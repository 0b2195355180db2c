"""Choosing the k largest magnitudes: exact, or by a threshold estimated from a sample (DGC)."""

from __future__ import annotations

import numpy as np


def exact_topk(magnitudes: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest ``magnitudes`` (unordered), by introselect."""
    n = magnitudes.size
    if k >= n:
        return np.arange(n, dtype=np.int64)
    return np.argpartition(magnitudes, n - k)[n - k :]


def sampled_topk(magnitudes: np.ndarray, k: int, sample_size: int = 65536, rng: np.random.Generator = None,
                 low: float = 0.8, high: float = 1.3, max_refinements: int = 4) -> np.ndarray:
    """Indices of about ``k`` (never more than k) of the largest ``magnitudes``.

    Estimates the threshold from a strided sample (Lin et al., DGC, ICLR 2018),
    adjusts it until between ``low*k`` and ``high*k`` elements pass, then trims
    the candidates to exactly ``k`` by an exact selection over them alone.
    """
    n = magnitudes.size
    if k >= n or n <= sample_size:
        return exact_topk(magnitudes, k)
    stride = n // sample_size
    start = int(rng.integers(stride)) if rng is not None else 0
    sample = magnitudes[start::stride]
    keep = max(1, int(round(k * sample.size / n)))
    threshold = np.partition(sample, sample.size - keep)[sample.size - keep]
    candidates = np.flatnonzero(magnitudes >= threshold)
    for _ in range(max_refinements):
        if low * k <= candidates.size <= high * k:
            break
        # Re-estimate among the sample with the observed miss ratio.
        keep = int(np.clip(keep * k / max(candidates.size, 1), 1, sample.size))
        threshold = np.partition(sample, sample.size - keep)[sample.size - keep]
        candidates = np.flatnonzero(magnitudes >= threshold)
    if candidates.size > k:
        candidates = candidates[exact_topk(magnitudes[candidates], k)]
    elif candidates.size < low * k:
        return exact_topk(magnitudes, k)
    return candidates
