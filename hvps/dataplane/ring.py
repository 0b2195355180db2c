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
"""

from __future__ import annotations

import time

import numpy as np


def segments(count: int, parts: int) -> list:
    """Bounds of ``parts`` nearly equal segments of ``count`` elements (the first ones one longer)."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _window(bound: tuple, offset: int, chunk: int) -> slice:
    lo, hi = bound
    return slice(min(lo + offset, hi), min(lo + offset + chunk, hi))


#: allgather chunks in flight at once per direction: enough to keep a link busy, few enough that a 1 GiB
#: buffer never has hundreds of large messages posted at once (Open MPI 5's shared-memory transport
#: once moved none of 128 such for 30 s, in CI)
IN_FLIGHT = 8

#: polls without progress before napping, the first nap and the longest (seconds)
_SPIN_POLLS, _NAP, _MAX_NAP = 200, 20e-6, 1e-3


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
    idle = 0
    while remaining:
        done = MPI.Request.Testsome(requests)
        if done:
            remaining -= len(done)
            deadline = time.monotonic() + timeout
            idle = 0
            continue
        idle += 1
        if idle > _SPIN_POLLS:  # a slow peer: stop burning the core (and the GIL) training needs
            time.sleep(min(_MAX_NAP, _NAP * (idle - _SPIN_POLLS)))
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
    bounds = segments(recvbuf.size, size)
    longest = bounds[0][1] - bounds[0][0]
    chunk = max(1, min(chunk_bytes // recvbuf.itemsize, longest))
    rounds = -(-longest // chunk)
    count = 2 * size * chunk  # double-buffered
    scratch = (workspace(recvbuf.dtype, count) if workspace else np.empty(count, recvbuf.dtype)).reshape(2, size, chunk)
    mine = bounds[rank]
    # In place, a rank after the first two would read its own data after the
    # partial sum overwrote it: keep a copy of it then.
    copy_own = rank >= 2 and recvbuf.ctypes.data == sendbuf.ctypes.data

    def post(r: int) -> tuple:
        offset, n = r * chunk, _width(mine, r * chunk, chunk)
        requests, peers = [], []
        for step in range(1, size):
            to, source = (rank + step) % size, (rank - step) % size
            requests.append(comm.Irecv(to_wire(scratch[r % 2, source, :n]), source, r))
            requests.append(comm.Isend(to_wire(sendbuf[_window(bounds[to], offset, chunk)]), to, r))
            peers += [source, to]
        return requests, peers

    pending = post(0)
    for r in range(rounds):  # reduce-scatter, rank-ordered folding
        wait_all(*pending, timeout, abort)
        pending = post(r + 1) if r + 1 < rounds else ([], [])
        own = _window(mine, r * chunk, chunk)
        n = own.stop - own.start
        if n:
            parts = scratch[r % 2]
            if copy_own:
                parts[rank, :n] = sendbuf[own]
            terms = [sendbuf[own] if q == rank and not copy_own else parts[q, :n] for q in range(size)]
            ufunc(terms[0], terms[1], out=recvbuf[own])
            for term in terms[2:]:
                ufunc(recvbuf[own], term, out=recvbuf[own])

    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):  # ring allgather of the reduced segments, IN_FLIGHT chunks at a time
        send_bound = bounds[(rank - step) % size]
        recv_bound = bounds[(rank - step - 1) % size]

        def post_gather(r: int) -> list:
            offset = r * chunk
            return [comm.Irecv(to_wire(recvbuf[_window(recv_bound, offset, chunk)]), left, rounds + r),
                    comm.Isend(to_wire(recvbuf[_window(send_bound, offset, chunk)]), right, rounds + r)]

        in_flight = [post_gather(r) for r in range(min(IN_FLIGHT, rounds))]
        for r in range(rounds):
            wait_all(in_flight[r], [left, right], timeout, abort)
            if r + IN_FLIGHT < rounds:
                in_flight.append(post_gather(r + IN_FLIGHT))


def _width(bound: tuple, offset: int, chunk: int) -> int:
    window = _window(bound, offset, chunk)
    return window.stop - window.start
