"""Explicit chunked ring all-reduce over point-to-point messages.

Reduce-scatter then allgather, as in Patarasuk & Yuan (2009) and Baidu's ring
all-reduce: each rank sends and receives ``2 (n-1)/n`` of the buffer, whatever
the number of ranks. Local contributions are read from ``sendbuf`` so that an
out-of-place call needs no extra copy; every element's final value is computed
on exactly one rank and copied to the others, so all ranks end bit-identical.
"""

from __future__ import annotations

import numpy as np


def _segments(count: int, parts: int) -> list:
    """Boundaries of ``parts`` nearly equal segments of ``count`` elements."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def ring_allreduce(comm, sendbuf: np.ndarray, recvbuf: np.ndarray, ufunc, to_wire, chunk_bytes: int) -> None:
    """Reduce 1-D ``sendbuf`` over ``comm`` into ``recvbuf`` with ``ufunc``.

    ``to_wire(array)`` turns a slice into an MPI buffer spec; ``chunk_bytes`` bounds
    each message so that the reduction works on cache-warm data.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or recvbuf.size == 0:
        if recvbuf is not sendbuf:
            recvbuf[...] = sendbuf
        return
    right, left = (rank + 1) % size, (rank - 1) % size
    segments = _segments(recvbuf.size, size)
    chunk = max(1, chunk_bytes // recvbuf.itemsize)
    scratch = np.empty(min(chunk, segments[0][1] - segments[0][0]) or 1, dtype=recvbuf.dtype)

    for step in range(size - 1):  # reduce-scatter
        send_lo, send_hi = segments[(rank - step) % size]
        recv_lo, recv_hi = segments[(rank - step - 1) % size]
        source = sendbuf if step == 0 else recvbuf
        _exchange(comm, right, left, source, send_lo, send_hi, recv_lo, recv_hi, chunk,
                  lambda lo, hi, n: ufunc(sendbuf[lo:hi], scratch[:n], out=recvbuf[lo:hi]),
                  scratch, to_wire)
    for step in range(size - 1):  # allgather
        send_lo, send_hi = segments[(rank + 1 - step) % size]
        recv_lo, recv_hi = segments[(rank - step) % size]
        _exchange(comm, right, left, recvbuf, send_lo, send_hi, recv_lo, recv_hi, chunk, None, recvbuf, to_wire)


def _exchange(comm, right, left, source, send_lo, send_hi, recv_lo, recv_hi, chunk, reduce, target, to_wire):
    """Send ``source[send_lo:send_hi]`` right while receiving ``recv_lo:recv_hi`` from the left.

    With ``reduce``, each received chunk lands in ``target`` (the scratch buffer)
    and is folded in at once; without it, it lands in ``target`` at its place.
    """
    send_len, recv_len = send_hi - send_lo, recv_hi - recv_lo
    offset = 0
    while offset < max(send_len, recv_len):
        s_n = max(0, min(chunk, send_len - offset))
        r_n = max(0, min(chunk, recv_len - offset))
        send = source[send_lo + offset : send_lo + offset + s_n]
        if reduce is None:
            recv = target[recv_lo + offset : recv_lo + offset + r_n]
        else:
            recv = target[:r_n]
        comm.Sendrecv(to_wire(send), right, 0, to_wire(recv), left, 0)
        if reduce is not None and r_n:
            reduce(recv_lo + offset, recv_lo + offset + r_n, r_n)
        offset += chunk
