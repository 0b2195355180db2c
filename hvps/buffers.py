"""Reusable memory for the data plane."""

from __future__ import annotations

import numpy as np


class FusionBuffer:
    """A flat byte buffer, grown on demand and kept, viewed as any dtype.

    Reusing it saves the page faults that fresh memory costs on every collective.
    """

    def __init__(self) -> None:
        self._bytes = np.empty(0, dtype=np.uint8)

    def view(self, dtype, count: int) -> np.ndarray:
        """``count`` elements of ``dtype`` (contents undefined)."""
        dtype = np.dtype(dtype)
        need = count * dtype.itemsize
        if self._bytes.size < need:
            self._bytes = np.empty(need, dtype=np.uint8)
        return self._bytes[:need].view(dtype)
