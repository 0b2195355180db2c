"""The mpi4py data plane: MPI's native collectives, or hvps's ring for allreduce.

With a CUDA-aware MPI (Open MPI's ``MPIX_Query_cuda_support``), CUDA tensors
of MPI's native types are handed to MPI as they are (mpi4py reads their
``__cuda_array_interface__``), each right after the host has waited for the
engine's stream (``wire``); otherwise the torch adapter stages them through
host memory.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import numpy as np
from mpi4py import MPI

from ...core import arrays, dtypes
from ...core.dtypes import ReduceOp, quiet_arithmetic
from ..buffers import FusionBuffer
from ..ring import ring_allreduce, wait_all
from .base import Backend, sub_communicator
from .device import cuda_order, settle

#: dtype -> (numpy carrier dtype, MPI datatype). Half types travel as 16-bit words
#: and are reduced by user-defined ops, since MPI has no float16 or bfloat16.
_WIRE = {
    np.dtype(np.float32): (np.float32, MPI.FLOAT),
    np.dtype(np.float64): (np.float64, MPI.DOUBLE),
    np.dtype(np.int8): (np.int8, MPI.INT8_T),
    np.dtype(np.int16): (np.int16, MPI.INT16_T),
    np.dtype(np.int32): (np.int32, MPI.INT32_T),
    np.dtype(np.int64): (np.int64, MPI.INT64_T),
    np.dtype(np.uint8): (np.uint8, MPI.UINT8_T),
    np.dtype(np.uint16): (np.uint16, MPI.UINT16_T),
    np.dtype(np.bool_): (np.bool_, MPI.C_BOOL),
    np.dtype(np.float16): (np.uint16, MPI.UINT16_T),
    dtypes.bfloat16: (np.uint16, MPI.UINT16_T),
}
_NATIVE_OPS = {ReduceOp.Sum: MPI.SUM, ReduceOp.Min: MPI.MIN, ReduceOp.Max: MPI.MAX, ReduceOp.Product: MPI.PROD}
_BOOL_OPS = {ReduceOp.Sum: MPI.LOR, ReduceOp.Max: MPI.LOR, ReduceOp.Min: MPI.LAND, ReduceOp.Product: MPI.LAND}


def wire(array):
    """The ``[buffer, datatype]`` spec MPI needs for a contiguous array (or CUDA tensor) of a supported dtype.

    A CUDA tensor is handed over once its stream has run what is queued on it: MPI reads and writes
    device memory from this thread at once, while the fusion packing, prescale or broadcast's copy
    that the executor queued just before may still be running on the engine's stream (issue 43,
    finding 3). Every MPI call of this backend builds its buffers here, right before the call.
    """
    if not arrays.is_numpy(array):
        settle(array)
        return [array, _WIRE[dtypes.BY_NAME[arrays.dtype_name(array)]][1]]
    carrier, datatype = _WIRE[array.dtype]
    return [array.view(carrier), datatype]


def cuda_aware() -> bool:
    """Whether this MPI takes CUDA device buffers (Open MPI's extension; False where it is absent)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return False
    query = getattr(ctypes.CDLL(None), "MPIX_Query_cuda_support", None)
    return bool(query and query())


@functools.lru_cache(maxsize=None)
def _half_op(dtype_name: str, op: ReduceOp) -> MPI.Op:
    dtype = dtypes.BY_NAME[dtype_name]
    ufunc = dtypes.combine(op, dtype)

    def reduce(inbuf, inoutbuf, datatype):  # MPI calls: inoutbuf = inbuf (op) inoutbuf
        acc = np.frombuffer(inoutbuf, dtype=dtype)
        with quiet_arithmetic():
            ufunc(np.frombuffer(inbuf, dtype=dtype), acc, out=acc)

    return MPI.Op.Create(reduce, commute=True)


def mpi_op(dtype: np.dtype, op: ReduceOp) -> MPI.Op:
    """The MPI reduction for ``op`` on ``dtype`` (Average must already be a Sum)."""
    if dtype == np.bool_:
        return _BOOL_OPS[op]
    if dtype in (np.float16, dtypes.bfloat16):
        return _half_op(dtypes.SUPPORTED[dtype], op)
    return _NATIVE_OPS[op]


def _dtype(array) -> np.dtype:
    return dtypes.BY_NAME[arrays.dtype_name(array)]


def _displacements(counts: list) -> list:
    return [int(x) for x in np.concatenate(([0], np.cumsum(counts)[:-1]))] if counts else []


#: host collectives of at most this many bytes (the same count on every rank) run as MPI's non-blocking
#: collectives, polled until done, so that they stop at once when ranks are lost (``interrupt_on``): the
#: engine lets a waiting thread run those itself. Above it MPI's blocking calls win (1 MiB allreduces).
NONBLOCKING_BYTES = 256 << 10


class MPIBackend(Backend):
    """Collectives through mpi4py's buffer methods on a private duplicate communicator."""

    name = "mpi"
    supports_process_sets = True
    interruptible_bytes = NONBLOCKING_BYTES

    def __init__(self, comm: MPI.Comm, settings, owned: bool = False) -> None:
        """On a duplicate of ``comm``, or on ``comm`` itself when ``owned`` (a communicator made for it)."""
        self.settings = settings
        self.comm = comm if owned else comm.Dup()
        self.algorithm = settings.algorithm
        self.ring_chunk_bytes = settings.ring_chunk_bytes
        self.timeout = settings.stall_fail_seconds
        self.workspace = FusionBuffer()
        self.cuda_aware = cuda_aware()
        self.abort = None
        self._others = [r for r in range(self.comm.Get_size()) if r != self.comm.Get_rank()]

    def interrupt_on(self, event):
        self.abort = event

    @staticmethod
    def _polled(array) -> bool:
        """Whether a collective over ``array`` (its size the same on every rank) runs non-blocking."""
        return arrays.is_numpy(array) and array.nbytes <= NONBLOCKING_BYTES

    def _call(self, method: str, polled: bool, *args, **kwargs) -> None:
        """``comm.<method>(...)``, or when ``polled`` its non-blocking twin (``Iallreduce`` for
        ``Allreduce``) waited for by polling, so that it gives up once ``abort`` is set."""
        if not polled:
            getattr(self.comm, method)(*args, **kwargs)
            return
        request = getattr(self.comm, "I" + method.lower())(*args, **kwargs)
        wait_all([request], self._others, self.timeout, self.abort, f"MPI {method}", point_to_point=False)

    def takes(self, device, dtype):
        # User-defined reductions (float16, bfloat16) run on the host: those are staged.
        return device == "cuda" and self.cuda_aware and dtype not in ("float16", "bfloat16")

    def ordered(self, entries):
        # Only a CUDA-aware MPI ever gets device tensors; otherwise nothing to order.
        return cuda_order(entries, host_sync=True) if self.cuda_aware else super().ordered(entries)

    def allreduce(self, sendbuf, recvbuf, op):
        polled = self._polled(recvbuf)
        if self.algorithm == "ring" and arrays.is_numpy(recvbuf) and not polled:  # small ones: MPI's is faster
            ring_allreduce(self.comm, sendbuf.reshape(-1), recvbuf.reshape(-1), dtypes.combine(op, recvbuf.dtype),
                           wire, self.ring_chunk_bytes, self.timeout, self.workspace.view, self.abort)
            return
        send = MPI.IN_PLACE if arrays.same_address(sendbuf, recvbuf) else wire(sendbuf)
        self._call("Allreduce", polled, send, wire(recvbuf), op=mpi_op(_dtype(recvbuf), op))

    def allgatherv(self, sendbuf, recvbuf, counts):
        carrier, datatype = wire(recvbuf)
        self._call("Allgatherv", self._polled(recvbuf), wire(sendbuf),
                   [carrier, (counts, _displacements(counts)), datatype])

    def broadcast(self, buf, root):
        self._call("Bcast", self._polled(buf), wire(buf), root=root)

    def alltoallv(self, sendbuf, sendcounts, recvbuf, recvcounts):
        # Always non-blocking: the byte counts differ between ranks, and every rank must make the same
        # kind of call (MPI never matches a blocking collective with a non-blocking one). Measured as fast.
        send_carrier, datatype = wire(sendbuf)
        recv_carrier, _ = wire(recvbuf)
        send = [send_carrier, (sendcounts, _displacements(sendcounts)), datatype]
        receive = [recv_carrier, (recvcounts, _displacements(recvcounts)), datatype]
        self._call("Alltoallv", arrays.is_numpy(recvbuf) and arrays.is_numpy(sendbuf), send, receive)

    def reducescatter(self, sendbuf, recvbuf, counts, op):
        carrier, datatype = wire(recvbuf)
        self._call("Reduce_scatter", self._polled(sendbuf), wire(sendbuf), [carrier, datatype], recvcounts=counts,
                   op=mpi_op(_dtype(recvbuf), op))

    def sendrecv(self, sendbuf, dest, recvbuf, source):
        self.comm.Sendrecv(wire(sendbuf), dest, recvbuf=wire(recvbuf), source=source)

    def subset(self, ranks):
        subset = MPIBackend(sub_communicator(self.comm, ranks), self.settings, owned=True)
        subset.interrupt_on(self.abort)
        return subset

    def close(self, failed=False):
        self.comm.Free()
