"""The few array operations the engine needs, on numpy arrays and on torch tensors alike.

The core moves numpy arrays; backends that run on PyTorch (``tdist``, CUDA-aware
MPI) also take torch tensors, CPU or CUDA, which then go through the engine
unconverted. The executors (``dataplane/executors.py``) ask these helpers, and
``scaling`` for prescale, postscale and Average, so that they stay
framework-neutral. torch is imported here only to make a tensor, which happens
only when the caller has imported it already.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from . import dtypes


def is_numpy(array: Any) -> bool:
    return isinstance(array, np.ndarray)


def device_of(array: Any) -> str:
    """``"cpu"`` for numpy arrays and CPU tensors, else the tensor's device type (``"cuda"``)."""
    return "cpu" if is_numpy(array) else array.device.type


def numel(array: Any) -> int:
    return array.size if is_numpy(array) else array.numel()


def address(array: Any) -> int:
    return array.ctypes.data if is_numpy(array) else array.data_ptr()


def same_address(first: Any, second: Any) -> bool:
    """Whether ``first`` and ``second`` start at the same address (an in-place collective). Two numpy arrays
    whose memory cannot overlap are told apart without asking for their addresses (microseconds each)."""
    if first is second:
        return True
    if is_numpy(first) and is_numpy(second) and first.size and second.size and not np.may_share_memory(first, second):
        return False
    return address(first) == address(second)


def dtype_name(array: Any) -> str:
    """hvps's name for the element type (``float32``, ``bfloat16``, ...)."""
    if is_numpy(array):
        return dtypes.SUPPORTED[array.dtype]
    return str(array.dtype).removeprefix("torch.")


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def empty(like: Any, shape: tuple) -> Any:
    """An uninitialised array of ``shape`` with ``like``'s kind, dtype and device."""
    if is_numpy(like):
        return np.empty(shape, dtype=like.dtype)
    return like.new_empty(shape)


def zeros(shape: tuple, dtype: str, device: str) -> Any:
    """Zeros of hvps dtype name ``dtype`` on ``device`` (numpy on the CPU)."""
    if device == "cpu":
        return np.zeros(shape, dtype=dtypes.BY_NAME[dtype])
    import torch

    return torch.zeros(shape, dtype=_torch_dtype(dtype), device=device)


def copy_of(array: Any) -> Any:
    return array.copy() if is_numpy(array) else array.clone()


def is_tensor(array: Any) -> bool:
    """Whether ``array`` is a torch tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(array, torch.Tensor)


def ready_event(items: list) -> Any:
    """For CUDA inputs: an event recorded now on the current stream (their producer), else None."""
    for array in items:
        if not is_numpy(array) and array.device.type == "cuda":
            import torch

            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(array.device))
            return event
    return None
