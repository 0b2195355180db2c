"""hvps's own allreduce over point-to-point messages, bandwidth-optimal and deterministic.

Two phases, each moving ``(n-1)/n`` of the buffer per rank, the volume of the
ring all-reduce (Patarasuk & Yuan, 2009); only the second is a ring:

1. reduce-scatter by pairwise exchange, not around a ring: rank ``t`` owns
   segment ``t``; it sends each other rank its contribution to that rank's
   segment and receives every other rank's contribution to its own, directly
   (``n-1`` messages each way in flight at once); it folds them **in rank order**, so each element's result
   is the same whatever the buffer layout (fused or not, chunk size, segment
   bounds);
2. ring allgather: each owner's reduced segment travels around the ring, a bounded
   number of chunks (``IN_FLIGHT``) in flight at once.

Work is chunked (``chunk_bytes`` per message) so reduction runs on cache-warm
data and scratch memory stays small. Every rank makes the same number of
calls in the same order, including zero-length ones, so odd sizes never hang.

What moves where, and the folding order, is ``schedule.py``'s (shared with the shared-memory and
sealed data planes); this module moves its bytes in MPI non-blocking sends and receives.
"""

from __future__ import annotations

import time

import numpy as np

from .schedule import Schedule, fold_in_rank_order, segments

#: allgather chunks in flight at once per direction: enough to keep a link busy, few enough that a 1 GiB
#: buffer never has hundreds of large messages posted at once (Open MPI 5's shared-memory transport
#: once moved none of 128 such for 30 s, in CI)
IN_FLIGHT = 8

#: polls without progress before napping, the first nap and the longest (seconds)
_SPIN_POLLS, _NAP, _MAX_NAP = 200, 20e-6, 1e-3


class IdlePolls:
    """How a loop polling MPI requests passes time while nothing moves: ``spin`` polls back to back (each
    giving the core away at once when ``yield_core``), then naps that grow by 20 us a poll up to 1 ms, so that
    a slow peer stops costing the core (and the GIL) that training needs. ``moved()`` starts over."""

    __slots__ = ("_spin", "_yield_core", "_idle")

    def __init__(self, spin: int = _SPIN_POLLS, yield_core: bool = False) -> None:
        self._spin, self._yield_core, self._idle = spin, yield_core, 0

    def moved(self) -> None:
        """Something moved: spin again."""
        self._idle = 0

    def pause(self) -> None:
        """One more poll found nothing: yield, nap or go on, as due."""
        self._idle += 1
        over = self._idle - self._spin
        if over > 0:
            time.sleep(min(_MAX_NAP, _NAP * over))
        elif self._yield_core:
            time.sleep(0)


def wait_all(requests: list, peers: list, timeout: float, abort=None, what: str = "ring allreduce",
             point_to_point: bool = True) -> None:
    """``MPI.Request.Waitall`` that gives up after ``timeout`` s without progress, naming the silent peers,
    or as soon as ``abort`` (a ``threading.Event``: the engine's word that ranks were lost) is set.
    Timed-out point-to-point requests are cancelled (MPI cannot cancel a collective's).

    Polls like MPI's own blocking wait does, so transfers progress at full speed.
    """
    from mpi4py import MPI

    from ..core.errors import DataPlaneStall, HvpsError

    deadline = time.monotonic() + timeout
    remaining = len(requests)
    polls = IdlePolls()
    while remaining:
        done = MPI.Request.Testsome(requests)
        if done:
            remaining -= len(done)
            deadline = time.monotonic() + timeout
            polls.moved()
            continue
        polls.pause()
        lost = abort is not None and abort.is_set()
        if lost or time.monotonic() > deadline:
            silent = sorted({peers[i] for i, r in enumerate(requests) if r != MPI.REQUEST_NULL})
            for request in requests:
                if point_to_point and not lost and request != MPI.REQUEST_NULL:
                    request.Cancel()
            if lost:
                raise HvpsError(f"{what} abandoned: ranks of the job were lost while it waited for ranks {silent}")
            raise DataPlaneStall(
                f"{what} failed: no data moved to or from ranks {silent} for {timeout:g} s "
                "(HVPS_STALL_CHECK_TIME_SECONDS); a rank died or a link between ranks is down"
            )


def ring_allreduce(comm, sendbuf: np.ndarray, recvbuf: np.ndarray, ufunc, to_wire, chunk_bytes: int,
                   timeout: float = 60.0, workspace=None, abort=None) -> None:
    """Reduce 1-D ``sendbuf`` over ``comm`` into ``recvbuf`` (may be the same array) with ``ufunc``:
    a pairwise-exchange reduce-scatter, then a ring allgather (see the module).

    ``ufunc(a, b, out=)`` folds two contributions; ``to_wire(array)`` turns a
    slice into an MPI buffer spec. Messages are non-blocking and the next
    chunk is in flight while the current one is folded; a peer that moves no
    data for ``timeout`` s makes it raise HvpsError naming that peer.
    ``workspace(dtype, count)`` lends reusable scratch memory (fresh pages cost
    a page fault each, every call).
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or recvbuf.size == 0:
        if recvbuf.ctypes.data != sendbuf.ctypes.data:
            recvbuf[...] = sendbuf
        return
    plan = Schedule(rank, size, segments(recvbuf.size, size), chunk_bytes // recvbuf.itemsize)
    chunk = plan.width
    count = 2 * size * chunk  # double-buffered
    scratch = (workspace(recvbuf.dtype, count) if workspace else np.empty(count, recvbuf.dtype)).reshape(2, size, chunk)
    exchanges = plan.exchanges()
    # In place, a rank after the first two would read its own data after the
    # partial sum overwrote it: keep a copy of it then.
    copy_own = rank >= 2 and recvbuf.ctypes.data == sendbuf.ctypes.data

    def post(r: int) -> tuple:
        own = plan.window(rank, r)
        n = own.stop - own.start
        requests, peers = [], []
        for exchange in exchanges:
            to, source = exchange.to, exchange.source
            requests.append(comm.Irecv(to_wire(scratch[r % 2, source, :n]), source, r))
            requests.append(comm.Isend(to_wire(sendbuf[plan.window(to, r)]), to, r))
            peers += [source, to]
        return requests, peers

    rounds = plan.rounds
    pending = post(0)
    for r in range(rounds):  # reduce-scatter, rank-ordered folding
        wait_all(*pending, timeout, abort)
        pending = post(r + 1) if r + 1 < rounds else ([], [])
        own = plan.window(rank, r)
        n = own.stop - own.start
        if n:
            parts = scratch[r % 2]
            if copy_own:
                parts[rank, :n] = sendbuf[own]
            terms = [sendbuf[own] if q == rank and not copy_own else parts[q, :n] for q in range(size)]
            fold_in_rank_order(ufunc, terms, recvbuf[own])

    right, left = plan.right, plan.left
    for step in plan.gather_steps():  # ring allgather of the reduced segments, IN_FLIGHT chunks at a time

        def post_gather(r: int, step=step) -> list:
            return [comm.Irecv(to_wire(recvbuf[plan.window(step.recv_block, r)]), left, rounds + r),
                    comm.Isend(to_wire(recvbuf[plan.window(step.send_block, r)]), right, rounds + r)]

        in_flight = [post_gather(r) for r in range(min(IN_FLIGHT, rounds))]
        for r in range(rounds):
            wait_all(in_flight[r], [left, right], timeout, abort)
            if r + IN_FLIGHT < rounds:
                in_flight.append(post_gather(r + IN_FLIGHT))
