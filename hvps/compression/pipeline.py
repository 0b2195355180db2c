"""``GradientCompression``: one compressor, its memory and communicator, with accounting."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

from ..core import scaling
from ..core.dtypes import ReduceOp
from ..core.handle import Handle
from ..runtime import state as runtime
from .base import Communicator, Compressor, Memory
from .communicators import bus_factor, choose
from .memory import NoMemory


@dataclass
class CompressionStats:
    """What compression cost and saved since the last ``reset()``, for this rank."""

    exchanges: int = 0
    dense_bytes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    compress_seconds: float = 0.0
    decompress_seconds: float = 0.0

    @property
    def ratio(self) -> float:
        """Dense bytes a ring allreduce would move over the bytes actually sent."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else 1.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "ratio": self.ratio}

    def reset(self) -> None:
        self.__init__()


class GradientCompression:
    """Compress, exchange and rebuild gradients; ``Compression.topk(0.01)`` and friends build these.

    ``start(array, name)`` compresses (with error feedback) and starts the
    exchange; its handle's ``wait()`` returns the sum or average over ranks.
    """

    def __init__(self, name: str, compressor: Compressor, memory: Optional[Memory] = None,
                 communicator: Optional[Communicator] = None, schedule=None) -> None:
        self.name = name
        self.compressor = compressor
        self.memory = memory or NoMemory()
        self._communicator = communicator
        self.schedule = schedule
        self.stats = CompressionStats()

    @property
    def summable(self) -> bool:
        """Whether the payloads are summed by allreduce (and so fuse with other gradients)."""
        return self.compressor.summable

    def communicator(self) -> Communicator:
        if self._communicator is None:
            self._communicator = choose(self.compressor, runtime.size())
        return self._communicator

    def prepare(self, shapes: Mapping[str, tuple]) -> None:
        """Called once by an optimizer with the shapes of the gradients it will send, keyed by the
        names it will send them under: a compression may reject them early (PowerSGD's rank)."""

    def set_epoch(self, epoch: int) -> None:
        """Apply the density schedule (DGC warm-up) for ``epoch``."""
        if self.schedule is not None:
            self.compressor.density = self.schedule.at(epoch)

    def start(self, array: np.ndarray, name: str, op: ReduceOp = ReduceOp.Average) -> Handle:
        """Compress ``array`` (with error feedback) and start sending it; ``array`` may be sent as is.
        The handle's ``wait()`` returns the aggregated (summed or averaged) gradient."""
        size = runtime.size()
        self.compressor.check(array)
        communicator = self.communicator()
        # the communicator averages in place where it can and no guard applies; else it sums
        plan = scaling.sum_plan(op, lambda: size, self.compressor.prescale,
                                collective_averages=communicator.averages)
        started = time.perf_counter()
        compensated = self.memory.compensate(array, name)
        if plan.before != 1.0:
            compensated = scaling.scaled(compensated, plan.before)
        payloads, ctx = self.compressor.compress(compensated, name)
        self.memory.update(compensated, name, self.compressor, payloads, ctx)
        self.stats.compress_seconds += time.perf_counter() - started
        received_estimate = self._count(array, payloads, size)
        own_bytes = sum(p.nbytes for p in payloads)

        def rebuild(received: list) -> np.ndarray:
            # Received bytes are counted when they arrive: what came, where the communicator knows.
            actual = communicator.received_bytes(received, own_bytes, size)
            self.stats.bytes_received += received_estimate if actual is None else actual
            started = time.perf_counter()
            result = communicator.rebuild(self.compressor, received, ctx)
            if plan.after != 1.0:
                result = scaling.scaled(result, plan.after)
            self.stats.decompress_seconds += time.perf_counter() - started
            return result

        return communicator.start(payloads, name, plan.op is ReduceOp.Average).then(rebuild)

    def _count(self, array: np.ndarray, payloads: list, size: int) -> int:
        """Count the exchange and the bytes sent; returns the estimate of the bytes to receive."""
        return self._count_bytes(array.nbytes, payloads, size)

    def _count_bytes(self, dense_nbytes: int, payloads: list, size: int) -> int:
        sent, received = self.communicator().wire_bytes(payloads, size)
        self.stats.exchanges += 1
        self.stats.dense_bytes += int(dense_nbytes * bus_factor(size))
        self.stats.bytes_sent += sent
        return received

    def record(self, dense_nbytes: int, payloads: list) -> None:
        """Count an exchange of summable ``payloads`` that an adapter ran itself (a fused allreduce),
        standing for a gradient of ``dense_nbytes`` bytes."""
        self.stats.bytes_received += self._count_bytes(dense_nbytes, payloads, runtime.size())

    def state_dict(self) -> dict:
        """Error-feedback state keyed by tensor name, for checkpoints."""
        return self.memory.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.memory.load_state_dict(state)

    def __repr__(self) -> str:
        return f"Compression.{self.name}"
