"""What the core moves for a torch tensor: the tensor itself, a zero-copy numpy view, or a staged copy.

- Backends that take tensors of the tensor's device and dtype (``tdist``: gloo
  and NCCL; ``auto`` with NCCL; CUDA-aware MPI) get the tensor itself, so CUDA
  tensors stay on the GPU end to end.
- Other CPU tensors travel as numpy views of their memory (no copy).
- Other CUDA tensors are staged through pinned host memory (with a one-time warning).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch

import hvps
from hvps.core.views import as_array, as_tensor
from hvps.runtime import state as runtime

_TO_NUMPY = {
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
    torch.uint16: np.dtype(np.uint16),
    torch.bool: np.dtype(np.bool_),
}
#: hvps's dtype name for every torch dtype it moves
_NAMES = {**{dtype: np_dtype.name for dtype, np_dtype in _TO_NUMPY.items()}, torch.bfloat16: "bfloat16"}


def dtype_name(tensor: torch.Tensor) -> str:
    """hvps's name for ``tensor``'s dtype (``float32``, ``bfloat16``, ...); TypeError for dtypes hvps cannot move."""
    name = _NAMES.get(tensor.dtype)
    if name is None:
        supported = ", ".join(str(d) for d in _NAMES)
        raise TypeError(f"hvps does not support tensors of dtype {tensor.dtype}; supported: {supported}")
    return name


def check_dtype(tensor: torch.Tensor) -> None:
    """Raise TypeError for dtypes hvps cannot move."""
    dtype_name(tensor)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor (bfloat16 via ml_dtypes), sharing memory."""
    check_dtype(tensor)
    return as_array(tensor)


_warned_staging = False


def _warn_staging(tensor: torch.Tensor) -> None:
    global _warned_staging
    if not _warned_staging and hvps.rank() == 0:
        logging.getLogger("hvps").warning(
            "hvps: %s tensors are staged through pinned host memory: the %s backend cannot move them "
            "(MPI is not CUDA-aware here). Set HVPS_BACKEND=tdist or auto to keep them on the GPU with NCCL.",
            tensor.device.type, runtime.engine().backend.name)
    _warned_staging = True


def takes_tensor(tensor: torch.Tensor) -> bool:
    """Whether the running backend moves ``tensor`` as it is (no numpy view, no staging)."""
    return runtime.engine().backend.takes(tensor.device.type, dtype_name(tensor))


def host_buffer(tensor: torch.Tensor, ready: Optional[list] = None) -> torch.Tensor:
    """A contiguous CPU tensor with ``tensor``'s values: itself when it already is one, else pinned memory.

    With ``ready`` (a list), a CUDA tensor's copy is asynchronous: the event after which the pinned copy
    holds the values is appended to ``ready``, and whoever reads the copy on the host must synchronize
    with it first (the engine does, for ``Entry.host_ready``). Without, the copy blocks this thread.
    """
    if tensor.device.type == "cpu":
        return tensor.detach().contiguous()
    _warn_staging(tensor)
    staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
    if ready is None:
        staged.copy_(tensor.detach())  # waits for the copy: the engine reads it from the host
        return staged
    staged.copy_(tensor.detach(), non_blocking=True)  # queued behind the producer on its stream
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    ready.append(event)
    return staged


def core_buffer(tensor: torch.Tensor) -> tuple:
    """``(array, buffer)``: what the core moves for ``tensor``, and the tensor that shares its memory."""
    array, buffer, _ = core_view(tensor)
    return array, buffer


def core_view(tensor: torch.Tensor, ready: Optional[list] = None) -> tuple:
    """``(array, buffer, dtype name)``: :func:`core_buffer` and hvps's name for the dtype, checked once
    (``ready``: stage asynchronously, as :func:`host_buffer`)."""
    name = dtype_name(tensor)
    if runtime.engine().backend.takes(tensor.device.type, name):
        buffer = tensor if tensor.is_contiguous() and not tensor.requires_grad else tensor.detach().contiguous()
        return buffer, buffer, name
    buffer = host_buffer(tensor, ready)
    return as_array(buffer), buffer, name


def core_input(tensor: torch.Tensor) -> Any:
    """What the core moves for ``tensor`` (read-only use)."""
    return core_buffer(tensor)[0]


def from_core(result: Any, device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` holding a core result (numpy array or tensor)."""
    tensor = as_tensor(result)
    return tensor.to(device, non_blocking=True)
