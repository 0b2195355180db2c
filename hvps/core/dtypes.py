"""Supported element types and the reduction arithmetic shared by every backend."""

from __future__ import annotations

import enum
import functools
import sys

import ml_dtypes
import numpy as np

from .views import as_tensor

bfloat16 = np.dtype(ml_dtypes.bfloat16)

SUPPORTED = {
    np.dtype(np.float16): "float16",
    bfloat16: "bfloat16",
    np.dtype(np.float32): "float32",
    np.dtype(np.float64): "float64",
    np.dtype(np.int8): "int8",
    np.dtype(np.int16): "int16",
    np.dtype(np.int32): "int32",
    np.dtype(np.int64): "int64",
    np.dtype(np.uint8): "uint8",
    np.dtype(np.uint16): "uint16",
    np.dtype(np.bool_): "bool",
}

ITEMSIZE = {name: dtype.itemsize for dtype, name in SUPPORTED.items()}
BY_NAME = {name: dtype for dtype, name in SUPPORTED.items()}


class ReduceOp(enum.Enum):
    """Reduction applied by allreduce and reducescatter (Horovod's names)."""

    Average = "average"
    Sum = "sum"
    Min = "min"
    Max = "max"
    Product = "product"
    #: Adaptive summation (Maleki et al., MLSys 2021); floating-point allreduce only, see ``adasum.py``
    Adasum = "adasum"


#: every op by its value (a request's ``op``): a dict look-up, where ``ReduceOp(value)`` costs a call per collective
OPS_BY_VALUE = {op.value: op for op in ReduceOp}

_UFUNC = {
    ReduceOp.Sum: np.add,
    ReduceOp.Average: np.add,
    ReduceOp.Min: np.minimum,
    ReduceOp.Max: np.maximum,
    ReduceOp.Product: np.multiply,
}
_BOOL_UFUNC = {
    ReduceOp.Sum: np.logical_or,
    ReduceOp.Max: np.logical_or,
    ReduceOp.Min: np.logical_and,
    ReduceOp.Product: np.logical_and,
}


def check_dtype(dtype: np.dtype) -> np.dtype:
    """Return ``dtype`` if hvps can move it, else raise TypeError."""
    dtype = np.dtype(dtype)
    if dtype not in SUPPORTED:
        names = ", ".join(SUPPORTED.values())
        raise TypeError(f"hvps does not support dtype {dtype}; supported: {names}")
    return dtype


def check_reducible(dtype: np.dtype, op: ReduceOp) -> None:
    """Raise TypeError where ``op`` makes no sense for ``dtype``."""
    check_dtype(dtype)
    if dtype == np.bool_ and op is ReduceOp.Average:
        raise TypeError("Average is not defined for bool tensors; use Sum (logical or) or Min (logical and)")
    if op is ReduceOp.Adasum and dtype.kind != "f" and dtype != bfloat16:
        raise TypeError(f"Adasum combines floating-point tensors only, not {SUPPORTED[dtype]}")


def quiet_arithmetic() -> np.errstate:
    """A context in which numpy's floating-point overflow and invalid results (inf, NaN) pass without a warning, as
    in MPI's, gloo's and NCCL's reductions: an inf in the gradients is the data's (a loss scaler looks for it), not
    hvps's to warn about, and the warning would point into hvps. ~1 µs.

    Returns:
        The context manager (a new one each time: numpy's cannot be entered twice).
    """
    return np.errstate(over="ignore", invalid="ignore")


def combine(op: ReduceOp, dtype: np.dtype):
    """``f(a, b, out=)``: folds two contributions of ``dtype`` under ``op``, elementwise.

    numpy's float16 and bfloat16 loops are scalar and about 10x slower than
    float32; when PyTorch is already loaded its vectorised kernels do those.
    """
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return _BOOL_UFUNC[op]
    if dtype in (np.float16, bfloat16) and "torch" in sys.modules:
        return functools.partial(_torch_half, _TORCH_FUNC[op])
    return _UFUNC[op]


_TORCH_FUNC = {
    ReduceOp.Sum: "add",
    ReduceOp.Average: "add",
    ReduceOp.Min: "minimum",
    ReduceOp.Max: "maximum",
    ReduceOp.Product: "mul",
}


def cast(array: np.ndarray, dtype) -> np.ndarray:
    """``array.astype(dtype)``; casts to or from float16/bfloat16 use PyTorch's kernels when it is loaded.

    numpy's half-precision casts are scalar loops, 10-20x slower.
    """
    dtype = np.dtype(dtype)
    if array.dtype == dtype:
        return array
    halves = (np.dtype(np.float16), bfloat16)
    # Only float32 <-> half: torch rounds float64 -> half through float32 (twice), numpy once.
    fast = {array.dtype, dtype} <= {np.dtype(np.float32), *halves} and {array.dtype, dtype} & set(halves)
    if "torch" not in sys.modules or not fast:
        return array.astype(dtype)
    out = np.empty(array.shape, dtype=dtype)
    as_tensor(out).copy_(as_tensor(np.ascontiguousarray(array).reshape(array.shape)))  # keeps 0-d 0-d
    return out


def _torch_half(func: str, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    import torch

    getattr(torch, func)(as_tensor(a), as_tensor(b), out=as_tensor(out))
