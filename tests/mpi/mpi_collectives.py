"""Inner multi-rank tests: topology queries, allgather, broadcast, alltoall,
reducescatter, barrier, object collectives, dtype errors (numpy core API)."""

import os
import shutil
import tempfile
import time

import numpy as np
import pytest
from hvps_testutil import (
    DTYPE_NAMES,
    DTYPES,
    MIB,
    all_inputs,
    assert_exact,
    big_count,
    check_allreduce_result,
    random_array,
    rows_split,
    world_size_env,
)

import hvps

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvps.init()
    yield


# ---------------------------------------------------------------- topology

def test_topology():
    size, rank = hvps.size(), hvps.rank()
    assert size == world_size_env()
    assert 0 <= rank < size
    ranks = hvps.allgather(np.array([rank], dtype=np.int64))
    assert ranks.tolist() == list(range(size))
    # single host: local == global, one "cross" group
    assert hvps.local_size() == size
    assert hvps.local_rank() == rank
    assert hvps.cross_size() == 1
    assert hvps.cross_rank() == 0
    assert hvps.is_initialized()


def test_init_is_idempotent():
    hvps.init()
    assert hvps.is_initialized()
    assert hvps.size() == world_size_env()


def test_reduce_ops_exported():
    for name in ("Sum", "Average", "Min", "Max", "Product"):
        assert isinstance(getattr(hvps, name), hvps.ReduceOp)
    assert issubclass(hvps.HvpsError, RuntimeError)


# ---------------------------------------------------------------- allgather

def _rows(pattern, rank, size, dt):
    if pattern == "equal":
        return 4
    if pattern == "varied_with_zero":
        return [2, 0, 5][rank % 3]
    if pattern == "rank0_zero":
        return 0 if rank == 0 else rank + 2
    if pattern == "all_zero":
        return 0
    if pattern == "big":  # ~3 MiB in total, different per rank
        per_row = 64 * np.dtype(dt).itemsize
        return (3 * MIB // per_row) // size + 3 * rank + 1
    raise ValueError(pattern)


TRAILING = {"equal": (3,), "varied_with_zero": (), "rank0_zero": (2, 5),
            "all_zero": (3,), "big": (64,)}


@pytest.mark.parametrize("pattern", list(TRAILING))
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_allgather(dtype, pattern, request):
    dt = DTYPES[dtype]
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    xs = [random_array(dt, (_rows(pattern, r, size, dt),) + TRAILING[pattern], key, r)
          for r in range(size)]
    x = xs[rank].copy()
    res = hvps.allgather(x)
    assert_exact(res, np.concatenate(xs, axis=0), key)
    assert_exact(x, xs[rank], key + ": input modified")


@pytest.mark.parametrize("dtype", ["float32", "bool", "bfloat16"])
def test_allgather_async_and_named(dtype, request):
    dt = DTYPES[dtype]
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    xs = [random_array(dt, (r + 1, 7), key, r) for r in range(size)]
    ys = [random_array(dt, (2 * r,), key + "y", r) for r in range(size)]
    h1 = hvps.allgather_async(xs[rank].copy(), name=key + ".x")
    h2 = hvps.allgather_async(ys[rank].copy(), name=key + ".y")
    assert_exact(h2.wait(), np.concatenate(ys), key + " y")
    assert_exact(h1.wait(), np.concatenate(xs), key + " x")


def test_allgather_scalar_rows():
    size, rank = hvps.size(), hvps.rank()
    res = hvps.allgather(np.array([rank * 10 + 1], dtype=np.int32))
    assert_exact(res, np.array([r * 10 + 1 for r in range(size)], dtype=np.int32))


# ---------------------------------------------------------------- broadcast

BCAST_SHAPES = ["empty", "one", "odd", "big"]


def _bshape(name, dt):
    return {"empty": (0, 4), "one": (1,), "odd": (3, 17, 5),
            "big": (big_count(dt),)}[name]


@pytest.mark.parametrize("shape", BCAST_SHAPES)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_broadcast_every_root(dtype, shape, request):
    dt = DTYPES[dtype]
    size, rank = hvps.size(), hvps.rank()
    for root in range(size):
        key = f"{request.node.name}/root{root}"
        mine = random_array(dt, _bshape(shape, dt), key, rank)
        expect = random_array(dt, _bshape(shape, dt), key, root)
        x = mine.copy()
        res = hvps.broadcast(x, root_rank=root)
        assert_exact(res, expect, key)
        assert_exact(x, mine, key + ": input modified (no out= given)")


@pytest.mark.parametrize("dtype", ["float64", "int32", "bool", "float16"])
def test_broadcast_out_in_place(dtype, request):
    dt = DTYPES[dtype]
    size, rank = hvps.size(), hvps.rank()
    for root in range(size):
        key = f"{request.node.name}/root{root}"
        x = random_array(dt, (5, 6), key, rank)
        expect = random_array(dt, (5, 6), key, root)
        hvps.broadcast(x, root_rank=root, out=x)
        assert_exact(x, expect, key)


def test_broadcast_async_all_roots_outstanding(request):
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    handles = [hvps.broadcast_async(random_array(np.float32, (100 + root,), key, rank * 100 + root),
                                    root_rank=root, name=f"{key}.{root}")
               for root in range(size)]
    for root in reversed(range(size)):
        expect = random_array(np.float32, (100 + root,), key, root * 100 + root)
        assert_exact(handles[root].wait(), expect, f"root {root}")


# ---------------------------------------------------------------- alltoall

def _splits(pattern, size):
    """splits[r][j] = rows rank r sends to rank j."""
    if pattern == "uneven":
        return [[(r + 2 * j + 1) % 4 for j in range(size)] for r in range(size)]
    if pattern == "to_next":
        return [[7 if j == (r + 1) % size else 0 for j in range(size)] for r in range(size)]
    if pattern == "empty":
        return [[0] * size for _ in range(size)]
    if pattern == "big":
        return [[(3 * MIB // 256) // (size * size) + r + 2 * j for j in range(size)]
                for r in range(size)]
    raise ValueError(pattern)


def _alltoall_expect(inputs, splits, rank, size):
    pieces = []
    for j in range(size):
        off = sum(splits[j][:rank])
        pieces.append(inputs[j][off:off + splits[j][rank]])
    return np.concatenate(pieces, axis=0), np.array([splits[j][rank] for j in range(size)])


@pytest.mark.parametrize("pattern", ["uneven", "to_next", "empty", "big"])
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_alltoall_splits(dtype, pattern, request):
    dt = DTYPES[dtype]
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    splits = _splits(pattern, size)
    trailing = (256 // dt.itemsize,) if pattern == "big" else (3,)
    inputs = [random_array(dt, (sum(splits[r]),) + trailing, key, r) for r in range(size)]
    my_splits = splits[rank]
    if pattern == "uneven":
        my_splits = np.array(my_splits, dtype=np.int64)  # array form too
    out, recv = hvps.alltoall(inputs[rank].copy(), splits=my_splits)
    expect, expect_recv = _alltoall_expect(inputs, splits, rank, size)
    assert_exact(out, expect, key)
    recv = np.asarray(recv)
    assert recv.dtype.kind in "iu", f"received_splits dtype {recv.dtype}"
    assert recv.tolist() == expect_recv.tolist()


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_alltoall_default_equal_split(dtype, request):
    dt = DTYPES[dtype]
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    inputs = [random_array(dt, (size * 3, 2, 2), key, r) for r in range(size)]
    out, recv = hvps.alltoall(inputs[rank].copy())
    splits = [[3] * size for _ in range(size)]
    expect, expect_recv = _alltoall_expect(inputs, splits, rank, size)
    assert_exact(out, expect, key)
    assert np.asarray(recv).tolist() == expect_recv.tolist()


def test_alltoall_async(request):
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    splits = _splits("uneven", size)
    inputs = [random_array(np.int64, (sum(splits[r]), 5), key, r) for r in range(size)]
    h = hvps.alltoall_async(inputs[rank].copy(), splits=splits[rank], name=key)
    out, recv = h.wait()
    expect, expect_recv = _alltoall_expect(inputs, splits, rank, size)
    assert_exact(out, expect, key)
    assert np.asarray(recv).tolist() == expect_recv.tolist()


# ---------------------------------------------------------------- reducescatter

RS_CASES = [(d, o) for d in DTYPE_NAMES for o in ("Sum", "Average")
            if not (d == "bool" and o == "Average")]


@pytest.mark.parametrize("rows", [0, 1, 7, 11, "big"])
@pytest.mark.parametrize("dtype,op", RS_CASES)
def test_reducescatter(dtype, op, rows, request):
    dt = DTYPES[dtype]
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    shape = (big_count(dt) // 4, 4) if rows == "big" else (rows, 3)
    xs = all_inputs(dt, shape, key, size, op)
    x = xs[rank].copy()
    res = hvps.reducescatter(x, op=getattr(hvps, op))
    counts = rows_split(shape[0], size)
    off = sum(counts[:rank])
    mine = [a[off:off + counts[rank]] for a in xs]
    assert res.shape == (counts[rank],) + shape[1:], f"{key}: shape {res.shape}"
    check_allreduce_result(res, mine, op, size, what=key)
    assert_exact(x, xs[rank], key + ": input modified")


def test_reducescatter_default_op_is_average(request):
    size, rank = hvps.size(), hvps.rank()
    xs = all_inputs(np.float64, (10, 2), request.node.name, size)
    res = hvps.reducescatter(xs[rank].copy())
    counts = rows_split(10, size)
    off = sum(counts[:rank])
    check_allreduce_result(res, [a[off:off + counts[rank]] for a in xs], "Average", size)


def test_reducescatter_async(request):
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    a_in = all_inputs(np.float32, (13, 2), key + "a", size)
    b_in = all_inputs(np.int32, (5,), key + "b", size)
    ha = hvps.reducescatter_async(a_in[rank].copy(), op=hvps.Sum)
    hb = hvps.reducescatter_async(b_in[rank].copy(), op=hvps.Average)
    for h, ins, n, op in ((hb, b_in, 5, "Average"), (ha, a_in, 13, "Sum")):
        counts = rows_split(n, size)
        off = sum(counts[:rank])
        check_allreduce_result(np.asarray(h.wait()), [x[off:off + counts[rank]] for x in ins],
                               op, size)


def test_reducescatter_bool_average_raises():
    with pytest.raises(TypeError):
        hvps.reducescatter(np.ones((4, 2), dtype=bool), op=hvps.Average)


# ---------------------------------------------------------------- barrier

def test_barrier_blocks_until_all_arrive():
    """No rank leaves a barrier before the last one entered it: rank 0, late, leaves a mark just before it enters,
    and every other rank finds the mark once it is out (an order, not a time: the ranks share this host)."""
    rank = hvps.rank()
    mark = os.path.join(hvps.broadcast_object(tempfile.mkdtemp() if rank == 0 else None, root_rank=0), "entered")
    if rank == 0:
        time.sleep(0.2)
        open(mark, "w").close()
    hvps.barrier()
    assert os.path.exists(mark), f"rank {rank} left the barrier before rank 0 entered it"
    for _ in range(5):
        hvps.barrier()
    if rank == 0:
        shutil.rmtree(os.path.dirname(mark))


# ---------------------------------------------------------------- objects

def _obj(r):
    return {"rank": r, "arr": np.arange(r + 3, dtype=np.float32) * 1.5,
            "text": "x" * r + "é", "nested": [1, (2, 3), {"k": None}],
            "blob": bytes(range(256)) * (r + 1)}


def _obj_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert_exact(a[k], b[k], k)
        else:
            assert a[k] == b[k], k


def test_broadcast_object_every_root():
    size, rank = hvps.size(), hvps.rank()
    for root in range(size):
        got = hvps.broadcast_object(_obj(rank), root_rank=root)
        _obj_equal(got, _obj(root))
    assert hvps.broadcast_object(None if rank else "only-root") == "only-root"
    big = np.random.default_rng(5).bytes(2 * MIB) if rank == size - 1 else b""
    got = hvps.broadcast_object(big, root_rank=size - 1, name="big.object")
    assert got == np.random.default_rng(5).bytes(2 * MIB)


def test_allgather_object():
    size, rank = hvps.size(), hvps.rank()
    got = hvps.allgather_object(_obj(rank))
    assert isinstance(got, list) and len(got) == size
    for r in range(size):
        _obj_equal(got[r], _obj(r))
    got2 = hvps.allgather_object("s" * (rank * 1000), name="strings")
    assert got2 == ["s" * (r * 1000) for r in range(size)]


# ---------------------------------------------------------------- 16-bit integers

@pytest.mark.parametrize("dtype", ["int16", "uint16"])
def test_sixteen_bit_integers_through_every_collective(dtype, request):
    """int16 and uint16 (which Horovod's TensorFlow ops take, and gloo cannot reduce) on odd and empty shapes."""
    dt = np.dtype(dtype)
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    for shape in [(0,), (1,), (17, 3)]:
        for op in ("Sum", "Average", "Min", "Max", "Product"):
            xs = all_inputs(dt, shape, f"{key}/{shape}/{op}", size, op)
            check_allreduce_result(hvps.allreduce(xs[rank].copy(), op=getattr(hvps, op)), xs, op, size,
                                   what=f"{key} allreduce {op} {shape}")
        rows = [random_array(dt, (r + shape[0],) + shape[1:], f"{key}/{shape}/ag", r) for r in range(size)]
        assert_exact(hvps.allgather(rows[rank].copy()), np.concatenate(rows), f"{key} allgather {shape}")
        root = size - 1
        mine = random_array(dt, shape, f"{key}/{shape}/bc", rank)
        assert_exact(hvps.broadcast(mine, root_rank=root), random_array(dt, shape, f"{key}/{shape}/bc", root),
                     f"{key} broadcast {shape}")
        inputs = [random_array(dt, (size * shape[0],) + shape[1:], f"{key}/{shape}/a2a", r) for r in range(size)]
        out, _ = hvps.alltoall(inputs[rank].copy())
        expect, _ = _alltoall_expect(inputs, [[shape[0]] * size for _ in range(size)], rank, size)
        assert_exact(out, expect, f"{key} alltoall {shape}")
        xs = all_inputs(dt, (2 * shape[0] + 1,) + shape[1:], f"{key}/{shape}/rs", size)
        counts = rows_split(xs[0].shape[0], size)
        off = sum(counts[:rank])
        check_allreduce_result(hvps.reducescatter(xs[rank].copy(), op=hvps.Sum),
                               [a[off:off + counts[rank]] for a in xs], "Sum", size, what=f"{key} reducescatter")


# ---------------------------------------------------------------- dtype errors

@pytest.mark.parametrize("np_dtype", [np.complex64, np.uint32, np.uint64],
                         ids=["complex64", "uint32", "uint64"])
def test_unsupported_dtypes_raise_type_error(np_dtype):
    size = hvps.size()
    x = np.zeros((size * 2, 3), dtype=np_dtype)
    calls = [
        lambda: hvps.allreduce(x, op=hvps.Sum),
        lambda: hvps.allreduce_async(x, op=hvps.Sum),
        lambda: hvps.grouped_allreduce([x], op=hvps.Sum),
        lambda: hvps.allgather(x),
        lambda: hvps.allgather_async(x),
        lambda: hvps.broadcast(x, root_rank=0),
        lambda: hvps.broadcast_async(x, root_rank=0),
        lambda: hvps.alltoall(x),
        lambda: hvps.alltoall_async(x),
        lambda: hvps.reducescatter(x, op=hvps.Sum),
        lambda: hvps.reducescatter_async(x, op=hvps.Sum),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(TypeError):
            call()
    # hvps still works afterwards
    res = hvps.allreduce(np.array([1.5], dtype=np.float32), op=hvps.Sum)
    assert res.tolist() == [1.5 * size]


def test_synchronous_calls_take_the_fast_path_and_large_ones_the_engine_thread(request):
    """A synchronous collective alone in flight is negotiated and run by its caller (submission.py's fast
    path); one above the backend's interruptible size (every one, on data planes without a fast path)
    is handed to the engine thread. Both correct, on every collective, with fresh data."""
    from hvps.dataplane.backends.mpi import NONBLOCKING_BYTES
    from hvps.runtime import state

    engine = state.engine()
    # 0: a data plane with no fast path (the node's segment: no limit); the spin below holds whatever
    # HVPS_SPIN_WAIT_MICROSECONDS says
    limit = min(engine.backend.interruptible_bytes_for(method) for method in ("allreduce", "allgatherv", "broadcast"))
    size, rank = hvps.size(), hvps.rank()
    spin, engine.spin_seconds = engine.spin_seconds, 5.0  # an oversubscribed, loaded box: never hand back early
    request.addfinalizer(lambda: setattr(engine, "spin_seconds", spin))
    for count in (1, 1001, NONBLOCKING_BYTES // 4 + 1):
        key = f"{request.node.name}/{count}"
        ins = np.stack(all_inputs(np.float64, (count,), key, size, "Sum"))
        ran = engine.driven_collectives
        for _ in range(3):
            out = hvps.allreduce(ins[rank], op=hvps.Sum, name=key)
            check_allreduce_result(np.asarray(out), list(ins), "Sum", size, what=key)
            gathered = hvps.allgather(ins[rank][None, :], name=key + "/gather")
            np.testing.assert_array_equal(gathered, ins)
            root = count % size
            np.testing.assert_array_equal(hvps.broadcast(ins[rank], root, name=key + "/bcast"), ins[root])
        driven = engine.driven_collectives - ran
        if count * 8 * size <= limit:  # the engine thread may hold the cycle lock now and then (across hosts: 4 of 9)
            assert driven >= 1, f"{count} float64: none of 9 collectives ran on the caller's thread"
        else:  # too large, or a data plane that cannot abandon a transfer (gloo, the sealed one): never
            assert driven == 0, f"{count} float64: {driven} collectives ran on the caller ({engine.backend.name})"


@pytest.mark.parametrize("dtype", ["float32", "int64", "bfloat16"])
def test_allgather_into_out(dtype, request):
    """``out=``: the concatenation lands in the caller's array, which is what wait() returns; uneven rows, a
    rank with none."""
    dt = DTYPES[dtype]
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    xs = [random_array(dt, (r % 3, 5), key, r) for r in range(size)]
    out = np.full((sum(x.shape[0] for x in xs), 5), 7, dtype=dt)
    res = hvps.allgather(xs[rank].copy(), name=key, out=out)
    assert res is out
    assert_exact(out, np.concatenate(xs), key)


def test_allgather_into_an_out_of_the_wrong_size_fails_on_every_rank_naming_it():
    """One rank's ``out`` is a row short: every member gets the same HvpsError, naming that rank, and nothing
    was written; the next collective runs."""
    size, rank = hvps.size(), hvps.rank()
    rows = size * 2 - (1 if rank == size - 1 else 0)
    out = np.zeros((rows, 3), dtype=np.float32)
    with pytest.raises(hvps.HvpsError, match=rf"ranks \[{size - 1}\] gave an output of \[{size * 2 - 1}\] rows, "
                                             rf"but the members' rows add up to {size * 2}"):
        hvps.allgather(np.ones((2, 3), dtype=np.float32), name="wrong-out", out=out)
    assert not out.any()
    with pytest.raises(ValueError, match=r"shape \(rows, 3\)"):
        hvps.allgather(np.ones((2, 3), dtype=np.float32), name="wrong-out-2", out=np.zeros((2 * size, 4), np.float32))
    with pytest.raises(ValueError, match="dtype float32"):
        hvps.allgather(np.ones((2, 3), dtype=np.float32), name="wrong-out-3", out=np.zeros((2 * size, 3), np.int32))
    assert_exact(hvps.allreduce(np.ones(2, np.float32), op=hvps.Sum, name="after-wrong-out"),
                 np.full(2, size, np.float32))
