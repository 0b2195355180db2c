"""Inner multi-rank tests of the fast lane (hvps/runtime/fast_lane.py): synchronous collectives that the response
cache knows, agreed through the node's shared-memory segment instead of through rank 0. Results against a numpy
reference with fresh random data; a late rank (rank 0, or the last) falls back to the control plane and the lane
resumes; cached names submitted in different orders, and a shape that changed on one rank, fail on every rank
naming the tensor and the ranks, as on the control plane. Needs HVPS_STALL_CHECK_TIME_SECONDS (3 s in the
outer test) and every rank on one host."""

import os
import re
import time
import zlib

import numpy as np
import pytest
from hvps_testutil import DTYPES, all_inputs, check_allreduce_result, random_array

import hvps
from hvps.core.errors import HvpsError
from hvps.runtime import state

pytestmark = pytest.mark.timeout(120)

STALL = float(os.environ.get("HVPS_STALL_CHECK_TIME_SECONDS", "60"))


@pytest.fixture(scope="module", autouse=True)
def lane():
    hvps.init()
    lane = state.engine().fast_path.lane
    assert lane is not None, "every rank is on this host: the engine must have a fast lane"
    yield lane


def _allreduce(key, dtype, shape, op, name):
    size, rank = hvps.size(), hvps.rank()
    xs = all_inputs(dtype, shape, key, size, op=op)
    result = hvps.allreduce(xs[rank].copy(), op=getattr(hvps, op), name=name)
    check_allreduce_result(result, xs, op, size, what=f"{key} {name}")


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32", "int64"])
def test_synchronous_calls_take_the_lane_and_match_numpy(lane, dtype):
    posted, agreed = lane.posted, lane.agreed
    calls = 0
    for shape in [(0,), (1,), (7, 3), (4099,)]:
        for op in ("Sum", "Max"):
            name = f"lane.{dtype}.{op}.{shape}"
            _allreduce(f"first.{name}", DTYPES[dtype], shape, op, name)  # announced: now in the cache
            for step in range(3):
                _allreduce(f"{step}.{name}", DTYPES[dtype], shape, op, name)
                calls += 1
    root = hvps.size() - 1
    value = np.arange(5, dtype=DTYPES[dtype]) + hvps.rank()
    for _ in range(3):
        assert np.array_equal(hvps.broadcast(value.copy(), root, name=f"lane.bcast.{dtype}"),
                              np.arange(5, dtype=DTYPES[dtype]) + root)
        calls += 1
    # a call the engine thread took before its waiter could goes the usual way: most, not all, take the lane
    assert lane.posted - posted > calls // 2 and lane.agreed > agreed, (lane.posted - posted, lane.agreed - agreed)


def _rows(key, rank, most=5):
    """A rank's rows for ``key``: fresh on every call, zero among them."""
    return int(np.random.default_rng(zlib.crc32(f"{key}#{rank}".encode())).integers(0, most + 1))


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "int32"])
def test_allgather_and_alltoall_of_new_rows_every_step_take_the_lane_and_match_numpy(lane, dtype):
    size, rank = hvps.size(), hvps.rank()
    agreed = lane.agreed
    dt = DTYPES[dtype]
    for step in range(6):  # every rank's rows change every step: the form's bit, not the request's, agrees
        key = f"sized.{dtype}.{step}"
        rows = [_rows(key, r) for r in range(size)]
        parts = [random_array(dt, (rows[r], 3), key, r) for r in range(size)]
        gathered = hvps.allgather(parts[rank].copy(), name=f"lane.gather.{dtype}")
        assert gathered.dtype == dt and np.array_equal(gathered, np.concatenate(parts)), (key, rows)
        out = np.empty((sum(rows), 3), dt)
        assert hvps.allgather(parts[rank].copy(), name=f"lane.gather.out.{dtype}", out=out) is out
        assert np.array_equal(out, np.concatenate(parts)), (key, rows)
        splits = [[_rows(f"{key}.{src}.{dst}", 0, 3) for dst in range(size)] for src in range(size)]
        sent = [random_array(dt, (sum(splits[r]), 2), f"{key}.a2a", r) for r in range(size)]
        received, counts = hvps.alltoall(sent[rank].copy(), splits[rank], name=f"lane.alltoall.{dtype}")
        starts = [np.cumsum([0] + splits[src])[rank] for src in range(size)]
        expected = np.concatenate([sent[src][starts[src]:starts[src] + splits[src][rank]] for src in range(size)])
        assert list(counts) == [splits[src][rank] for src in range(size)], (key, splits)
        assert received.dtype == dt and np.array_equal(received, expected), (key, splits)
    assert lane.agreed > agreed, "the lane took none of the allgathers and alltoalls after the first step"


def test_a_large_alltoall_is_agreed_in_the_lane_and_runs_in_many_rounds(lane):
    size, rank = hvps.size(), hvps.rank()
    block = 200_000  # rows of 2 float64: 3.2 MB to each rank, more than its region of a 4 MiB buffer
    sent = [np.random.default_rng(src).random((size * block, 2)) for src in range(size)]
    expected = np.concatenate([s[rank * block:(rank + 1) * block] for s in sent])
    took = False
    for _ in range(30):  # ranks leave a large call at different times: on a loaded machine the lane may miss some
        agreed = lane.agreed
        received, counts = hvps.alltoall(sent[rank].copy(), name="lane.alltoall.big")
        assert list(counts) == [block] * size and np.array_equal(received, expected)
        took = lane.agreed > agreed  # this alltoall went through the lane (on every rank, or on none)
        if hvps.allreduce(np.array([took], np.int32), op=hvps.Max, name="lane.big.took")[0]:
            break  # the ranks leave the loop together
    assert took, "none of 30 large alltoalls was agreed in the lane"


def test_an_allgather_out_of_the_wrong_rows_fails_on_every_rank_through_the_lane():
    size, rank = hvps.size(), hvps.rank()
    name = "lane.gather.short"
    for _ in range(2):  # the form is cached
        hvps.allgather(np.ones((2, 4), np.float32), name=name, out=np.empty((2 * size, 4), np.float32))
    rows = 2 * size - (1 if rank == size - 1 else 0)  # the last rank's out is one row short
    with pytest.raises(HvpsError, match="rows add up to") as error:
        hvps.allgather(np.ones((2, 4), np.float32), name=name, out=np.empty((rows, 4), np.float32))
    _assert_names(str(error.value), f"allgather.{name}", [size - 1])
    gathered = hvps.allgather(np.full((1, 4), rank, np.float32), name=name)
    assert np.array_equal(gathered[:, 0], np.arange(size, dtype=np.float32))


def test_an_allgather_of_another_dtype_on_one_rank_fails_on_every_rank_naming_it():
    size, rank = hvps.size(), hvps.rank()
    name = "lane.gather.dtype"
    for _ in range(2):
        hvps.allgather(np.ones(3, np.float32), name=name)
    dtype = np.float64 if rank == size - 1 else np.float32
    with pytest.raises(HvpsError, match="different arguments") as error:
        hvps.allgather(np.ones(3, dtype), name=name)
    _assert_names(str(error.value), f"allgather.{name}", [size - 1])


@pytest.mark.parametrize("late", ["rank 0", "the last rank"])
def test_a_late_rank_falls_back_and_the_lane_resumes(lane, late):
    late_rank = 0 if late == "rank 0" else hvps.size() - 1
    name = f"lane.late.{late_rank}"
    _allreduce("late.first", np.float32, (33,), "Sum", name)
    for step in range(3):
        if hvps.rank() == late_rank:
            time.sleep(0.2)  # 100 times the lane's wait: the others' posts are settled without it
        _allreduce(f"late.{step}", np.float32, (33,), "Sum", name)
    agreed = lane.agreed
    for step in range(20):
        _allreduce(f"after.{step}", np.float32, (33,), "Sum", name)
    assert lane.agreed > agreed, "the lane was not taken again after the fallbacks"


@pytest.mark.parametrize("late", ["rank 0", "the last rank"])
def test_after_a_late_rank_alltoalls_alone_take_the_lane_again(lane, late):
    # posts of rows wait until every rank has read the last ones in their area: a rank that fell back must not
    # keep the others (or itself) from posting rows ever again
    size, rank = hvps.size(), hvps.rank()
    late_rank = 0 if late == "rank 0" else size - 1
    name = f"lane.late.alltoall.{late_rank}"

    def alltoall(step):
        rows = [(step + src + dst) % 3 for src in range(size) for dst in range(size)]
        received, _ = hvps.alltoall(np.full(sum(rows[rank * size:(rank + 1) * size]), rank, np.int64),
                                    rows[rank * size:(rank + 1) * size], name=name)
        assert list(received) == [src for src in range(size) for _ in range(rows[src * size + rank])]

    alltoall(0)
    for step in range(3):
        if rank == late_rank:
            time.sleep(0.2)
        alltoall(step)
    agreed = lane.agreed
    for step in range(20):
        alltoall(step)
    assert lane.agreed > agreed, "no alltoall took the lane again after the fallbacks"


def _assert_names(message, name, ranks):
    assert name in message, f"tensor name {name!r} missing from the error: {message!r}"
    for r in ranks:
        assert re.search(rf"(?<![\w.]){r}(?![\w.])", message), f"rank {r} not named in the error: {message!r}"


def test_cached_names_in_different_orders_fail_on_every_rank_naming_them():
    size, rank = hvps.size(), hvps.rank()
    for name in ("lane.p", "lane.q"):  # both cached, on every rank
        hvps.allreduce(np.ones(3, np.float32), name=name)
    mine, other = ("lane.p", "lane.q") if rank == 0 else ("lane.q", "lane.p")
    start = time.monotonic()
    with pytest.raises(HvpsError) as error:
        hvps.allreduce(np.ones(3, np.float32), name=mine)
    assert time.monotonic() - start < 3 * STALL + 10
    missing = [r for r in range(size) if r != 0] if rank == 0 else [0]
    _assert_names(str(error.value), f"allreduce.{mine}", missing)
    _allreduce("after.order", np.float32, (9,), "Sum", "lane.after.order")


def test_a_shape_changed_on_one_rank_fails_on_every_rank_naming_it():
    size, rank = hvps.size(), hvps.rank()
    name = "lane.shape"
    hvps.allreduce(np.ones(5, np.float32), name=name)  # cached as (5,) everywhere
    shape = (6,) if rank == size - 1 else (5,)
    with pytest.raises(HvpsError, match="different arguments") as error:
        hvps.allreduce(np.ones(shape, np.float32), name=name)
    _assert_names(str(error.value), f"allreduce.{name}", [size - 1])
    _allreduce("after.shape", np.float32, (9,), "Sum", "lane.after.shape")
