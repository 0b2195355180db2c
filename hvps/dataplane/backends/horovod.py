"""Delegate the data plane to an installed Horovod (``HVPS_BACKEND=horovod``).

hvps keeps its own negotiation, fusion and error reporting; each agreed
collective is handed to ``horovod.torch`` on the same tensors (numpy arrays as
zero-copy tensor views). Running hvps's multi-rank suite on this backend checks
that both agree. Horovod 0.28.1 (the latest on PyPI) does not build against
torch 2.13, so this needs a Horovod built for the installed PyTorch.
"""

from __future__ import annotations

import itertools

from ...core import arrays
from ...core.dtypes import ReduceOp
from ...core.errors import HvpsError
from ...core.views import as_tensor
from .base import Backend
from .device import cuda_order

UNAVAILABLE = ("Horovod is not importable: horovod 0.28.1 from PyPI does not build against torch 2.13; "
               "install a Horovod built for this PyTorch to use HVPS_BACKEND=horovod")


def load():
    """``horovod.torch``, or HvpsError saying why it cannot be used."""
    try:
        import horovod.torch as hvd
    except Exception as exc:  # ImportError, or a Horovod built for another torch failing to load
        raise HvpsError(f"{UNAVAILABLE} ({exc})") from None
    return hvd


class HorovodBackend(Backend):
    """Collectives through ``horovod.torch`` on a Horovod initialised over the same communicator."""

    name = "horovod"

    def __init__(self, comm, settings) -> None:
        self.hvd = load()
        self.comm = comm.Dup()
        self.hvd.init(comm=self.comm)
        self._names = itertools.count()

    def _name(self, kind: str) -> str:
        return f"hvps.{kind}.{next(self._names)}"  # every rank runs the same calls in the same order

    def takes(self, device, dtype):
        return True

    def ordered(self, entries):
        # CUDA tensors run on the engine's stream of their device, after their producers' ready events:
        # Horovod records its own ready event on that (current) stream, and hvps's done event follows its
        # synchronous op (issue 43, finding 11). NCCL or MPI inside Horovod never read on the host here.
        return cuda_order(entries, host_sync=False)

    def _op(self, op: ReduceOp, tensor):
        import torch

        hvd = self.hvd
        if tensor.dtype == torch.bool:  # or / and on 0-1 bytes
            return (tensor.view(torch.uint8),
                    hvd.Max if op in (ReduceOp.Sum, ReduceOp.Max) else hvd.Min)
        return tensor, {ReduceOp.Sum: hvd.Sum, ReduceOp.Min: hvd.Min, ReduceOp.Max: hvd.Max,
                        ReduceOp.Product: hvd.Product}[op]

    def allreduce(self, sendbuf, recvbuf, op):
        send, recv = as_tensor(sendbuf), as_tensor(recvbuf)
        if send.data_ptr() != recv.data_ptr():
            recv.copy_(send)
        wire, hvd_op = self._op(op, recv)
        self.hvd.allreduce_(wire, op=hvd_op, name=self._name("allreduce"))

    def allgatherv(self, sendbuf, recvbuf, counts):
        recv = as_tensor(recvbuf)
        recv.copy_(self.hvd.allgather(as_tensor(sendbuf), name=self._name("allgather")))

    def broadcast(self, buf, root):
        self.hvd.broadcast_(as_tensor(buf), root, name=self._name("broadcast"))

    def alltoallv(self, sendbuf, sendcounts, recvbuf, recvcounts):
        import torch

        result = self.hvd.alltoall(as_tensor(sendbuf), splits=torch.tensor(sendcounts, dtype=torch.int32),
                                   name=self._name("alltoall"))
        as_tensor(recvbuf).copy_(result[0] if isinstance(result, tuple) else result)

    def reducescatter(self, sendbuf, recvbuf, counts, op):
        # Horovod's own reducescatter splits dim 0 its way; a full allreduce keeps any split exact.
        total = arrays.copy_of(as_tensor(sendbuf))
        self.allreduce(total, total, op)
        start = sum(counts[: self.comm.Get_rank()])
        as_tensor(recvbuf).copy_(total[start : start + counts[self.comm.Get_rank()]])

    def close(self, failed=False):
        self.hvd.shutdown()
        self.comm.Free()
