"""The checks every gradient wrapper (torch and Keras ``DistributedOptimizer``,
``DistributedGradientTape``) makes of its arguments, before anything is submitted."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

from hvps import ReduceOp
from hvps.compression import GradientCompression
from hvps.core import scaling

from .ops import resolve_op

#: the ops a compressed exchange (int8, top-k, DGC) can reduce with
COMPRESSED_OPS = (ReduceOp.Average, ReduceOp.Sum)


class GradientOptions(NamedTuple):
    """What the checked arguments come to: the op, the compression pipeline, and the prescale and
    postscale of Horovod's ``gradient_predivide_factor`` (``scaling.predivide_factors``)."""

    op: ReduceOp
    compression: GradientCompression
    prescale: float
    postscale: float


def check_backward_passes(backward_passes_per_step: int) -> None:
    """ValueError unless at least one backward pass makes a step."""
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1")


def _names(ops: Sequence[ReduceOp]) -> str:
    names = [o.name for o in ops]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def gradient_options(op: Any, gradient_predivide_factor: float, compression: Any,
                     as_compression: Callable[[Any], GradientCompression], *, backward_passes_per_step: int = 1,
                     ops: Optional[Sequence[ReduceOp]] = None, compressed_ops: Sequence[ReduceOp] = COMPRESSED_OPS,
                     fusable: Optional[Callable[[GradientCompression], bool]] = None) -> GradientOptions:
    """Check a gradient wrapper's arguments and resolve them.

    ``as_compression`` is the adapter's conversion of ``compression=`` (TypeError for anything
    else). ValueError for ``backward_passes_per_step`` < 1, an op outside ``ops`` (when given), a
    predivide factor with another op than Average, or a compression that is not ``fusable``
    (default: not summable) with an op outside ``compressed_ops``.
    """
    check_backward_passes(backward_passes_per_step)
    op = resolve_op(None, op)
    if ops is not None and op not in ops:
        raise ValueError(f"DistributedOptimizer reduces gradients with {_names(ops)}, not {op}")
    prescale, postscale = scaling.predivide_factors(op, gradient_predivide_factor)
    pipeline = as_compression(compression)
    fused = pipeline.summable if fusable is None else fusable(pipeline)
    if not fused and op not in compressed_ops:
        raise ValueError(f"{pipeline!r} reduces gradients with {_names(compressed_ops)} only, not {op.name}")
    return GradientOptions(op, pipeline, prescale, postscale)
