"""Zero-copy views between numpy arrays and torch tensors.

numpy has no bfloat16 or float8; ml_dtypes gives numpy those types, and torch cannot read them.
This module is the one place that knows it: such tensors travel through a same-width integer
(``view(torch.int16)`` for bfloat16, ``view(torch.uint8)`` for float8), in both directions.
torch is imported only when a view is made.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import ml_dtypes
import numpy as np

#: torch dtype name -> (ml_dtypes name, integer carrier of the same width)
_CARRIED = {
    "bfloat16": ("bfloat16", np.int16),
    "float8_e4m3fn": ("float8_e4m3fn", np.uint8),
    "float8_e5m2": ("float8_e5m2", np.uint8),
}


@functools.lru_cache(maxsize=None)
def _tables() -> tuple:
    """({torch dtype: (numpy dtype, torch carrier)}, {numpy dtype: (torch dtype, numpy carrier)})."""
    import torch

    to_numpy, to_torch = {}, {}
    for torch_name, (ml_name, carrier) in _CARRIED.items():
        kind = getattr(torch, torch_name, None)
        if kind is None:
            continue
        numpy_dtype = np.dtype(getattr(ml_dtypes, ml_name))
        to_numpy[kind] = (numpy_dtype, torch.from_numpy(np.empty(0, carrier)).dtype)
        to_torch[numpy_dtype] = (kind, np.dtype(carrier))
    return to_numpy, to_torch


def as_tensor(array: Any) -> Any:
    """A torch tensor sharing memory with a numpy ``array``; a tensor is returned as it is.

    A read-only array (a send buffer: pickled bytes, a user's read-only input) gives a tensor that hvps only
    reads, so torch's warning that the tensor would be writable is not shown to the user."""
    if not isinstance(array, np.ndarray):
        return array
    if not array.flags.writeable:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
            return _shared_tensor(array)
    return _shared_tensor(array)


def _shared_tensor(array: np.ndarray) -> Any:
    import torch

    carried = _tables()[1].get(array.dtype)  # by the dtype itself: numpy computes its name in Python
    if carried is None:
        return torch.from_numpy(array)
    kind, carrier = carried
    return torch.from_numpy(array.view(carrier)).view(kind)


def as_array(tensor: Any) -> np.ndarray:
    """A numpy view of a CPU tensor's memory (bfloat16 and float8 as ml_dtypes arrays).

    Raises TypeError for dtypes neither numpy nor ml_dtypes can hold (complex32, quantized, ...).
    """
    tensor = tensor.detach()
    carried = _tables()[0].get(tensor.dtype)
    if carried is None:
        return tensor.numpy()
    numpy_dtype, carrier = carried
    return tensor.view(carrier).numpy().view(numpy_dtype)


class _Memory:
    """A CPU tensor's memory as numpy sees it (``__array_interface__``); holding it keeps the tensor alive."""

    def __init__(self, tensor: Any, dtype: np.dtype) -> None:
        self.tensor = tensor
        self.__array_interface__ = {"data": (tensor.data_ptr(), False), "shape": tuple(tensor.shape),
                                    "typestr": dtype.str, "version": 3}


def resizable_view(tensor: Any) -> np.ndarray:
    """:func:`as_array` for a contiguous CPU tensor whose storage is resized later (freed and allocated
    again): torch's ``numpy()`` marks a storage fixed-size for good, this view does not. The array keeps the
    tensor alive; resizing the storage while the array is in use leaves it pointing at freed memory.

    Raises:
        ValueError: the tensor is not contiguous or not on the CPU.
    """
    tensor = tensor.detach()
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("resizable_view takes a contiguous CPU tensor")
    name = str(tensor.dtype).removeprefix("torch.")
    if name in _CARRIED:
        ml_name, carrier = _CARRIED[name]
        return np.asarray(_Memory(tensor, np.dtype(carrier))).view(getattr(ml_dtypes, ml_name))
    return np.asarray(_Memory(tensor, _numpy_dtype(tensor.dtype)))


@functools.lru_cache(maxsize=None)
def _numpy_dtype(kind: Any) -> np.dtype:
    import torch

    return torch.empty(0, dtype=kind).numpy().dtype
