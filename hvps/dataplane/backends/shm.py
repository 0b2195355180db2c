"""Collectives among the ranks of one node through one shared-memory segment (``HVPS_SHM``).

Allreduce is a reduce-scatter by ownership then an allgather, with no copy in between:
each rank copies its peers' parts of a chunk into its slot, sums its own part straight
from every peer's slot (in rank order, numpy ufuncs with ``out=``, no temporaries) into
its slot, and every rank then copies each owner's reduced part out. Large buffers go
through in rounds of one buffer each, two buffers per rank, so a rank copies round k+1
in while slower peers still read round k. Allgather, alltoall, broadcast and reducescatter
use the same rounds; point-to-point goes to ``fallback`` (MPI). A small allreduce
(``WHOLE_REDUCE_BYTES``) goes in one round: every rank copies all of its data in and folds every
rank's, in rank order. The blocks, the chunk windows, who copies what and the folding order are
``schedule.py``'s, as for the MPI ring and the sealed plane, so every plane gives the same bits.

The flat plane under it is MPI's or torch.distributed's (gloo): CPU torch tensors the flat plane
takes as they are are read here through numpy views of their memory. Whether the plane applies, and
its composition across nodes, is ``node_plane.py``'s.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import numpy as np

from ...core import arrays, dtypes
from ...core.errors import HvpsError
from ..schedule import Schedule, bounds_of_counts, fold_in_rank_order, segments, window
from ..shm_segment import A2A_ROUNDS, DONE, IN, RED, SHM_DIR, Segment, new_name, segment_bytes
from .base import Backend


#: the methods that run on the segment itself, whose every wait gives up once ``interrupt_on``'s event is set,
#: whatever the size (the others run on the flat plane)
_ON_THE_SEGMENT = frozenset({"allreduce", "allgatherv", "alltoallv", "broadcast", "reducescatter"})

#: reduction layouts and part views ``ShmBackend`` keeps (all are dropped when one more is needed)
_PLANS_KEPT = 256

#: an allreduce whose every rank's data together is at most this many bytes (and one rank's fits in a buffer) goes
#: in one round with one wait: each rank folds all of it (``ShmBackend._reduce_whole``)
WHOLE_REDUCE_BYTES = 64 << 10


def _kept(cache: dict, key: Any, make: Any) -> Any:
    """``cache[key]``, made by ``make()`` the first time; at most ``_PLANS_KEPT`` entries (all dropped when full)."""
    value = cache.get(key)
    if value is None:
        value = make()
        if len(cache) >= _PLANS_KEPT:
            cache.clear()
        cache[key] = value
    return value


def _host_view(buffer: Any) -> np.ndarray:
    """``buffer`` as a numpy array sharing its memory (a CPU torch tensor becomes a view of it)."""
    if arrays.is_numpy(buffer):
        return buffer
    from ...core.views import as_array

    return as_array(buffer)


def _gather_order(plan: Schedule) -> list:
    """The blocks a rank copies out in the allgather: its own, then those the ring would bring it, in that order
    (in shared memory every owner's block is in reach at once: the ring's steps become copies)."""
    return [plan.rank] + [step.recv_block for step in plan.gather_steps()]


class ShmBackend(Backend):
    """Node-local collectives on ``segment``; what it has no shared-memory path for runs on ``fallback``."""

    name = "shm"

    def __init__(self, segment: Segment, fallback: Optional[Backend]) -> None:
        self.segment, self.fallback = segment, fallback
        self.rank, self.size = segment.rank, segment.size
        self.seq = 0  # rounds run so far: the same on every rank, as every rank runs the same calls
        self._views: dict = {}
        #: (bounds, width) -> the reduction's schedule, exchanges and gather order (``_plan``)
        self._plans: dict = {}
        #: (dtype, buffer, width) -> every rank's buffer as rows per owner (``_parts``)
        self._part_views: dict = {}

    @property
    def supports_process_sets(self) -> bool:
        return self.fallback is not None and self.fallback.supports_process_sets

    def takes(self, device: str, dtype: str) -> bool:
        """CPU tensors when the flat plane takes them (they are read through numpy views here)."""
        return device == "cpu" and (self.fallback is None or self.fallback.takes(device, dtype))

    def ordered(self, entries):
        return self.fallback.ordered(entries) if self.fallback is not None else super().ordered(entries)

    @property
    def interruptible_bytes(self) -> int:
        """The flat plane's: a wait on the segment gives up once ``interrupt_on``'s event is set, so the
        collectives that might run on the flat plane decide."""
        return self.fallback.interruptible_bytes if self.fallback is not None else 0

    def interruptible_bytes_for(self, method: str) -> int:
        """Any size for what runs on the segment (a waiter then runs a 1 MiB allreduce itself, with no hand-over
        to the engine thread and back); the flat plane's limit for the rest (alltoall, point-to-point)."""
        return sys.maxsize if method in _ON_THE_SEGMENT else self.interruptible_bytes

    def interrupt_on(self, event):
        self.segment.lost = event
        if self.fallback is not None:
            self.fallback.interrupt_on(event)

    def report_failures_to(self, failed):
        if self.fallback is not None:
            self.fallback.report_failures_to(failed)

    def _slots(self, dtype: np.dtype) -> np.ndarray:
        """Every rank's two buffers as ``[rank, which, element]`` of ``dtype``."""
        view = self._views.get(dtype)
        if view is None:
            per = self.segment.buffer_bytes // dtype.itemsize
            view = self.segment.buffer(0, 0, dtype, self.size * 2 * per).reshape(self.size, 2, per)
            self._views[dtype] = view
        return view

    def _parts(self, slots: np.ndarray, which: int, width: int) -> list:
        """Per rank, buffer ``which`` of its slot as ``[owner, element]`` rows of ``width`` (views kept per
        dtype, buffer and width, as the slots are)."""
        size = self.size
        return _kept(self._part_views, (slots.dtype, which, width),
                     lambda: [slots[q, which, :size * width].reshape(size, width) for q in range(size)])

    def _plan(self, bounds: list, width: int) -> tuple:
        """The ``Schedule`` over ``bounds`` in windows of ``width``, its exchanges and gather order (a reduction's or
        an allgather's): made once per layout (a training loop moves the same few sizes every step; making them
        cost a 4 B allreduce ~4 us)."""
        def make() -> tuple:
            plan = Schedule(self.rank, self.size, bounds, width)
            return plan, plan.exchanges(), _gather_order(plan)

        return _kept(self._plans, (tuple(bounds), width), make)

    def _rounds(self, body, rounds: int) -> None:
        """``body(which, round, mark)`` ``rounds`` times, each once the peers left that buffer (peers abort on
        a failure)."""
        try:
            for r in range(rounds):
                seq = self.seq
                self.segment.wait(DONE, seq - 1)  # round seq-2 used this buffer: every rank copied it out
                body(seq % 2, r, seq + 1)
                self.segment.publish(DONE, seq + 1)
                self.seq = seq + 1
        except BaseException:
            self.segment.abort()
            raise

    def _reduce(self, send: np.ndarray, out: np.ndarray, bounds: list, op, everything: bool) -> None:
        """Reduce 1-D ``send``; ``out`` gets all of it (``everything``) or this rank's bound only."""
        slots = self._slots(send.dtype)
        plan, exchanges, owners = self._plan(bounds, slots.shape[2] // self.size)
        width = plan.width
        ufunc = dtypes.combine(op, send.dtype)
        rank, mine = self.rank, plan.mine

        def body(which: int, r: int, mark: int) -> None:
            parts = self._parts(slots, which, width)
            for exchange in exchanges:  # "send": each peer's part into my slot, where only that peer reads it
                win = plan.window(exchange.to, r)
                parts[rank][exchange.to, :win.stop - win.start] = send[win]
            self.segment.publish(IN, mark)
            self.segment.wait(IN, mark)
            win = plan.window(rank, r)
            n = win.stop - win.start
            if n:
                terms = [send[win] if q == rank else parts[q][rank, :n] for q in range(self.size)]
                fold_in_rank_order(ufunc, terms, parts[rank][rank, :n])
            self.segment.publish(RED, mark)
            if not everything:
                out[win.start - mine[0]:win.stop - mine[0]] = parts[rank][rank, :n]
                return
            self.segment.wait(RED, mark)
            for q in owners:  # the allgather: every owner's reduced part, straight from its slot
                win = plan.window(q, r)
                out[win] = parts[q][q, :win.stop - win.start]

        self._rounds(body, plan.rounds)

    def _reduce_whole(self, send: np.ndarray, out: np.ndarray, op) -> None:
        """Reduce 1-D ``send`` of at most one buffer in one round: each rank copies all of it into its buffer,
        then every rank folds every rank's buffer, in rank order, into ``out``. The same bits as ``_reduce``
        (the same fold of the same terms), with one wait instead of two: small collectives are all latency."""
        slots, n = self._slots(send.dtype), send.size
        ufunc, rank, size, segment = dtypes.combine(op, send.dtype), self.rank, self.size, self.segment

        def body(which: int, r: int, mark: int) -> None:
            slots[rank, which, :n] = send
            segment.publish(IN, mark)
            segment.wait(IN, mark)
            # every term from the slots, not ``send``: ``out`` may be ``send``
            fold_in_rank_order(ufunc, [slots[q, which, :n] for q in range(size)], out)

        self._rounds(body, 1)

    def allreduce(self, sendbuf, recvbuf, op):
        sendbuf, recvbuf = _host_view(sendbuf), _host_view(recvbuf)
        count = recvbuf.size
        if not count:
            return
        nbytes = count * recvbuf.itemsize
        if nbytes <= self.segment.buffer_bytes and nbytes * self.size <= WHOLE_REDUCE_BYTES:
            self._reduce_whole(sendbuf.reshape(-1), recvbuf.reshape(-1), op)
        else:
            self._reduce(sendbuf.reshape(-1), recvbuf.reshape(-1), segments(count, self.size), op, True)

    def reducescatter(self, sendbuf, recvbuf, counts, op):
        if sum(counts):
            sendbuf, recvbuf = _host_view(sendbuf), _host_view(recvbuf)
            self._reduce(sendbuf.reshape(-1), recvbuf.reshape(-1), bounds_of_counts(counts), op, False)

    def allgatherv(self, sendbuf, recvbuf, counts):
        if not sum(counts):
            return
        sendbuf, recvbuf = _host_view(sendbuf), _host_view(recvbuf)
        slots = self._slots(recvbuf.dtype)
        plan, _, owners = self._plan(bounds_of_counts(counts), slots.shape[2])
        send, recv = sendbuf.reshape(-1), recvbuf.reshape(-1)
        start = plan.mine[0]

        def body(which: int, r: int, mark: int) -> None:
            own = plan.window(self.rank, r)
            slots[self.rank, which, :own.stop - own.start] = send[own.start - start:own.stop - start]
            self.segment.publish(IN, mark)
            self.segment.wait(IN, mark)
            for q in owners:
                win = plan.window(q, r)
                recv[win] = slots[q, which, :win.stop - win.start]

        self._rounds(body, plan.rounds)

    def broadcast(self, buf, root):
        buf = _host_view(buf)
        if not buf.size:
            return
        flat = buf.reshape(-1)
        slots = self._slots(flat.dtype)
        width = slots.shape[2]

        def body(which: int, r: int, mark: int) -> None:
            piece = flat[r * width:(r + 1) * width]
            if self.rank == root:
                slots[root, which, :piece.size] = piece
                self.segment.publish(IN, mark)
            else:
                self.segment.wait(IN, mark, [root])
                piece[...] = slots[root, which, :piece.size]

        self._rounds(body, -(-flat.size // width))

    def _need_fallback(self, what: str) -> Backend:
        if self.fallback is None:
            raise HvpsError(f"the node's shared-memory data plane has no {what}; it runs on the flat data plane")
        return self.fallback

    def alltoallv(self, sendbuf, sendcounts, recvbuf, recvcounts):
        """Each buffer is split in one region per destination; in round k every rank copies elements
        ``[k w, (k+1) w)`` of its block for each destination into that destination's region, and each copies its
        region out of every peer's buffer. Round 0 also tells every rank how many rounds the largest block
        needs (``A2A_ROUNDS``): a rank knows only the blocks it sends and receives."""
        sendbuf, recvbuf = _host_view(sendbuf), _host_view(recvbuf)
        send, recv = sendbuf.reshape(-1), recvbuf.reshape(-1)
        slots = self._slots(recv.dtype)
        size, rank, segment = self.size, self.rank, self.segment
        width = slots.shape[2] // size
        sends, recvs = bounds_of_counts(sendcounts), bounds_of_counts(recvcounts)
        mine = -(-int(max(*sendcounts, *recvcounts, 0)) // width)
        rounds = [1]

        def body(which: int, r: int, mark: int) -> None:
            start = r * width
            for peer, bound in enumerate(sends):
                part = send[window(bound, start, width)]
                slots[rank, which, peer * width:peer * width + part.size] = part
            if r == 0:
                segment.publish(A2A_ROUNDS[which], mine)
            segment.publish(IN, mark)
            segment.wait(IN, mark)
            if r == 0:
                rounds[0] = max(segment.field(q, A2A_ROUNDS[which]) for q in range(size))
            for peer, bound in enumerate(recvs):
                win = window(bound, start, width)
                recv[win] = slots[peer, which, rank * width:rank * width + win.stop - win.start]

        self._rounds(body, 1)
        if rounds[0] > 1:
            self._rounds(lambda which, r, mark: body(which, r + 1, mark), rounds[0] - 1)

    def sendrecv(self, sendbuf, dest, recvbuf, source):
        self._need_fallback("point-to-point transfer").sendrecv(sendbuf, dest, recvbuf, source)

    def subset(self, ranks):
        return self._need_fallback("process sets").subset(ranks)  # a process set runs on MPI

    def close(self, failed=False):
        if failed:
            self.segment.abort()
        self._views.clear()
        self._part_views.clear()
        self.segment.close()
        if self.fallback is not None:
            self.fallback.close(failed)


def open_segment(local, buffer_bytes: int, timeout: float) -> tuple:
    """``(Segment, None)`` mapped on every rank of ``local`` (collective), or ``(None, reason)``.

    Local rank 0 creates it; the name is unlinked once all ranks mapped it, or when this fails midway.
    """
    rank, size = local.Get_rank(), local.Get_size()
    total = segment_bytes(size, buffer_bytes)
    name, reason, segment = None, None, None
    if rank == 0:
        try:
            free = os.statvfs(SHM_DIR)
            if free.f_bavail * free.f_frsize < total:
                raise OSError(f"{SHM_DIR} has {free.f_bavail * free.f_frsize >> 20} MiB free, the segment needs "
                              f"{total >> 20} MiB (enlarge it, e.g. docker --shm-size, or lower HVPS_RING_CHUNK_BYTES)")
            name = new_name()
            segment = Segment(name, size, 0, buffer_bytes, timeout, create=True)
        except OSError as exc:
            name, reason = None, f"cannot create a shared-memory segment in {SHM_DIR}: {exc}"
    try:
        name, reason = local.bcast((name, reason), root=0)
        if name is not None and rank != 0:
            try:
                segment = Segment(name, size, rank, buffer_bytes, timeout, create=False)
            except OSError as exc:
                reason = f"cannot map shared-memory segment {SHM_DIR}/{name} on local rank {rank}: {exc}"
        reasons = [r for r in local.allgather(reason) if r]
    except BaseException:  # a peer lost midway (an elastic job changing): leave no name in /dev/shm
        if segment is not None:
            if rank == 0:
                segment.unlink()
            segment.close()
        raise
    if rank == 0 and segment is not None:
        segment.unlink()  # every rank mapped it (or gave up): the kernel frees it with the last process
    if reasons:
        if segment is not None:
            segment.close()
        return None, reasons[0]
    return segment, None
