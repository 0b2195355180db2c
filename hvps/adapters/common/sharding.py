"""What every sharded front end checks the same way (torch's ``ShardedOptimizer`` and ``fully_shard``, Keras's
``ShardedOptimizer``): which reduction a shard can take, and that every rank lays out the same tensors before
the first collective (one allgather; ``HvpsError`` naming the first tensor that differs and the two ranks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import hvps
from hvps import HvpsError, ReduceOp

from .ops import resolve_op

__all__ = ["REDUCE_SCATTERS_IN_FLIGHT", "Signature", "check_same_everywhere", "sharded_op"]

#: gradient reduce-scatters a sharded front end keeps in flight during backward: a started one holds its flat,
#: full-size gradient until it is waited for, so without a bound a rank whose reductions lag its backward holds
#: the whole gradient at the end of backward (stage 1's peak, not stage 2's or 3's). Starting one more first
#: waits for the oldest, before packing the new flat gradient (so the oldest's goes first); every rank started
#: that one unless the ranks' gradients become ready in very different orders, which then ends in the stall error
#: naming the bucket, not in a silent hang. Measured at 2 ranks on a 101M-parameter transformer stack
#: (benchmarks/sharded_memory_cap.py, 2026-12-06, waiting after packing): stage 3's training peak RSS
#: 1,453 / 1,518 / 1,651 MiB with 1 / 2 / 4 in flight, step times alike within noise; 2 keeps one reduction
#: overlapping the next unit's backward. Waiting before packing took one unit-sized buffer off stage 3's peak at
#: 231M parameters (2,914 -> 2,803 MiB, 2026-12-07), step time unchanged.
REDUCE_SCATTERS_IN_FLIGHT = 2


def sharded_op(op: Any, what: str) -> ReduceOp:
    """``op`` resolved, when gradients can be reduce-scattered with it (Average or Sum).

    Args:
        op: the op the user gave (Horovod's names or ``ReduceOp``).
        what: the front end, for the message (``"a sharded optimizer"``, ``"fully_shard"``).

    Returns:
        The resolved op.

    Raises:
        ValueError: Adasum (it combines whole updates, a shard holds part of each) or any op but Average/Sum.
    """
    op = resolve_op(None, op)
    if op is ReduceOp.Adasum:
        raise ValueError(f"op=Adasum with {what} is not supported: Adasum combines whole parameter updates, a "
                         "shard holds only part of each")
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(f"op={op.name} with {what} is not supported: gradients are reduce-scattered with "
                         "Average or Sum")
    return op


@dataclass(frozen=True)
class Signature:
    """One tensor as the ranks compare it: ``name`` is reported, and compared only when names are the same on
    every rank (torch's parameter names; not Keras's, which numbers layers per process)."""

    name: str
    shape: tuple
    dtype: str
    trainable: bool = True
    #: the ``fully_shard`` unit holding it (None: no units)
    unit: Optional[str] = None

    def describe(self) -> str:
        """The tensor in words, for the error."""
        frozen = "" if self.trainable else " (frozen)"
        unit = "" if self.unit is None else f" in unit {self.unit!r}"
        return f"{self.name!r} shape {list(self.shape)} {self.dtype}{frozen}{unit}"


def check_same_everywhere(mine: Sequence[Signature], label: str, what: str, kind: str, fix: str,
                          process_set: Any, compare_names: bool = True) -> None:
    """One allgather of every rank's signatures; the first difference is raised on every rank alike.

    Args:
        mine: this rank's tensors, in the order they will be sharded.
        label: the allgather's name.
        what: the front end, first in the message.
        kind: what a tensor is called there (``"parameter"``, ``"variable"``).
        fix: what the user should do, last in the message.
        process_set: the ranks that shard together.
        compare_names: compare names too (False: only shape, dtype, trainable and unit).

    Raises:
        HvpsError: ``"<what>: <kind> <i> ('<name>') differs across ranks: rank A has ..., rank B has ...; <fix>"``.
    """
    everyone = hvps.allgather_object(list(mine), name=label, process_set=process_set)
    ranks = process_set.ranks
    reference = everyone[0]

    def same(a: Optional[Signature], b: Optional[Signature]) -> bool:
        if a is None or b is None:
            return a is b
        return a == b if compare_names else (a.shape, a.dtype, a.trainable, a.unit) == (b.shape, b.dtype,
                                                                                           b.trainable, b.unit)

    for member, theirs in enumerate(everyone[1:], start=1):
        for i in range(max(len(reference), len(theirs))):
            a = reference[i] if i < len(reference) else None
            b = theirs[i] if i < len(theirs) else None
            if not same(a, b):
                named = (a or b).name
                raise HvpsError(
                    f"{what}: {kind} {i} ({named!r}) differs across ranks: rank {ranks[0]} has "
                    f"{a.describe() if a else f'no such {kind}'}, rank {ranks[member]} has "
                    f"{b.describe() if b else f'no such {kind}'}; {fix}")
