"""``Compression.powersgd(...)``: PowerSGD's two allreduces per step, fused across tensors.

Each gradient is submitted on its own (from the backward hook, bucket by bucket): ``start``
computes ``P = M Q`` and submits P's allreduce at once, so the P allreduces of the tensors that
are ready together fuse in the engine's cycle, and overlap the rest of the backward. The second
round (orthogonalise P, ``Q = M^T P``, allreduce Q) starts for every tensor whose P has arrived:
opportunistically at each later ``start``, and for all that remain at the first ``wait()``, so
their Q allreduces fuse too. Dense tensors (vectors, too small to gain, the first ``start_iter``
steps) take the same allreduce path. DDP's ``powerSGD_hook`` runs the same two rounds per bucket.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Optional

import numpy as np

from ..api import collectives as ops
from ..core.dtypes import ReduceOp
from ..core.errors import HvpsError
from ..core.handle import Handle
from ..runtime import state as runtime
from .blas import one_blas_thread
from .communicators import Allreduce
from .lowrank import PowerSGDCompressor, approximation_ctx
from .pipeline import GradientCompression
from .powersgd_state import PowerSGDState

log = logging.getLogger("hvps")


class _Job:
    """One compressed tensor between its first allreduce and its result."""

    __slots__ = ("name", "shape", "dtype", "matrix", "out", "p", "q", "handle", "average", "finite")

    def __init__(self, name: str, shape: tuple, dtype: np.dtype, matrix: np.ndarray, out: Optional[np.ndarray],
                 p: np.ndarray, handle: Handle, average: bool) -> None:
        self.name, self.shape, self.dtype, self.matrix, self.out, self.p = name, shape, dtype, matrix, out, p
        self.handle, self.average = handle, average
        self.q: Optional[np.ndarray] = None
        self.finite = True


class _Result(Handle):
    """A compressed tensor's handle: ``wait()`` runs what remains of both rounds and returns the average."""

    __slots__ = ("_pipeline", "_job")

    def __init__(self, pipeline: "PowerSGDCompression", job: _Job) -> None:
        super().__init__(job.name)
        self._pipeline, self._job = pipeline, job

    def poll(self) -> bool:
        job = self._job
        return self._done or (job.q is not None and job.handle.poll())

    done = poll

    def wait(self, timeout: Optional[float] = None) -> Any:
        if not self._done:
            self._result = self._pipeline._finish(self._job, timeout)
            self._done = True
            self._job = None
        return self._result


class PowerSGDCompression(GradientCompression):
    """PowerSGD with warm start and error feedback; build it with ``Compression.powersgd(...)``.

    ``state`` (a ``PowerSGDState``) holds everything that changes; ``state_dict()`` saves it.
    """

    def __init__(self, compressor: PowerSGDCompressor, start_iter: int = 10, warm_start: bool = True,
                 error_feedback: bool = True) -> None:
        if isinstance(start_iter, bool) or not isinstance(start_iter, (int, np.integer)) or start_iter < 0:
            raise ValueError(f"start_iter must be an integer >= 0, got {start_iter!r}")
        self.state = PowerSGDState(error_feedback)
        super().__init__(f"powersgd({compressor.rank})", compressor, self.state.memory, Allreduce())
        self.start_iter = int(start_iter)
        self.warm_start = bool(warm_start)
        self.error_feedback = bool(error_feedback)
        self._first_round: list = []  # jobs whose P allreduce is in flight, in submission order
        self._checked = False
        self._shapes_seen: set = set()

    @property
    def summable(self) -> bool:
        """False: P and Q are summable, but two rounds cannot join an adapter's one fused allreduce."""
        return False

    def settings(self) -> tuple:
        """What every rank must agree on: rank, min_compression_rate, epsilon, seed, start_iter,
        warm_start, error_feedback."""
        return (*self.compressor.settings(), self.start_iter, self.warm_start, self.error_feedback)

    def prepare(self, shapes: Mapping[str, tuple]) -> None:
        """Check the gradients' shapes up front (ValueError naming ``rank``); optimizers call it."""
        for name, shape in shapes.items():
            self.compressor.check_shape(tuple(shape), name)
            self._shapes_seen.add(name)

    # -- the exchange ---------------------------------------------------------------------------
    def start(self, array: np.ndarray, name: str, op: ReduceOp = ReduceOp.Average) -> Handle:
        """Start exchanging ``array``; the handle's ``wait()`` returns the sum or average over ranks."""
        if op not in (ReduceOp.Average, ReduceOp.Sum):
            raise ValueError(f"PowerSGD averages or sums gradients, not {op}")
        self.compressor.check(array)
        if name not in self._shapes_seen:
            self.compressor.check_shape(array.shape, name)
            self._shapes_seen.add(name)
        if not self._checked:
            self._check_settings()
        self._advance(block=False)
        step = self.state.next_step(name)
        shape = self.compressor.matrix_shape(array.shape)
        if shape is None or step < self.start_iter:
            return self._start_dense(array, name, op)
        started = time.perf_counter()
        work = self.compressor.work_dtype(array.dtype)
        # the result is written over ``array`` where it can be (no allocation; an optimizer's
        # gradient buffer then holds it already)
        out = array.reshape(shape) if array.dtype == work and array.flags.c_contiguous and \
            array.flags.writeable else None
        matrix = self.state.memory.compensate(array.reshape(shape).astype(work, copy=False), name)
        q = self.state.qs.get(name) if self.warm_start else None
        if q is None:
            q = self.compressor.draw_q(name, shape[1], self.state.next_draw(name), work)
        with one_blas_thread():
            p = matrix @ q
        self.stats.compress_seconds += time.perf_counter() - started
        handle = ops.allreduce_gradients_async([p], p.dtype.name, f"{name}.P", ReduceOp.Sum, 1.0, 1.0)
        job = _Job(name, array.shape, array.dtype, matrix, out, p, handle, op is ReduceOp.Average)
        self._first_round.append(job)
        self._count(array, [p, np.empty((shape[1], self.compressor.rank), work)])
        return _Result(self, job)

    def _start_dense(self, array: np.ndarray, name: str, op: ReduceOp) -> Handle:
        """The same allreduce path, uncompressed (in place where ``array`` allows it)."""
        buffer = array if array.flags.c_contiguous and array.flags.writeable else np.array(array, order="C")
        self._count(array, [buffer])
        return ops.allreduce_gradients_async([buffer], buffer.dtype.name, name, op, 1.0, 1.0)

    def _count(self, array: np.ndarray, payloads: list) -> None:
        self.stats.bytes_received += self._count_bytes(array.nbytes, payloads, runtime.size())

    def _advance(self, block: bool) -> None:
        """Start the second round of the jobs whose P has arrived (all of them when ``block``)."""
        while self._first_round and (block or self._first_round[0].handle.poll()):
            job = self._first_round.pop(0)
            job.handle.wait()
            started = time.perf_counter()
            p = job.p
            job.finite = bool(np.isfinite(p).all())  # the same verdict on every rank: P is their sum
            # a NaN/Inf P is reset in _finish
            with np.errstate(invalid="ignore", over="ignore", divide="ignore"), one_blas_thread():
                self.compressor.orthogonalize(p)
                q = job.matrix.T @ p
            self.stats.compress_seconds += time.perf_counter() - started
            op = ReduceOp.Average if job.average else ReduceOp.Sum
            job.q, job.handle = q, ops.allreduce_gradients_async([q], q.dtype.name, f"{job.name}.Q", op, 1.0, 1.0)

    def _finish(self, job: _Job, timeout: Optional[float]) -> np.ndarray:
        """The approximation ``P Q^T`` of the average, with the error it leaves remembered."""
        if job.q is None:
            self._advance(block=True)
        job.handle.wait(timeout)
        started = time.perf_counter()
        p, q = job.p, job.q
        with one_blas_thread():
            approximation = p @ q.T if job.out is None else np.matmul(p, q.T, out=job.out)
        ctx = approximation_ctx(job.shape, job.dtype, approximation)
        self.state.memory.update(job.matrix, job.name, self.compressor, [p, q], ctx)
        if job.finite and np.isfinite(q).all():  # Q is the same on every rank too
            if self.warm_start:
                self.state.qs[job.name] = q
        else:
            self._reset(job.name)
        result = self.compressor.decompress([p, q], ctx)
        self.stats.decompress_seconds += time.perf_counter() - started
        return result

    def _reset(self, name: str) -> None:
        if not self.state.resets:
            log.warning("hvps: PowerSGD: NaN or Inf in the gradient %r: its Q and error feedback are reset "
                        "(logged once; PowerSGDState.resets counts every reset)", name)
        self.state.reset(name)

    # -- agreement between ranks ------------------------------------------------------------------
    def _check_settings(self) -> None:
        """HvpsError naming the ranks when they do not all run the same PowerSGD settings."""
        mine = np.array([float(v) for v in self.settings()], dtype=np.float64)
        rows = np.asarray(ops.allgather(mine, name="powersgd.settings")).reshape(runtime.size(), -1)
        self._checked = True
        groups: dict = {}
        for r, row in enumerate(rows):
            groups.setdefault(tuple(row.tolist()), []).append(r)
        if len(groups) > 1:
            keys = ("rank", "min_compression_rate", "epsilon", "seed", "start_iter", "warm_start", "error_feedback")
            described = "; ".join(f"ranks {ranks}: " + ", ".join(f"{k}={v:g}" for k, v in zip(keys, row))
                                  for row, ranks in groups.items())
            raise HvpsError(f"Compression.powersgd settings differ across ranks ({described}); build it with the "
                            "same arguments on every rank")

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Q, step counts and error feedback, keyed by tensor name (``PowerSGDState.state_dict``)."""
        return self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state)


def powersgd(rank: int = 1, start_iter: int = 10, min_compression_rate: float = 2.0, warm_start: bool = True,
             error_feedback: bool = True, epsilon: float = 1e-8, seed: int = 0) -> PowerSGDCompression:
    """PowerSGD (Vogels et al. 2019): rank-``rank`` factors ``P Q^T`` of every gradient matrix, by one
    power iteration per step warm-started from the last Q, with error feedback. The first
    ``start_iter`` steps, vectors and matrices gaining less than ``min_compression_rate`` travel dense."""
    return PowerSGDCompression(PowerSGDCompressor(rank, min_compression_rate, epsilon, seed), start_iter,
                               warm_start, error_feedback)


__all__ = ["PowerSGDCompression", "powersgd"]
