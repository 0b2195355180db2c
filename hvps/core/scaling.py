"""Scaling in reductions, coded once: prescale, postscale, Average, Horovod's predivide factor and
the overflow guard of casts to half precision.

A reduction over ``size`` ranks computes ``postscale * op(prescale * x)``; Average is Sum followed
by a division by ``size``. The executors apply these in place to what the engine moves (numpy
arrays, torch tensors on tdist or CUDA-aware MPI): :func:`scale`, :func:`divide`,
:func:`prescaled`, :func:`finish`. The compression pipeline scales numpy arrays out of place
(:func:`scaled`). Adapters that run compression around a collective on their own tensors plan the
steps with :func:`sum_plan` and apply them through their framework's :class:`TensorOps`
(:func:`scale_all`, :func:`averaged`). torch is never imported here.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Protocol

import numpy as np

from . import arrays
from .dtypes import ReduceOp, bfloat16

_HALVES = (np.dtype(np.float16), bfloat16)
_BOOL_FACTORS = "prescale/postscale factors are not defined for bool tensors"


# -- in place, on what the engine moves (numpy arrays, torch tensors) --------------------------------
def scale(array: Any, factor: float) -> None:
    """Multiply ``array`` by ``factor`` in place. Integers go through float64 and truncate toward
    zero; float16 and bfloat16 compute in float32; bool raises TypeError."""
    if factor == 1.0 or arrays.numel(array) == 0:
        return
    if arrays.is_numpy(array):
        if array.dtype == np.bool_:
            raise TypeError(_BOOL_FACTORS)
        if np.issubdtype(array.dtype, np.integer):
            array[...] = (array * factor).astype(array.dtype)
        elif array.dtype in _HALVES:
            array[...] = (array.astype(np.float32) * np.float32(factor)).astype(array.dtype)
        else:
            np.multiply(array, array.dtype.type(factor), out=array)
    elif array.dtype.is_floating_point and (array.element_size() > 2 or array.is_cuda):
        array.mul_(factor)  # CUDA computes half types in float32 inside the kernel: no float32 temporary
    elif array.dtype.is_floating_point:
        array.copy_(array.float() * factor)
    elif str(array.dtype) == "torch.bool":
        raise TypeError(_BOOL_FACTORS)
    else:
        array.copy_((array.double() * factor).trunc())


def divide(array: Any, divisor: int) -> None:
    """Average's last step in place: integers divide rounding toward zero (as Horovod's scaling by
    1/size casts), float16 and bfloat16 divide in float32, other floats exactly."""
    if divisor == 1 or arrays.numel(array) == 0:
        return
    if not arrays.is_numpy(array):
        if array.dtype.is_floating_point and (array.element_size() > 2 or array.is_cuda):
            array.div_(divisor)  # on CUDA half types divide in float32 inside the kernel
        elif array.dtype.is_floating_point:
            array.copy_(array.float() / divisor)
        else:
            array.div_(divisor, rounding_mode="trunc")
    elif np.issubdtype(array.dtype, np.integer):
        negative = array < 0
        np.abs(array, out=array)
        np.floor_divide(array, divisor, out=array)
        np.negative(array, out=array, where=negative)
    elif array.dtype in _HALVES:
        array[...] = (array.astype(np.float32) / np.float32(divisor)).astype(array.dtype)
    else:
        np.divide(array, array.dtype.type(divisor), out=array)


def prescaled(src: Any, factor: float, out: Any = None) -> Any:
    """What a reduction sends: ``src`` itself when ``factor`` is 1, else ``factor * src`` in ``out``
    (a copy of ``src`` when ``out`` is None); ``src`` is never changed unless it is ``out``."""
    if factor == 1.0:
        return src
    if out is None:
        out = arrays.copy_of(src)
    elif out is not src:
        out[...] = src
    scale(out, factor)
    return out


def wire_op(op: ReduceOp) -> ReduceOp:
    """The op the backend runs: Average travels as Sum (:func:`finish` divides)."""
    return ReduceOp.Sum if op is ReduceOp.Average else op


def finish(array: Any, op: ReduceOp, size: int, postscale: float) -> None:
    """After the collective, in place: Average divides the sum by ``size``, then ``postscale`` applies."""
    if op is ReduceOp.Average:
        divide(array, size)
    scale(array, postscale)


# -- out of place, numpy ----------------------------------------------------------------------------
def scaled(array: np.ndarray, factor: float) -> np.ndarray:
    """``array * factor`` in ``array``'s dtype, multiplied in float64 for float64 arrays (a float32
    factor such as 1/3 would cost them their precision) and in float32 for the others."""
    wide = np.float64 if array.dtype == np.float64 else np.float32
    return (array * np.asarray(factor, dtype=wide)).astype(array.dtype, copy=False)


# -- Horovod's gradient_predivide_factor ------------------------------------------------------------
def predivide_factors(op: ReduceOp, factor: float) -> tuple:
    """``(prescale, postscale)`` for Horovod's ``gradient_predivide_factor`` ``factor``: ``(1/f, f)``
    with ``op`` Average, whose division by the set size makes the postscale ``f/size`` in effect;
    ``(1.0, 1.0)`` when ``factor`` is 1. ValueError for another factor with another op."""
    if factor == 1.0:
        return 1.0, 1.0
    if op is not ReduceOp.Average:
        raise ValueError("gradient_predivide_factor is only defined for op=Average")
    return 1.0 / factor, factor


# -- the overflow guard -----------------------------------------------------------------------------
def overflow_guard(size: int) -> float:
    """The factor a cast to float16 or bfloat16 applies before an averaging sum over ``size`` ranks,
    so that the sum cannot overflow where the average would not: ``1/size``."""
    return 1.0 / size


class SumPlan(NamedTuple):
    """Scale by ``before``, (compress,) reduce with ``op``/``prescale``/``postscale``, (decompress,)
    scale by ``after``; a factor of 1.0 skips its step."""

    before: float
    op: ReduceOp
    prescale: float
    postscale: float
    after: float


def sum_plan(op: ReduceOp, size: Callable[[], int], guard: Optional[Callable[[int], float]] = None,
             prescale: float = 1.0, postscale: float = 1.0, collective_averages: bool = True) -> SumPlan:
    """How to reduce with ``op`` over ``size()`` ranks, with the caller's ``prescale``/``postscale``.

    ``guard(size)`` is the factor to apply before the sum when averaging (:func:`overflow_guard` for
    casts; 1.0 or None for none); ``collective_averages`` says whether the collective can divide by
    the size itself. Where it cannot, or a guard applies, the collective sums and the division moves
    to ``after``, the caller's prescale joins ``before`` and its postscale ``after``, so the result
    is ``postscale * sum(prescale * x) / size`` either way. ``size`` is called only then, so that a
    collective's own checks of its process set come first otherwise.
    """
    if op is not ReduceOp.Average or (guard is None and collective_averages):
        return SumPlan(1.0, op, prescale, postscale, 1.0)
    ranks = size()
    factor = 1.0 if guard is None else guard(ranks)
    if factor == 1.0 and collective_averages:
        return SumPlan(1.0, op, prescale, postscale, 1.0)
    return SumPlan(factor * prescale, ReduceOp.Sum, 1.0, 1.0, postscale * (1.0 / ranks) / factor)


def gradient_factor(op: ReduceOp, size: int, prescale: float, postscale: float) -> float:
    """The factor on a reducescatter's gathered output gradients (Horovod's): the forward pass's
    scaling, times ``size`` for Sum (every member's contribution counts)."""
    return prescale * postscale * (size if op is ReduceOp.Sum else 1)


# -- framework tensors ------------------------------------------------------------------------------
class TensorOps(Protocol):
    """What scaling needs from a framework's tensors (the adapters' ``OPS``)."""

    def is_floating(self, tensor: Any) -> bool: ...

    def scale(self, tensor: Any, factor: float) -> Any:
        """``tensor * factor`` in ``tensor``'s dtype (differentiable)."""

    def divide(self, tensor: Any, divisor: int) -> Any:
        """``tensor / divisor`` (differentiable)."""


def scale_all(tensors: list, factor: float, ops: TensorOps) -> list:
    """Each tensor times ``factor`` (the tensors themselves when ``factor`` is 1)."""
    return tensors if factor == 1.0 else [ops.scale(t, factor) for t in tensors]


def averaged(tensor: Any, op: ReduceOp, size: int, ops: TensorOps) -> Any:
    """``tensor``, the sum of ``size`` members' contributions (such as a sparse tensor's allgathered
    values), divided by ``size`` under Average; as it is otherwise."""
    return ops.divide(tensor, size) if op is ReduceOp.Average else tensor
