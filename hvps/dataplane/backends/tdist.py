"""The torch.distributed data plane: gloo for CPU buffers, NCCL for CUDA tensors.

Bootstrapped from the job's communicator (MPI's, or the store communicator of a job
started without MPI): rank 0 starts a ``TCPStore`` on a free port and broadcasts
its address over it. Process groups are private to hvps (built directly, never the
default group), so a script may use ``torch.distributed`` itself beside it.
The NCCL group is created the first time a CUDA tensor arrives; every rank
executes responses in the same order, so that creation is collective too.

Numpy arrays travel as zero-copy tensor views; CUDA tensors never leave the
device. On CUDA the engine thread enqueues work on its own stream ordered
after each submission's ready event (see ``device.py``): NCCL's ``wait()``
only orders streams, so no call here blocks the host on the GPU.
"""

from __future__ import annotations

import datetime
import socket

from ...control.plane import candidate_addresses, listen_address, reachable
from ...core.dtypes import ReduceOp
from ...core.errors import HvpsError
from ...core.views import as_tensor
from .base import Backend, sub_communicator
from .device import cuda_order


def _widened(tensor):
    """An int32 copy of an int16 or uint16 tensor (gloo and NCCL cannot reduce 16-bit integers), else None.

    Reduced as int32 and narrowed back, sums and products wrap modulo 2**16 as 16-bit arithmetic would.
    """
    import torch

    return tensor.to(torch.int32) if tensor.dtype in (torch.int16, torch.uint16) else None


def _moved(array):
    """``as_tensor(array)``, 16-bit integers seen as float16: gloo and NCCL have none, and
    moving bytes needs only a carrier of the same width (nothing is computed on it)."""
    import torch

    tensor = as_tensor(array)
    return tensor.view(torch.float16) if tensor.dtype in (torch.int16, torch.uint16) else tensor


class TorchDistBackend(Backend):
    """Collectives on private torch.distributed process groups (gloo on CPU, NCCL on CUDA)."""

    name = "tdist"
    supports_process_sets = True

    def __init__(self, comm, settings, owned: bool = False) -> None:
        import torch.distributed as dist

        if not dist.is_available():
            raise HvpsError("HVPS_BACKEND=tdist needs a PyTorch build with torch.distributed")
        self.dist = dist
        self.settings = settings
        self.comm = comm if owned else comm.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.timeout = datetime.timedelta(seconds=max(1.0, settings.stall_fail_seconds))
        self._groups: dict = {}
        store = None
        if self.rank == 0:
            # Bound to HVPS_NETWORK_INTERFACE when set; torch's store has no authentication (SECURITY.md).
            self._listener = socket.create_server((listen_address(), 0), backlog=max(self.size, 128))
            # the master's own client connects where the listener is bound ("0.0.0.0": anywhere local)
            host, port = self._listener.getsockname()[:2]
            store = dist.TCPStore(host, port, self.size, True, self.timeout, wait_for_workers=False,
                                  master_listen_fd=self._listener.fileno())
            offer = (candidate_addresses(), store.port)
        else:
            offer = None
        addresses, port = self.comm.bcast(offer, root=0)
        if self.rank == 0:
            self.address = addresses[0]
        else:
            master, self.address = reachable(addresses, port, "rank 0's torch.distributed store")
            store = dist.TCPStore(master, port, self.size, False, self.timeout)
        self.store = store

    # -- process groups ---------------------------------------------------------------
    def _group(self, device: str):
        group = self._groups.get(device)
        if group is None:
            group = self._groups[device] = self._create_group(device)
        return group

    def _create_group(self, device: str):
        dist = self.dist
        prefix = dist.PrefixStore(f"hvps/{device}", self.store)
        if device == "cuda":
            if not dist.is_nccl_available():
                raise HvpsError("CUDA tensors on HVPS_BACKEND=tdist need NCCL, and this PyTorch has none")
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            return dist.ProcessGroupNCCL(prefix, self.rank, self.size, options)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = self.timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.address)]
        return dist.ProcessGroupGloo(prefix, self.rank, self.size, options)

    def takes(self, device: str, dtype: str) -> bool:
        return device == "cpu" or (device == "cuda" and self.dist.is_nccl_available())

    def ordered(self, entries: list):
        return cuda_order(entries, host_sync=False)

    # -- collectives ------------------------------------------------------------------
    def _run(self, what: str, tensor, start) -> None:
        """Run ``start(group)`` (which returns a Work) and wait for it, naming the failure."""
        try:
            start(self._group(tensor.device.type)).wait()
        except RuntimeError as exc:
            raise HvpsError(
                f"torch.distributed {what} failed on rank {self.rank} (a rank died, a link is down, or nothing "
                f"moved for HVPS_STALL_CHECK_TIME_SECONDS={self.timeout.total_seconds():g} s): {exc}"
            ) from exc

    def _reduce_options(self, options, tensor, op: ReduceOp):
        """``options`` with the reduction set; bool reduces as uint8 max (or) / min (and)."""
        dist = self.dist
        import torch

        if tensor.dtype == torch.bool:
            tensor = tensor.view(torch.uint8)
            reduce_op = dist.ReduceOp.MAX if op in (ReduceOp.Sum, ReduceOp.Max) else dist.ReduceOp.MIN
        else:
            reduce_op = {ReduceOp.Sum: dist.ReduceOp.SUM, ReduceOp.Min: dist.ReduceOp.MIN,
                         ReduceOp.Max: dist.ReduceOp.MAX, ReduceOp.Product: dist.ReduceOp.PRODUCT}[op]
        options.reduceOp = reduce_op
        return options, tensor

    def allreduce(self, sendbuf, recvbuf, op):
        send, recv = as_tensor(sendbuf), as_tensor(recvbuf)
        wide = _widened(send)
        if wide is not None:
            self.allreduce(wide, wide, op)
            recv.copy_(wide)
            return
        if send.data_ptr() != recv.data_ptr():
            recv.copy_(send)
        options, wire = self._reduce_options(self.dist.AllreduceOptions(), recv, op)
        self._run("allreduce", recv, lambda group: group.allreduce([wire], options))

    def allgatherv(self, sendbuf, recvbuf, counts):
        send, recv = _moved(sendbuf), _moved(recvbuf)
        widest = max(counts, default=0)
        if widest == 0:
            return
        if all(c == widest for c in counts):
            self._run("allgather", recv, lambda group: group._allgather_base(recv, send))
            return
        # gloo and NCCL gather equal blocks: pad every rank's block to the widest.
        padded = send.new_zeros(widest)
        padded[: send.numel()] = send
        gathered = send.new_empty(widest * self.size)
        self._run("allgather", recv, lambda group: group._allgather_base(gathered, padded))
        offset = 0
        for r, count in enumerate(counts):
            recv[offset : offset + count] = gathered[r * widest : r * widest + count]
            offset += count

    def broadcast(self, buf, root):
        tensor = _moved(buf)
        options = self.dist.BroadcastOptions()
        options.rootRank = root
        self._run("broadcast", tensor, lambda group: group.broadcast([tensor], options))

    def alltoallv(self, sendbuf, sendcounts, recvbuf, recvcounts):
        send, recv = _moved(sendbuf), _moved(recvbuf)
        options = self.dist.AllToAllOptions()
        self._run("alltoall", recv, lambda group: group.alltoall_base(
            recv, send, list(recvcounts), list(sendcounts), options))

    def reducescatter(self, sendbuf, recvbuf, counts, op):
        send, recv = as_tensor(sendbuf), as_tensor(recvbuf)
        wide = _widened(recv)
        if wide is not None:
            self.reducescatter(_widened(send), wide, counts, op)
            recv.copy_(wide)
            return
        options, wire_recv = self._reduce_options(self.dist.ReduceScatterOptions(), recv, op)
        wire_send = send.view(wire_recv.dtype)
        blocks = list(wire_send.split([int(c) for c in counts]))
        self._run("reducescatter", recv, lambda group: group.reduce_scatter([wire_recv], [blocks], options))

    def sendrecv(self, sendbuf, dest, recvbuf, source):
        send, recv = _moved(sendbuf), _moved(recvbuf)
        group = self._group(recv.device.type)
        sending = group.send([send], dest, 0)
        try:
            group.recv([recv], source, 0).wait()
            sending.wait()
        except RuntimeError as exc:
            raise HvpsError(f"torch.distributed send/recv failed on rank {self.rank}: {exc}") from exc

    def subset(self, ranks):
        # the set's own store and process groups, bootstrapped over a sub-communicator
        return TorchDistBackend(sub_communicator(self.comm, ranks), self.settings, owned=True)

    def close(self, failed=False):
        for group in self._groups.values():
            # a failed NCCL communicator is aborted, never destroyed: destroying it waits for peers that
            # are gone (torch's ProcessGroupNCCL.abort); gloo's pairs just close
            ending = getattr(group, "abort", None) if failed else None
            try:
                (ending or group.shutdown)()
            except (AttributeError, RuntimeError):
                pass
        self._groups.clear()
        self.comm.Free()
