"""GRACE's three parts: a Compressor, a Memory (error feedback) and a Communicator.

Everything works on flat numpy arrays, so every framework adapter shares it.
A compressor holds only hyper-parameters; state keyed by tensor name lives in
a Memory (or in a compressor's explicit state object) and can be saved.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from ..core.handle import Handle


class Compressor(abc.ABC):
    """Turns one gradient into payloads that travel, and back."""

    #: payloads of different ranks may be summed elementwise (allreduce); else allgathered
    summable: bool = False

    @abc.abstractmethod
    def compress(self, array: np.ndarray, name: str) -> tuple:
        """Return ``(payloads, ctx)``: a list of arrays to send and what decompress needs (never sent)."""

    @abc.abstractmethod
    def decompress(self, payloads: list, ctx: Any) -> np.ndarray:
        """Rebuild a dense array from ``payloads`` (one rank's, or a sum of them if summable)."""

    def aggregate(self, gathered: list, ctx: Any, size: int) -> np.ndarray:
        """Sum of all ranks' decompressed gradients, from the rank-ordered concatenation of each payload.

        The default splits each payload evenly by rank; sparse compressors override it.
        """
        parts = [np.split(p, size) for p in gathered]
        total = self.decompress([part[0] for part in parts], ctx).astype(ctx.dtype, copy=True)
        for rank in range(1, size):
            total += self.decompress([part[rank] for part in parts], ctx)
        return total

    def residual(self, compensated: np.ndarray, payloads: list, ctx: Any) -> np.ndarray:
        """``compensated - decompress(payloads, ctx)``: what this compression dropped.

        May reuse ``compensated``'s memory (error feedback owns that copy).
        """
        return compensated - self.decompress(payloads, ctx)

    def prescale(self, size: int) -> float:
        """Factor applied before ``compress`` when averaging (casts: ``scaling.overflow_guard``)."""
        return 1.0

    def check(self, array: np.ndarray) -> None:
        """Raise TypeError for arrays this compressor cannot handle (integers, for the lossy ones)."""
        if not np.issubdtype(array.dtype, np.floating) and array.dtype.name != "bfloat16":
            raise TypeError(f"{type(self).__name__} compresses floating-point gradients only, not {array.dtype}")


class Memory(abc.ABC):
    """Error feedback: what compression dropped, added back next time."""

    @abc.abstractmethod
    def compensate(self, array: np.ndarray, name: str) -> np.ndarray:
        """The gradient to compress: ``array`` plus what was left behind before."""

    @abc.abstractmethod
    def update(self, compensated: np.ndarray, name: str, compressor: Compressor, payloads: list, ctx: Any) -> None:
        """Remember what this step's compression dropped from ``compensated``."""

    def forget(self, name: str) -> None:
        """Drop what is kept for ``name`` (its next step starts with nothing left behind)."""

    def state_dict(self) -> dict:
        """Arrays keyed ``"<kind>/<tensor name>"``, for checkpoints."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""


class Communicator(abc.ABC):
    """Moves payloads between ranks: allreduce when summable, allgather otherwise."""

    #: whether ``start(..., average=True)`` already averages (else the caller divides)
    averages: bool = False

    @abc.abstractmethod
    def start(self, payloads: list, name: str, average: bool) -> Handle:
        """Start the exchange asynchronously; the handle yields the list of what arrived."""

    @abc.abstractmethod
    def rebuild(self, compressor: Compressor, received: list, ctx: Any) -> np.ndarray:
        """The dense result from what arrived."""

    @abc.abstractmethod
    def wire_bytes(self, payloads: list, size: int) -> tuple:
        """``(sent, received)`` bytes of this rank for one exchange of ``payloads``."""

    def received_bytes(self, received: list, own_bytes: int, size: int) -> Any:
        """Bytes this rank actually received, from what arrived (``own_bytes``: its own
        payloads); None where ``wire_bytes``'s count is exact already."""
        return None
