"""Reusable memory for the data plane."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.arrays import is_numpy


class FusionBuffer:
    """A flat byte buffer per device, grown on demand and kept, viewed as any dtype.

    Reusing it saves the page faults (or device allocations) that fresh memory
    costs on every collective. Device buffers live on the device: packing and
    unpacking never leave it.
    """

    def __init__(self) -> None:
        self._bytes = np.empty(0, dtype=np.uint8)
        self._device_bytes: dict = {}

    def view(self, dtype, count: int) -> np.ndarray:
        """``count`` elements of ``dtype`` in host memory (contents undefined)."""
        dtype = np.dtype(dtype)
        need = count * dtype.itemsize
        if self._bytes.size < need:
            self._bytes = np.empty(need, dtype=np.uint8)
        return self._bytes[:need].view(dtype)

    def like(self, array: Any, count: int) -> Any:
        """``count`` elements of ``array``'s dtype, where ``array`` lives (numpy or a torch tensor)."""
        if is_numpy(array):
            return self.view(array.dtype, count)
        import torch

        need = count * array.element_size()
        key = str(array.device)
        buffer = self._device_bytes.get(key)
        if buffer is None or buffer.numel() < need:
            buffer = self._device_bytes[key] = torch.empty(need, dtype=torch.uint8, device=array.device)
        return buffer[:need].view(array.dtype)
