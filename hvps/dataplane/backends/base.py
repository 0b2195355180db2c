"""The interface every data plane implements; all buffers are contiguous numpy arrays."""

from __future__ import annotations

import abc
import contextlib

import numpy as np

from ...core.dtypes import ReduceOp


class Backend(abc.ABC):
    """Collectives on contiguous buffers, called only from the engine's thread."""

    name: str = "abstract"

    def takes(self, device: str, dtype: str) -> bool:
        """Whether torch tensors on ``device`` (``"cpu"``, ``"cuda"``) of ``dtype`` may be passed
        as they are; everything else reaches the backend as numpy arrays."""
        return False

    #: collectives over at most this many bytes per rank return (or raise) promptly once the event given to
    #: ``interrupt_on`` is set, so the engine may run them on a waiting user thread (0: none may)
    interruptible_bytes: int = 0

    def interruptible_bytes_for(self, method: str) -> int:
        """The most bytes per rank of a call of ``method`` (the name of one of this class's collectives:
        ``"allreduce"``, ``"allgatherv"``, ``"sendrecv"``, ...) that returns (or raises) promptly once the event
        given to ``interrupt_on`` is set.

        Args:
            method: the backend method the collective calls.

        Returns:
            ``interruptible_bytes`` here; a plane whose methods differ (``ShmBackend``) says per method.
        """
        return self.interruptible_bytes

    def interrupt_on(self, event) -> None:
        """From now on, give up a collective in flight once ``event`` (a ``threading.Event``) is set."""

    def report_failures_to(self, failed) -> None:
        """From now on, call ``failed(HvpsError)`` when a collective fails after its call returned (NCCL's
        asynchronous errors and timeouts: the engine then fails every handle and stops)."""

    def ordered(self, entries: list):
        """A context the engine runs each collective in (device stream ordering; none on the host)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def allreduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp) -> None:
        """Reduce ``sendbuf`` over ranks into ``recvbuf`` (they may be the same array).

        ``op`` is never Average: the engine sums and divides.
        """

    @abc.abstractmethod
    def allgatherv(self, sendbuf: np.ndarray, recvbuf: np.ndarray, counts: list) -> None:
        """Concatenate every rank's ``sendbuf`` (``counts[r]`` elements each) into ``recvbuf``."""

    @abc.abstractmethod
    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """Overwrite ``buf`` on every rank with the root's."""

    @abc.abstractmethod
    def alltoallv(self, sendbuf: np.ndarray, sendcounts: list, recvbuf: np.ndarray, recvcounts: list) -> None:
        """Send ``sendcounts[r]`` elements to rank r, receive ``recvcounts[r]`` from it."""

    @abc.abstractmethod
    def reducescatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray, counts: list, op: ReduceOp) -> None:
        """Reduce ``sendbuf`` over ranks; rank r keeps the ``counts[r]`` elements of block r."""

    def sendrecv(self, sendbuf: np.ndarray, dest: int, recvbuf: np.ndarray, source: int) -> None:
        """Send ``sendbuf`` to rank ``dest`` while receiving ``recvbuf`` from rank ``source``
        (point to point, for algorithms such as Adasum)."""
        raise NotImplementedError(f"the {self.name} data plane has no point-to-point transfers (Adasum needs them)")

    #: whether ``subset`` builds process sets on this data plane
    supports_process_sets: bool = False

    def subset(self, ranks: tuple) -> "Backend":
        """The same data plane over ``ranks`` only (a process set); called by exactly those ranks,
        in the same order on each."""
        raise NotImplementedError(f"the {self.name} data plane does not support process sets")

    def close(self, failed: bool = False) -> None:
        """Release resources (communicators, process groups); ``failed``: a collective failed midway
        (a peer died), so abort what a clean close would wait on (NCCL communicators)."""


def sub_communicator(comm, ranks):
    """A communicator over ``ranks`` of ``comm``, built by those ranks only (the others carry on with
    their own work): MPI's ``Create_group``, or a store communicator's ``subset``."""
    if hasattr(comm, "subset"):
        return comm.subset(ranks)
    group = comm.Get_group()
    members = group.Incl(list(ranks))
    try:
        return comm.Create_group(members)
    finally:
        members.Free()
        group.Free()
