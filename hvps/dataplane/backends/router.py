"""``HVPS_BACKEND=auto`` on a GPU machine: CUDA tensors over NCCL, everything else over MPI."""

from __future__ import annotations

from ...core import arrays
from .base import Backend


class DeviceRouter(Backend):
    """Sends each buffer to the data plane for where it lives."""

    name = "auto"

    def __init__(self, host: Backend, device: Backend) -> None:
        self.host = host
        self.device = device

    def _for(self, buffer) -> Backend:
        return self.host if arrays.device_of(buffer) == "cpu" else self.device

    @property
    def supports_process_sets(self) -> bool:
        return self.host.supports_process_sets and self.device.supports_process_sets

    def takes(self, device, dtype):
        return device != "cpu" and self.device.takes(device, dtype)

    def ordered(self, entries):
        return self.device.ordered(entries)

    def interrupt_on(self, event):
        self.host.interrupt_on(event)
        self.device.interrupt_on(event)

    def report_failures_to(self, failed):
        self.host.report_failures_to(failed)
        self.device.report_failures_to(failed)

    def allreduce(self, sendbuf, recvbuf, op):
        self._for(recvbuf).allreduce(sendbuf, recvbuf, op)

    def allgatherv(self, sendbuf, recvbuf, counts):
        self._for(recvbuf).allgatherv(sendbuf, recvbuf, counts)

    def broadcast(self, buf, root):
        self._for(buf).broadcast(buf, root)

    def alltoallv(self, sendbuf, sendcounts, recvbuf, recvcounts):
        self._for(recvbuf).alltoallv(sendbuf, sendcounts, recvbuf, recvcounts)

    def reducescatter(self, sendbuf, recvbuf, counts, op):
        self._for(recvbuf).reducescatter(sendbuf, recvbuf, counts, op)

    def sendrecv(self, sendbuf, dest, recvbuf, source):
        self._for(recvbuf).sendrecv(sendbuf, dest, recvbuf, source)

    def subset(self, ranks):
        return DeviceRouter(self.host.subset(ranks), self.device.subset(ranks))

    def close(self, failed=False):
        self.host.close(failed)
        self.device.close(failed)
