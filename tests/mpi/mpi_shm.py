"""Inner multi-rank tests of the shared-memory data plane (HVPS_SHM=1): the backend on its own with a
tiny segment (every dtype, op and size, against a numpy reference, in several rounds), then through
the engine (over MPI, and over torch.distributed as in jobs without MPI), a rank stopped shorter than
the stall time, no name left in /dev/shm, and what HVPS_SHM=1 and auto do where shared memory cannot
be used (one HvpsError at init on every rank; the flat plane, with one warning on rank 0 only where
ranks share a host)."""

import os
import signal
import threading
import time
import warnings

import numpy as np
import pytest
from hvps_testutil import DTYPES, all_inputs, assert_exact, check_allreduce_result, rows_split
from mpi4py import MPI

import hvps
from hvps.core import dtypes
from hvps.core.dtypes import ReduceOp
from hvps.core.errors import HvpsError
from hvps.dataplane.backends.shm import ShmBackend, open_segment
from hvps.dataplane.schedule import fold_in_rank_order

pytestmark = pytest.mark.timeout(180)

BUFFER = 4096  # bytes per buffer: sizes below go through the segment in many rounds
SIZES = [0, 1, 7, 1001, 3 * BUFFER + 5]
OPS = ["Sum", "Min", "Max", "Product"]


@pytest.fixture(scope="module")
def shm():
    comm = MPI.COMM_WORLD.Dup()
    segment, reason = open_segment(comm, BUFFER, 30.0)
    assert segment is not None, reason
    backend = ShmBackend(segment, None)
    yield backend, comm
    backend.close()
    comm.Free()


def test_segment_name_is_gone_once_mapped(shm):
    backend, comm = shm
    comm.Barrier()
    assert not os.path.exists(backend.segment.path), "the segment must be unlinked once every rank mapped it"


@pytest.mark.parametrize("name", list(DTYPES))
def test_allreduce_every_dtype_op_size(shm, name):
    backend, comm = shm
    dtype = DTYPES[name]
    size, rank = comm.Get_size(), comm.Get_rank()
    for op in OPS:
        for n in SIZES:
            arrays = all_inputs(dtype, (n,), f"shm.{op}.{n}", size, op)
            out = np.empty_like(arrays[rank])
            backend.allreduce(arrays[rank], out, ReduceOp[op])
            check_allreduce_result(out, arrays, op, size, what=f"{op} n={n}")
            # every rank, and every path (one round for the small, reduce-scatter and allgather for the rest): the
            # contributions folded in rank order, bit for bit
            folded = np.empty_like(out)
            fold_in_rank_order(dtypes.combine(ReduceOp[op], out.dtype), arrays, folded)
            assert_exact(out, folded, f"{op} n={n}: the rank-order fold")
            inplace = arrays[rank].copy()
            backend.allreduce(inplace, inplace, ReduceOp[op])
            assert_exact(inplace, out, f"in place {op} n={n}")


def test_overflow_gives_inf_without_a_warning(shm):
    """A sum past the dtype's range is inf, as in MPI's reductions, with no RuntimeWarning pointing into hvps (a
    loss scaler's fp16 gradients overflow on purpose); in one round and in many."""
    backend, comm = shm
    for n in (3, 3 * BUFFER):
        big = np.full(n, np.finfo(np.float16).max, np.float16)
        big[0] = -np.inf  # inf + (-inf) on the last rank's fold: NaN, "invalid" to numpy
        if comm.Get_rank() != comm.Get_size() - 1:
            big[0] = np.inf
        out = np.empty_like(big)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            backend.allreduce(big, out, ReduceOp.Sum)
        assert np.isnan(out[0]) and np.isposinf(out[1:]).all(), f"n={n}: {out[:3]}"


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64], ids=["float32", "float16", "int64"])
def test_reducescatter_allgather_broadcast(shm, dtype):
    backend, comm = shm
    size, rank = comm.Get_size(), comm.Get_rank()
    for n in SIZES:
        arrays = all_inputs(dtype, (n,), f"shm.rs.{n}", size)
        full = np.empty_like(arrays[rank])
        backend.allreduce(arrays[rank], full, ReduceOp.Sum)
        counts = rows_split(n, size)
        mine = np.empty(counts[rank], dtype)
        backend.reducescatter(arrays[rank], mine, counts, ReduceOp.Sum)
        start = sum(counts[:rank])
        assert_exact(mine, full[start:start + counts[rank]], f"reducescatter n={n}")
        counts = [n + 3 * r for r in range(size)]
        gathered = np.empty(sum(counts), dtype)
        backend.allgatherv(all_inputs(dtype, (counts[rank],), f"shm.ag.{n}", size)[rank], gathered, counts)
        expected = np.concatenate([all_inputs(dtype, (counts[r],), f"shm.ag.{n}", size)[r] for r in range(size)])
        assert_exact(gathered, expected, f"allgather n={n}")
        for root in range(size):
            buf = arrays[rank].copy()
            backend.broadcast(buf, root)
            assert_exact(buf, arrays[root], f"broadcast n={n} root={root}")


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64], ids=["float32", "float16", "int64"])
def test_alltoallv_blocks_of_every_size_in_many_rounds(shm, dtype):
    backend, comm = shm
    size, rank = comm.Get_size(), comm.Get_rank()
    for n in SIZES:  # counts[src][dst]: zero, small and many buffers' worth, different for every pair
        counts = [[(n * (src + 2 * dst + 1)) % (n + 4) + (dst == src) * n for dst in range(size)]
                  for src in range(size)]
        sent = [all_inputs(dtype, (sum(counts[src]),), f"shm.a2a.{n}", size)[src] for src in range(size)]
        received = np.empty(sum(counts[src][rank] for src in range(size)), dtype)
        backend.alltoallv(sent[rank], counts[rank], received, [counts[src][rank] for src in range(size)])
        expected = np.concatenate([sent[src][sum(counts[src][:rank]):sum(counts[src][:rank + 1])]
                                   for src in range(size)])
        assert_exact(received, expected, f"alltoallv n={n} counts={counts}")


def test_rank_stopped_shorter_than_the_stall_time_is_waited_for(shm):
    """Rank 0 stops the last rank for 1.5 s mid-run (stall time 30 s): results stay right."""
    backend, comm = shm
    size, rank = comm.Get_size(), comm.Get_rank()
    pids = comm.allgather(os.getpid())
    comm.Barrier()
    if rank == 0:
        os.kill(pids[-1], signal.SIGSTOP)
        threading.Timer(1.5, os.kill, (pids[-1], signal.SIGCONT)).start()
    started = time.monotonic()
    for i in range(20):
        arrays = all_inputs(np.float64, (3 * BUFFER + 5,), f"shm.stop.{i}", size)
        out = np.empty_like(arrays[rank])
        backend.allreduce(arrays[rank], out, ReduceOp.Sum)
        check_allreduce_result(out, arrays, "Sum", size, what=f"call {i}")
    if rank == 0:
        assert time.monotonic() - started >= 1.0, "the stopped rank was not waited for"


def test_engine_uses_shared_memory():
    hvps.init()
    try:
        from hvps.runtime import state

        assert state._state.engine.backend.name == "shm"
        size, rank = hvps.size(), hvps.rank()
        arrays = all_inputs(np.float32, (5000,), "shm.engine", size)
        check_allreduce_result(hvps.allreduce(arrays[rank], op=hvps.Sum, name="shm.e"), arrays, "Sum", size)
        avg = hvps.allreduce(arrays[rank], op=hvps.Average, name="shm.avg")
        check_allreduce_result(avg, arrays, "Average", size)
        rows = hvps.allgather(np.full((rank + 1, 3), rank, np.int32), name="shm.ag")
        assert rows.tolist() == [[r] * 3 for r in range(size) for _ in range(r + 1)]
        assert hvps.broadcast(np.arange(9.0) * (rank + 1), root_rank=size - 1, name="shm.b").tolist() == \
            (np.arange(9.0) * size).tolist()
    finally:
        hvps.shutdown()


def test_engine_on_torch_distributed_uses_shared_memory(monkeypatch):
    """HVPS_BACKEND=tdist (the plane of hvpsrun --gloo, torchrun and elastic jobs): shared memory under it;
    CPU tensors come back as tensors, alltoall runs on the segment too."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("HVPS_BACKEND", "tdist")
    hvps.init()
    try:
        from hvps.runtime import state

        assert state._state.engine.backend.name == "shm"
        size, rank = hvps.size(), hvps.rank()
        summed = hvps.allreduce(torch.full((1001,), float(rank + 1)), op=hvps.Sum, name="shm.tdist")
        assert isinstance(summed, torch.Tensor) and torch.equal(summed, torch.full((1001,), size * (size + 1) / 2))
        swapped, _ = hvps.alltoall(np.full(size, rank, np.int64), name="shm.tdist.a2a")
        assert swapped.tolist() == list(range(size))
    finally:
        hvps.shutdown()


def _shm_plane_of_a_job(monkeypatch, caplog, **env) -> tuple:
    """``(plane name, HvpsError message, hvps warnings)`` of ``hvps.init()`` under ``env``."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    caplog.clear()
    try:
        hvps.init()
    except HvpsError as exc:
        return None, str(exc), []
    try:
        from hvps.runtime import state

        hvps.allreduce(np.ones(3), name="shm.after")
        return state._state.engine.backend.name, "", [r.getMessage() for r in caplog.records
                                                      if r.name == "hvps" and r.levelname == "WARNING"]
    finally:
        hvps.shutdown()


@pytest.mark.parametrize("setting", ["1", "auto"])
def test_no_two_ranks_on_a_host(monkeypatch, caplog, setting):
    """Every rank its own node (HVPS_LOCAL_SIZE=1): HVPS_SHM=1 fails at init on every rank, saying why and
    what to do; auto quietly keeps MPI (nobody expects shared memory there)."""
    plane, error, warnings = _shm_plane_of_a_job(monkeypatch, caplog, HVPS_SHM=setting, HVPS_LOCAL_SIZE="1")
    if setting == "1":
        assert "HVPS_SHM=1" in error and "no two ranks of this job share a host" in error and "HVPS_SHM=0" in error
    else:
        assert (plane, warnings) == ("mpi", [])


@pytest.mark.parametrize("setting", ["1", "auto"])
def test_dev_shm_too_small(monkeypatch, caplog, setting):
    """A segment larger than /dev/shm: HVPS_SHM=1 fails at init on every rank naming the sizes; auto runs on
    MPI with one warning, from rank 0 only."""
    plane, error, warnings = _shm_plane_of_a_job(monkeypatch, caplog, HVPS_SHM=setting,
                                                 HVPS_RING_CHUNK_BYTES=str(1 << 40))
    if setting == "1":
        assert "HVPS_SHM=1" in error and "/dev/shm has" in error and "HVPS_SHM=0" in error, error
        return
    assert plane == "mpi"
    expected = 1 if MPI.COMM_WORLD.Get_rank() == 0 else 0
    assert len([w for w in warnings if "shared memory not used" in w and "/dev/shm has" in w]) == expected, warnings
