"""Horovod's ``average`` / ``op`` arguments of a reduction, resolved to one ReduceOp."""

from __future__ import annotations

from typing import Any, Optional

from hvps import ReduceOp
from hvps.api.collectives import _as_op


def resolve_op(average: Optional[bool], op: Any) -> ReduceOp:
    """Horovod's ``average`` (deprecated) / ``op`` pair as one ReduceOp (default Average).

    ValueError when both are given, or for an ``op`` that names no ReduceOp.
    """
    if average is not None and op is not None:
        raise ValueError("give either average (deprecated) or op, not both")
    if op is not None:
        return _as_op(op)
    return ReduceOp.Sum if average is False else ReduceOp.Average
