"""Exchanging payloads: allreduce for summable compressors, allgather for the rest."""

from __future__ import annotations

from ..api import collectives as ops
from .base import Communicator, Compressor


def bus_factor(size: int) -> float:
    """The share of a buffer a ring allreduce sends (and receives) on every rank: 2(n-1)/n."""
    return 2.0 * (size - 1) / size if size > 1 else 0.0


class Allreduce(Communicator):
    """Sums (or averages) payloads elementwise across ranks, in place; fuses with other allreduces."""

    averages = True

    def start(self, payloads, name, average):
        op = ops.Average if average else ops.Sum
        return ops.GroupHandle.of(name, [ops.allreduce_async(p, op=op, name=f"{name}.{i}", out=p)
                                         for i, p in enumerate(payloads)])

    def rebuild(self, compressor: Compressor, received, ctx):
        return compressor.decompress(received, ctx)

    def wire_bytes(self, payloads, size):
        moved = int(sum(p.nbytes for p in payloads) * bus_factor(size))
        return moved, moved


class Allgather(Communicator):
    """Concatenates every rank's payloads, then the compressor aggregates them."""

    def __init__(self, size: int) -> None:
        self.size = size

    def start(self, payloads, name, average):
        return ops.GroupHandle.of(name, [ops.allgather_async(p.reshape(-1), name=f"{name}.{i}")
                                         for i, p in enumerate(payloads)])

    def rebuild(self, compressor: Compressor, received, ctx):
        return compressor.aggregate(received, ctx, self.size)

    def wire_bytes(self, payloads, size):
        # Each rank's payload reaches the n-1 others; the receive side is an estimate
        # (equal sizes) until ``received_bytes`` counts what arrived.
        own = sum(p.nbytes for p in payloads)
        return own * (size - 1), own * (size - 1)

    def received_bytes(self, received, own_bytes, size):
        # Every rank's payloads arrive concatenated, this rank's own included; their sizes
        # may differ by rank (sampled top-k sends between 0.8k and k entries).
        return sum(r.nbytes for r in received) - own_bytes


def choose(compressor: Compressor, size: int) -> Communicator:
    """Allreduce when the compressor's payloads are summable, else allgather."""
    return Allreduce() if compressor.summable else Allgather(size)


__all__ = ["Allreduce", "Allgather", "choose"]
