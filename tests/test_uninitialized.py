"""Single-process unit tests that run in the outer pytest process, which never
calls hvps.init() (all initialising tests run in subprocesses)."""

import numpy as np
import pytest

import hvps

pytestmark = pytest.mark.unit

MSG = "hvps is not initialized: call hvps.init()"

X = np.arange(6, dtype=np.float32)

CALLS = {
    "rank": lambda: hvps.rank(),
    "size": lambda: hvps.size(),
    "local_rank": lambda: hvps.local_rank(),
    "local_size": lambda: hvps.local_size(),
    "cross_rank": lambda: hvps.cross_rank(),
    "cross_size": lambda: hvps.cross_size(),
    "allreduce": lambda: hvps.allreduce(X, op=hvps.Sum),
    "allreduce_async": lambda: hvps.allreduce_async(X, op=hvps.Sum),
    "grouped_allreduce": lambda: hvps.grouped_allreduce([X, X], op=hvps.Sum),
    "grouped_allreduce_async": lambda: hvps.grouped_allreduce_async([X], op=hvps.Sum),
    "allgather": lambda: hvps.allgather(X),
    "allgather_async": lambda: hvps.allgather_async(X),
    "broadcast": lambda: hvps.broadcast(X, root_rank=0),
    "broadcast_async": lambda: hvps.broadcast_async(X, root_rank=0),
    "alltoall": lambda: hvps.alltoall(X),
    "alltoall_async": lambda: hvps.alltoall_async(X),
    "reducescatter": lambda: hvps.reducescatter(X, op=hvps.Sum),
    "reducescatter_async": lambda: hvps.reducescatter_async(X, op=hvps.Sum),
    "barrier": lambda: hvps.barrier(),
    "broadcast_object": lambda: hvps.broadcast_object({"a": 1}, root_rank=0),
    "allgather_object": lambda: hvps.allgather_object([1, 2]),
}


def test_not_initialized_flag():
    assert hvps.is_initialized() is False


@pytest.mark.parametrize("name", list(CALLS))
def test_op_before_init_raises(name):
    with pytest.raises(hvps.HvpsError) as ei:
        CALLS[name]()
    assert str(ei.value) == MSG
    assert isinstance(ei.value, RuntimeError)
    assert hvps.is_initialized() is False


def test_error_type_and_ops():
    assert issubclass(hvps.HvpsError, RuntimeError)
    ops = [hvps.Sum, hvps.Average, hvps.Min, hvps.Max, hvps.Product]
    assert len(set(ops)) == 5
    for op in ops:
        assert isinstance(op, hvps.ReduceOp)
        assert op in set(hvps.ReduceOp)


def test_shutdown_without_init_is_harmless():
    hvps.shutdown()
    assert hvps.is_initialized() is False
