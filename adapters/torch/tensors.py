"""Zero-copy views between CPU torch tensors and the numpy buffers the core moves."""

from __future__ import annotations

import numpy as np
import torch

from hvps import dtypes

_TO_NUMPY = {
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
}


def check_dtype(tensor: torch.Tensor) -> None:
    """Raise TypeError for dtypes hvps cannot move."""
    if tensor.dtype not in _TO_NUMPY and tensor.dtype != torch.bfloat16:
        supported = ", ".join(str(d) for d in [*_TO_NUMPY, torch.bfloat16])
        raise TypeError(f"hvps does not support tensors of dtype {tensor.dtype}; supported: {supported}")


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor (bfloat16 via ml_dtypes), sharing memory."""
    check_dtype(tensor)
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(dtypes.bfloat16)
    return tensor.numpy()


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing memory with ``array``."""
    if array.dtype == dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """The contiguous CPU tensor the core can work on (the tensor itself when it already is one)."""
    if tensor.device.type != "cpu":
        return tensor.detach().to("cpu").contiguous()
    return tensor.detach().contiguous()
