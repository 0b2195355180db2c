"""How the node's shared-memory plane sits beside a flat plane that takes device tensors (``NodeFirst``),
in one process: host buffers through the segment, device ones (a ``meta`` tensor stands in for CUDA) on
the flat plane, process sets on the flat plane, and the flat plane closed once."""

import os

import numpy as np
import pytest

from hvps.core.dtypes import ReduceOp
from hvps.dataplane.backends.base import Backend
from hvps.dataplane.backends.node_plane import NodeFirst
from hvps.dataplane.backends.shm import ShmBackend, open_segment
from hvps.dataplane.shm_segment import SHM_DIR

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")]


class OneRank:
    """The calls ``open_segment`` makes on a local communicator, for a node of one rank."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def bcast(self, value, root=0):
        return value

    def allgather(self, value):
        return [value]


class FlatPlane(Backend):
    """A flat plane of one rank that takes CPU and device tensors and writes down what reaches it."""

    name = "flat"
    supports_process_sets = True

    def __init__(self):
        self.calls, self.closed = [], 0

    def takes(self, device, dtype):
        return True

    def allreduce(self, sendbuf, recvbuf, op):
        self.calls.append(("allreduce", str(recvbuf.device)))

    def allgatherv(self, sendbuf, recvbuf, counts):
        self.calls.append(("allgatherv", str(recvbuf.device)))

    def broadcast(self, buf, root):
        self.calls.append(("broadcast", str(buf.device)))

    def alltoallv(self, sendbuf, sendcounts, recvbuf, recvcounts):
        self.calls.append(("alltoallv", "cpu" if isinstance(recvbuf, np.ndarray) else str(recvbuf.device)))

    def reducescatter(self, sendbuf, recvbuf, counts, op):
        self.calls.append(("reducescatter", str(recvbuf.device)))

    def sendrecv(self, sendbuf, dest, recvbuf, source):
        self.calls.append(("sendrecv", "cpu" if isinstance(recvbuf, np.ndarray) else str(recvbuf.device)))

    def subset(self, ranks):
        self.calls.append(("subset", ranks))
        return self

    def close(self, failed=False):
        self.closed += 1


def test_host_buffers_go_through_shared_memory_and_device_ones_stay_on_the_flat_plane():
    torch = pytest.importorskip("torch")
    segment, reason = open_segment(OneRank(), 4096, 5.0)
    assert segment is not None, reason
    flat = FlatPlane()
    plane = NodeFirst(ShmBackend(segment, flat), flat)
    assert plane.name == "shm"
    assert plane.takes("cpu", "float32") and plane.takes("cuda", "float32"), "the flat plane's tensors stay taken"

    host = torch.arange(5000, dtype=torch.float32)  # a CPU tensor: read through a numpy view, in rounds
    out = torch.empty_like(host)
    plane.allreduce(host, out, ReduceOp.Sum)
    assert torch.equal(out, host)
    array = np.arange(7.0)
    plane.broadcast(array, 0)
    assert flat.calls == [], "host buffers must not reach the flat plane"

    swapped = np.empty_like(array)
    plane.alltoallv(array, [7], swapped, [7])
    assert np.array_equal(swapped, array) and flat.calls == [], "a host alltoall goes through shared memory too"
    device = torch.empty(4, device="meta")
    plane.allreduce(device, device, ReduceOp.Sum)
    plane.sendrecv(array, 0, array.copy(), 0)
    assert flat.calls == [("allreduce", "meta"), ("sendrecv", "cpu")]
    assert plane.supports_process_sets and plane.subset((0,)) is flat
    plane.close()
    assert flat.closed == 1, "the shared-memory plane owns the flat one: closed once"


def test_a_waiter_may_run_what_runs_on_the_segment_at_any_size_and_the_rest_up_to_the_flat_planes_limit():
    segment, reason = open_segment(OneRank(), 4096, 5.0)
    assert segment is not None, reason
    flat = FlatPlane()
    flat.interruptible_bytes = 1024
    plane = ShmBackend(segment, flat)
    try:
        for method in ("allreduce", "allgatherv", "alltoallv", "broadcast", "reducescatter"):
            assert plane.interruptible_bytes_for(method) >= 1 << 40, method
        assert plane.interruptible_bytes_for("sendrecv") == 1024
        assert ShmBackend(segment, None).interruptible_bytes_for("sendrecv") == 0
    finally:
        plane.close()
