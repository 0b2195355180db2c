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

NCCL fails asynchronously, after the call returned: ``NcclWatch`` follows
every NCCL Work and turns an error, or a collective that the GPU reached but
did not finish within HVPS_STALL_CHECK_TIME_SECONDS, into an HvpsError naming
the collective (the engine's failure: every handle gets it, elastic jobs
reset as on gloo), after aborting the NCCL groups; a rank lost on the control
plane aborts them too, so that no survivor stays blocked in a kernel. torch's
own watchdog is given no error handling (``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``
unless the user set it: its default 3 kills the process) and a timeout well
past hvps's (issue 43, finding 4).
"""

from __future__ import annotations

import collections
import datetime
import logging
import os
import socket
import threading
import time
from typing import Callable, Optional

from ...control.plane import candidate_addresses, listen_address, reachable
from ...core.dtypes import ReduceOp
from ...core.errors import DataPlaneStall, HvpsError
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


#: what hvps gives torch's NCCL process groups: no asynchronous error handling of torch's own (hvps's
#: NcclWatch aborts and reports instead; torch's default, 3, kills the process), unless the user set it
TORCH_NCCL_SETTINGS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
#: torch's NCCL timeout: this multiple of hvps's stall time, at least 10 minutes. torch counts from enqueue,
#: so a deep GPU queue could trip a short one on a healthy job; hvps's own limit counts from the GPU's turn
TORCH_NCCL_TIMEOUT_FACTOR, TORCH_NCCL_TIMEOUT_MIN_SECONDS = 10.0, 600.0
#: how gloo words its timeout (``Timed out waiting 3000ms for recv operation to complete``): torch raises it as a
#: plain RuntimeError (DistBackendError), as it does a closed connection
GLOO_TIMEOUT = "Timed out waiting"


class _TorchNcclSettings:
    """Set ``TORCH_NCCL_SETTINGS`` (those the user left unset) while a ProcessGroupNCCL is made, then restore."""

    def __enter__(self):
        self._set = [name for name in TORCH_NCCL_SETTINGS if name not in os.environ]
        for name in self._set:
            os.environ[name] = TORCH_NCCL_SETTINGS[name]
        return self

    def __exit__(self, *exc):
        for name in self._set:
            os.environ.pop(name, None)


class NcclWatch:
    """hvps's watchdog over its NCCL work.

    ``track`` takes each NCCL Work after its call returned. A daemon thread (``start``) calls ``check``
    every ``interval`` seconds: a Work with an exception, or the oldest unfinished one still unfinished
    ``timeout`` seconds after it became the oldest (the GPU had reached it: counted from then, not from
    enqueue), is an HvpsError naming the collective; the watch then aborts the NCCL groups (``abort``)
    and hands the error to ``failed`` (the engine's failure). Once ``lost`` (the engine's event for ranks
    lost on the control plane) is set, it aborts the groups at once.
    """

    def __init__(self, timeout: float, abort: Callable[[], None], rank: int = 0, interval: float = 0.2) -> None:
        self.timeout, self.interval, self.rank = timeout, interval, rank
        self._abort = abort
        self.lost: Optional[threading.Event] = None
        self.failed: Optional[Callable[[BaseException], None]] = None
        self._works: collections.deque = collections.deque()
        self._head_since: Optional[float] = None
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.aborted = False

    def track(self, what: str, names: str, work) -> None:
        with self._lock:
            self._works.append((what, names, work))
        if self._thread is None:
            self.start()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hvps-nccl-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            self._abort()

    def check(self, now: float) -> Optional[HvpsError]:
        """The error the NCCL work tracked so far amounts to at ``now``, if any (aborts on a lost rank)."""
        if self.lost is not None and self.lost.is_set():
            self.abort()
            return None  # the engine has failed every handle already, naming the lost ranks
        with self._lock:
            while self._works:
                what, names, work = self._works[0]
                try:
                    exc = work.exception()
                    done = exc is None and work.is_completed()
                except RuntimeError as err:  # is_completed raises the Work's error on some torch versions
                    exc, done = err, False
                if exc is not None:
                    return HvpsError(f"hvps: NCCL {what} {names!r} failed on rank {self.rank}: {exc}")
                if not done:
                    break
                self._works.popleft()
                self._head_since = now
            if not self._works:
                self._head_since = None
                return None
            if self._head_since is None:
                self._head_since = now
            if now - self._head_since > self.timeout:
                what, names, _ = self._works[0]
                return HvpsError(
                    f"hvps: NCCL {what} {names!r} did not finish on rank {self.rank} within {self.timeout:g} s of "
                    "reaching the GPU (a rank died, a link is down, or ranks run different collectives; "
                    "HVPS_STALL_CHECK_TIME_SECONDS sets the limit)")
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            error = self.check(time.monotonic())
            if error is not None:
                logging.getLogger("hvps").error("%s; aborting the NCCL communicators", error)
                self.abort()
                if self.failed is not None:
                    self.failed(error)
                return


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
        #: hvps's limit for a collective the GPU reached; torch's own, counted from enqueue, lies well past it
        self.nccl_timeout = datetime.timedelta(seconds=max(TORCH_NCCL_TIMEOUT_MIN_SECONDS,
                                                           settings.stall_check_seconds * TORCH_NCCL_TIMEOUT_FACTOR))
        self.watch = NcclWatch(max(1.0, settings.stall_check_seconds), self._abort_nccl, self.rank)
        #: the names of the collectives ``ordered`` runs now (NcclWatch's errors name them)
        self._names = ""
        store = None
        if self.rank == 0:
            # Bound to HVPS_NETWORK_INTERFACE when set; torch's store has no authentication (SECURITY.md).
            listener = socket.create_server((listen_address(), 0), backlog=max(self.size, 128))
            # the master's own client connects where the listener is bound ("0.0.0.0": anywhere local)
            host, port = listener.getsockname()[:2]
            # the store takes the socket over (libuv closes it when the store ends): detach, never close it twice
            fd = listener.detach()
            try:
                store = dist.TCPStore(host, port, self.size, True, self.timeout, wait_for_workers=False,
                                      master_listen_fd=fd)
            except BaseException:
                os.close(fd)
                raise
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
            options._timeout = self.nccl_timeout
            with _TorchNcclSettings():
                return dist.ProcessGroupNCCL(prefix, self.rank, self.size, options)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = self.timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.address)]
        return dist.ProcessGroupGloo(prefix, self.rank, self.size, options)

    def takes(self, device: str, dtype: str) -> bool:
        return device == "cpu" or (device == "cuda" and self.dist.is_nccl_available())

    def ordered(self, entries: list):
        self._names = ", ".join(entry.request.name for entry in entries if entry is not None)
        return cuda_order(entries, host_sync=False)

    def interrupt_on(self, event):
        self.watch.lost = event

    def report_failures_to(self, failed):
        self.watch.failed = failed

    def _abort_nccl(self) -> None:
        group = self._groups.get("cuda")
        if group is not None:
            try:
                group.abort()
            except (AttributeError, RuntimeError):
                pass

    # -- collectives ------------------------------------------------------------------
    def _run(self, what: str, tensor, start) -> None:
        """Run ``start(group)`` (which returns a Work) and wait for it, naming the failure."""
        try:
            work = start(self._group(tensor.device.type))
            work.wait()  # on CUDA: the current (engine) stream waits for NCCL's, the host does not
            if tensor.device.type == "cuda":
                self.watch.track(what, self._names or what, work)
        except RuntimeError as exc:
            error = DataPlaneStall if GLOO_TIMEOUT in str(exc) else HvpsError
            raise error(
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
        if len(set(counts)) == 1:  # equal blocks: the flat form, without the list form's copy into a flat buffer
            self._run("reducescatter", recv, lambda group: group._reduce_scatter_base(wire_recv, wire_send, options))
            return
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
        subset = TorchDistBackend(sub_communicator(self.comm, ranks), self.settings, owned=True)
        subset.watch.lost, subset.watch.failed = self.watch.lost, self.watch.failed
        return subset

    def close(self, failed=False):
        self.watch.stop()
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
