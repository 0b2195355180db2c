"""Hierarchical allreduce (``HVPS_HIERARCHICAL_ALLREDUCE=1``), as Horovod's NCCL_HIERARCHICAL.

1. reduce-scatter within the node (shared memory or NCCL): local rank i holds
   the node's sum of segment i;
2. allreduce of that segment across nodes, among the ranks with local rank i
   (every local rank leads its own segment, so the cross-node traffic is spread
   over all of them instead of queueing at one leader per node);
3. allgather within the node, so every rank holds the whole result.

Each node moves ``(n-1)/n`` of the buffer across nodes once, instead of once
per rank. Other collectives run flat.
"""

from __future__ import annotations

from ...core import arrays
from ..buffers import FusionBuffer
from ..schedule import segments
from .base import Backend


class HierarchicalBackend(Backend):
    """Allreduce in three stages over ``local`` and ``cross``; the rest on ``flat``."""

    name = "hierarchical"

    def __init__(self, flat: Backend, local: Backend, cross: Backend, local_rank: int, local_size: int) -> None:
        self.flat, self.local, self.cross = flat, local, cross
        self.local_rank, self.local_size = local_rank, local_size
        self.workspace = FusionBuffer()  # the node's partial sums, reused across calls
        self.name = f"hierarchical-{flat.name}"

    @property
    def supports_process_sets(self) -> bool:
        return self.flat.supports_process_sets

    def takes(self, device, dtype):
        return self.flat.takes(device, dtype) and self.local.takes(device, dtype)

    def ordered(self, entries):
        return self.flat.ordered(entries)

    def interrupt_on(self, event):
        for backend in (self.local, self.cross, self.flat):
            backend.interrupt_on(event)

    def report_failures_to(self, failed):
        for backend in (self.local, self.cross, self.flat):
            backend.report_failures_to(failed)

    def allreduce(self, sendbuf, recvbuf, op):
        counts = [stop - start for start, stop in segments(arrays.numel(recvbuf), self.local_size)]
        shard = self.workspace.like(recvbuf, counts[self.local_rank])
        self.local.reducescatter(sendbuf, shard, counts, op)
        if arrays.numel(shard):  # same count on every rank of the cross group
            self.cross.allreduce(shard, shard, op)
        self.local.allgatherv(shard, recvbuf, counts)

    def allgatherv(self, sendbuf, recvbuf, counts):
        self.flat.allgatherv(sendbuf, recvbuf, counts)

    def broadcast(self, buf, root):
        self.flat.broadcast(buf, root)

    def alltoallv(self, sendbuf, sendcounts, recvbuf, recvcounts):
        self.flat.alltoallv(sendbuf, sendcounts, recvbuf, recvcounts)

    def reducescatter(self, sendbuf, recvbuf, counts, op):
        self.flat.reducescatter(sendbuf, recvbuf, counts, op)

    def sendrecv(self, sendbuf, dest, recvbuf, source):
        self.flat.sendrecv(sendbuf, dest, recvbuf, source)

    def subset(self, ranks):
        return self.flat.subset(ranks)  # a process set reduces flat

    def close(self, failed=False):
        for backend in (self.local, self.cross, self.flat):
            backend.close(failed)
