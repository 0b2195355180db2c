"""The Prometheus metrics one rank records, in a registry of its own.

Every metric carries the ``rank`` label; host and GPU readings also carry ``host``. Other
labels have few values: ``op`` (the collective's kind, never a tensor name), ``kind`` (of
error) and ``operation`` (checkpoint save or load). Hooks record once per fused response,
optimizer step or checkpoint, never once per tensor.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..dtypes import ITEMSIZE
from ..version import __version__
from .system import GpuCollector, HostCollector

#: seconds, from a small fused allreduce on shared memory to a stalled one
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0)
#: seconds per training step (a GPU step to a CPU ResNet-50 step)
STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: seconds per checkpoint save or load
CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
#: bytes of an allreduce response over HVPS_FUSION_THRESHOLD
FILL_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
#: kinds of hvps_errors_total (stalls have counters of their own)
ERROR_KINDS = ("mismatch", "rank_lost", "engine", "other")
CHECKPOINT_OPERATIONS = ("save", "load")


def error_kind(message: str) -> Optional[str]:
    """``stall``, or one of ERROR_KINDS, from the coordinator's error text (negotiation.py)."""
    if message.startswith("hvps stall:"):
        return "stall"
    if message.startswith("hvps mismatch:"):
        return "mismatch"
    if " exited before submitting " in message:
        return "rank_lost"
    return "other"


class Instruments:
    """The metric objects of one rank, with children bound to its labels up front."""

    def __init__(self, rank: int, local_rank: int, host: str) -> None:
        self.rank = rank
        self.registry = CollectorRegistry()
        reg, r = self.registry, str(rank)
        Gauge("hvps_info", "This rank (always 1): its rank, local rank, host and hvps version",
              ["rank", "local_rank", "host", "version"], registry=reg).labels(r, str(local_rank), host,
                                                                              __version__).set(1)
        self._collectives = Counter("hvps_collectives", "Collectives executed by op (a fused response counts once)",
                                    ["rank", "op"], registry=reg)
        self._tensors = Counter("hvps_collective_tensors", "Tensors in the collectives executed, by op",
                                ["rank", "op"], registry=reg)
        self._bytes = Counter("hvps_collective_bytes", "Bytes of this rank's input tensors of the collectives, by op",
                              ["rank", "op"], registry=reg)
        self._latency = Histogram("hvps_collective_seconds",
                                  "Time a collective (one fused response) took once every rank had submitted it",
                                  ["rank", "op"], buckets=LATENCY_BUCKETS, registry=reg)
        self._negotiation = Histogram(
            "hvps_negotiation_seconds",
            "Time from submitting a collective until every rank had submitted it and it started (negotiation cycle)",
            ["rank"], buckets=LATENCY_BUCKETS, registry=reg).labels(r)
        self._fill = Histogram("hvps_fusion_buffer_fill_ratio",
                               "Bytes of an allreduce response over the fusion threshold (HVPS_FUSION_THRESHOLD)",
                               ["rank"], buckets=FILL_BUCKETS, registry=reg).labels(r)
        self._stalls = Counter("hvps_stalls", "Collectives of this rank that failed as stalled (a rank did not submit)",
                               ["rank"], registry=reg).labels(r)
        self._stall_warnings = Counter("hvps_stall_warnings",
                                       "Stall reports about collectives this rank did not submit (logged as warnings)",
                                       ["rank"], registry=reg).labels(r)
        errors = Counter("hvps_errors", "Failed collectives and engine failures on this rank, by kind",
                         ["rank", "kind"], registry=reg)
        self._errors = {kind: errors.labels(r, kind) for kind in ERROR_KINDS}
        self._step = Histogram("hvps_step_seconds", "Time between consecutive DistributedOptimizer.step() calls",
                               ["rank"], buckets=STEP_BUCKETS, registry=reg).labels(r)
        self._exposed = Histogram(
            "hvps_exposed_communication_seconds",
            "Time DistributedOptimizer.synchronize() waited for gradients (communication not hidden by backward)",
            ["rank"], buckets=STEP_BUCKETS, registry=reg).labels(r)
        self._ratio = Gauge("hvps_compression_ratio",
                            "Dense gradient bytes over bytes sent, since the compression's stats were last reset",
                            ["rank"], registry=reg).labels(r)
        self._samples = Counter("hvps_samples", "Training samples processed (hvps.metrics.record_samples)",
                                ["rank"], registry=reg).labels(r)
        ckpt_seconds = Histogram("hvps_checkpoint_seconds", "Checkpoint save and load durations",
                                 ["rank", "operation"], buckets=CHECKPOINT_BUCKETS, registry=reg)
        ckpt_bytes = Counter("hvps_checkpoint_bytes",
                             "Bytes of the checkpoint files saved or loaded (where this rank sees the file)",
                             ["rank", "operation"], registry=reg)
        last_seconds = Gauge("hvps_checkpoint_last_seconds", "Duration of the last checkpoint save or load",
                             ["rank", "operation"], registry=reg)
        last_bytes = Gauge("hvps_checkpoint_last_bytes", "Size of the last checkpoint file saved or loaded",
                           ["rank", "operation"], registry=reg)
        self._checkpoint = {op: (ckpt_seconds.labels(r, op), ckpt_bytes.labels(r, op), last_seconds.labels(r, op),
                                 last_bytes.labels(r, op)) for op in CHECKPOINT_OPERATIONS}
        reg.register(HostCollector(r, host))
        self.gpu = GpuCollector(r, host, local_rank)
        reg.register(self.gpu)
        #: op -> (collectives, tensors, bytes, latency) children, made on first use
        self._per_op: dict = {}
        self._last_step: Optional[float] = None
        self._sync_started: Optional[float] = None

    def close(self) -> None:
        """Release NVML."""
        self.gpu.close()

    def _op(self, op: str) -> tuple:
        children = self._per_op.get(op)
        if children is None:
            r = str(self.rank)
            children = self._per_op[op] = (self._collectives.labels(r, op), self._tensors.labels(r, op),
                                           self._bytes.labels(r, op), self._latency.labels(r, op))
        return children

    # -- the engine ----------------------------------------------------------------
    def collective(self, response: Any, entries: list, started: float, fusion_threshold: int) -> None:
        """One executed response: count, bytes, latency, negotiation time and fusion fill."""
        ended = time.monotonic()
        # The only loop over tensors: ~0.2 us each (ResNet-50's 161 gradients: ~35 us a step).
        nbytes = tensors = 0
        first = None
        prod, itemsize = math.prod, ITEMSIZE.get
        for entry in entries:
            if entry is not None:
                request = entry.request
                elements = 0
                for shape in request.shapes:
                    elements += prod(shape)
                    tensors += 1
                nbytes += elements * itemsize(request.dtype, 1)
                if first is None:  # the first of a fused response was announced first
                    first = entry.handle.submitted_at
        count, tensor_counter, byte_counter, latency = self._op(response.kind)
        count.inc()
        tensor_counter.inc(tensors)
        byte_counter.inc(nbytes)
        latency.observe(ended - started)
        if first is not None:
            self._negotiation.observe(started - first)
        if response.kind == "allreduce" and fusion_threshold > 0:
            self._fill.observe(nbytes / fusion_threshold)

    def collective_error(self, message: str, mine: bool) -> None:
        kind = error_kind(message)
        if kind == "stall":
            (self._stalls if mine else self._stall_warnings).inc()
        elif mine:
            self._errors[kind].inc()

    def engine_failure(self) -> None:
        self._errors["engine"].inc()

    # -- the optimizer ---------------------------------------------------------------
    def step(self) -> None:
        now = time.perf_counter()
        if self._last_step is not None:
            self._step.observe(now - self._last_step)
        self._last_step = now

    def sync_started(self) -> None:
        self._sync_started = time.perf_counter()

    def sync_finished(self, compression: Any) -> None:
        started, self._sync_started = self._sync_started, None
        if started is not None:
            self._exposed.observe(time.perf_counter() - started)
        stats = getattr(compression, "stats", None)
        if stats is not None:
            self._ratio.set(stats.ratio)

    def samples(self, count: int) -> None:
        self._samples.inc(count)

    # -- checkpoints -------------------------------------------------------------------
    def checkpoint(self, operation: str, seconds: float, result: Any) -> None:
        """A save (``result``: the file's path on the root) or load (a Checkpoint, or None)."""
        histogram, byte_counter, last_seconds, last_bytes = self._checkpoint[operation]
        histogram.observe(seconds)
        last_seconds.set(seconds)
        path = getattr(result, "path", result)
        try:
            size = os.path.getsize(path) if path is not None else None
        except (OSError, TypeError):
            size = None
        if size is not None:
            byte_counter.inc(size)
            last_bytes.set(size)
