"""The Prometheus metrics one rank records, in a registry of its own.

Every metric carries the ``rank`` label; host and GPU readings also carry ``host``. Other
labels have few values: ``op`` (the collective's kind, never a tensor name), ``kind`` (of
error) and ``operation`` (checkpoint save or load). Hooks record once per fused response,
optimizer step or checkpoint, never once per tensor.

The engine's metrics (tens of responses a step) are plain numbers that only the engine thread
writes and a collector turns into metric families when Prometheus scrapes: an observation costs
about a microsecond, without the locks of prometheus-client's metric objects. The rest (a few
observations a step or fewer) are prometheus-client objects.
"""

from __future__ import annotations

import math
import os
import time
from bisect import bisect_left
from typing import Any, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from ..core.dtypes import ITEMSIZE
from ..version import __version__
from .store import StoreCollector
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
    if " exited before submitting " in message or " stopped answering before submitting " in message:  # PeerLost
        return "rank_lost"
    return "other"


class PlainHistogram:
    """Bucket counts and sum of one writer's observations (``le`` buckets, as Prometheus's)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple) -> None:
        self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bound >= value; past the end: +Inf
        self.sum += value

    def cumulative(self) -> list:
        out, total = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts):
            total += count
            out.append((bound, total))
        return out


class OpStats:
    """Counts, tensors, bytes and latency of one kind of collective."""

    __slots__ = ("count", "tensors", "bytes", "latency")

    def __init__(self) -> None:
        self.count = self.tensors = self.bytes = 0
        self.latency = PlainHistogram(LATENCY_BUCKETS)


class EngineCollector:
    """The engine's metrics as metric families, made when Prometheus scrapes."""

    def __init__(self, rank: str) -> None:
        self.rank = rank
        #: op -> OpStats; only the engine thread adds ops or changes numbers
        self.ops: dict = {}
        self.negotiation = PlainHistogram(LATENCY_BUCKETS)
        self.fill = PlainHistogram(FILL_BUCKETS)

    def collect(self) -> Iterator[Any]:
        ops = list(self.ops.items())
        labels = ["rank", "op"]
        for name, field, doc in (
                ("hvps_collectives", "count", "Collectives executed by op (a fused response counts once)"),
                ("hvps_collective_tensors", "tensors", "Tensors in the collectives executed, by op"),
                ("hvps_collective_bytes", "bytes", "Bytes of this rank's input tensors of the collectives, by op")):
            family = CounterMetricFamily(name, doc, labels=labels)
            for op, stats in ops:
                family.add_metric([self.rank, op], getattr(stats, field))
            yield family
        family = HistogramMetricFamily("hvps_collective_seconds",
                                       "Time a collective (one fused response) took once every rank had submitted it",
                                       labels=labels)
        for op, stats in ops:
            family.add_metric([self.rank, op], stats.latency.cumulative(), stats.latency.sum)
        yield family
        for name, histogram, doc in (
                ("hvps_negotiation_seconds", self.negotiation,
                 "Time from submitting a collective until every rank had submitted it and it started "
                 "(negotiation cycle)"),
                ("hvps_fusion_buffer_fill_ratio", self.fill,
                 "Bytes of an allreduce response over the fusion threshold (HVPS_FUSION_THRESHOLD)")):
            family = HistogramMetricFamily(name, doc, labels=["rank"])
            family.add_metric([self.rank], histogram.cumulative(), histogram.sum)
            yield family


class Instruments:
    """The metric objects of one rank, with children bound to its labels up front."""

    def __init__(self, rank: int, local_rank: int, host: str) -> None:
        self.rank = rank
        self.registry = CollectorRegistry()
        reg, r = self.registry, str(rank)
        Gauge("hvps_info", "This rank (always 1): its rank, local rank, host and hvps version",
              ["rank", "local_rank", "host", "version"], registry=reg).labels(r, str(local_rank), host,
                                                                              __version__).set(1)
        self.engine = EngineCollector(r)
        reg.register(self.engine)
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
        reg.register(StoreCollector(r))
        self.gpu = GpuCollector(r, host, local_rank)
        reg.register(self.gpu)
        self._last_step: Optional[float] = None
        self._sync_started: Optional[float] = None

    def close(self) -> None:
        """Release NVML."""
        self.gpu.close()

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
        engine = self.engine
        stats = engine.ops.get(response.kind)
        if stats is None:
            stats = engine.ops[response.kind] = OpStats()
        stats.count += 1
        stats.tensors += tensors
        stats.bytes += nbytes
        stats.latency.observe(ended - started)
        if first is not None:
            engine.negotiation.observe(started - first)
        if response.kind == "allreduce" and fusion_threshold > 0:
            engine.fill.observe(nbytes / fusion_threshold)

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
