"""The sealed data plane (``HVPS_ENCRYPT=1``): every collective over sealed point-to-point messages.

Wraps an MPI backend and runs each collective itself over non-blocking sends and receives on
the inner backend's communicator, so that one place seals everything the engine moves (the
store's exchanges, ``broadcast_object``, checkpoint loading: all are collectives here):

- allreduce: reduce-scatter by pairwise exchange, folded in rank order, then a ring allgather
  (``schedule.py``'s steps and folding order, as on the MPI ring and the shared-memory plane: the
  same bits on every plane);
- reducescatter and alltoallv: pairwise exchange; allgatherv: a ring; broadcast: the ring
  allgather of the root's block alone.

Messages to peers on another host are sealed (``sealed_crypto.py``); same-host peers travel in clear
unless ``HVPS_ENCRYPT=all``. Each message is cut into chunks, and a worker thread seals chunk
k+1 and opens chunk k-1 while chunk k is on the wire (OpenSSL releases the GIL); the reduce-scatter
folds each chunk of its last step as soon as it opens (``ChunkFold``), into the output at once, so
only the last chunk's fold is left when the allgather starts.

A chunk that fails to open never ends a collective early on one rank (the others would wait
for it): the rank notes the failure, carries on with the collective's messages, and every
collective ends with a verdict round (dissemination, ``ceil(log2 n)`` sealed 256-byte
messages), so every rank raises the same HvpsError, naming the peer and the collective.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from typing import Callable, Optional

import numpy as np

from ...core import dtypes
from ...core.errors import DataPlaneStall, HvpsError
from ...core.settings import env_text
from .. import sealed_crypto
from ..buffers import FusionBuffer
from ..schedule import (
    bounds_of_counts,
    fold_in_rank_order,
    pairwise_exchanges,
    ring_gather_steps,
    ring_neighbours,
    segments,
)
from .base import Backend

_KINDS = {"allreduce": 1, "allgather": 2, "broadcast": 3, "alltoall": 4, "reducescatter": 5, "verdict": 6}
_VERDICT_BYTES = 256
#: chunks in flight each way per transfer: many, so that each message's rendezvous round trip (slow behind a
#: full link's queue: the testbed's tbf holds 100 ms of data) overlaps with the others' data. Measured at 1 Gbit/s:
#: 6 x 1 MiB moved 53% of the link, 8 x 4 MiB (the scratch memory: up to 2 x 8 x HVPS_RING_CHUNK_BYTES) see RESULTS
WINDOW = 8
#: polls without progress before napping between polls, the first nap and the longest (seconds): the naps
#: grow while nothing moves (a link slower than the cipher), so the waiting rank leaves the CPU to the worker,
#: the other ranks and the kernel's network stack. Measured on a loaded 2-core host, 64 MiB at 1 Gbit/s:
#: 500 polls and a fixed 20 us nap cost 210-300 ms of CPU per call and rank, 50 and growing naps 170-240
_SPIN_POLLS, _NAP, _MAX_NAP = 50, 20e-6, 1e-3
_TAG = 7301  # MPI tag of every message: the communicator is private to this backend, and MPI keeps order


def _bytes(array) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


class _Tamper:
    """The test-only fault hook ``HVPS_TEST_TAMPER=MODE:RANK[:N]``: on rank RANK, the N-th (default 1st)
    sealed chunk received after the variable was read is damaged: ``flip`` flips one of its bytes,
    ``replay`` puts the chunk received before it in its place."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.spec = None
        self.seen = 0
        self.last = None

    def refresh(self) -> None:
        raw = env_text("HVPS_TEST_TAMPER")
        if raw != (self.spec and self.spec[0]):
            parts = (raw or "").split(":")
            if raw and len(parts) in (2, 3) and parts[0] in ("flip", "replay") and int(parts[1]) == self.rank:
                self.spec = (raw, parts[0], int(parts[2]) if len(parts) == 3 else 1)
            else:
                self.spec = (raw, None, 0) if raw else None
            self.seen = 0

    def on_receive(self, sealed: np.ndarray) -> None:
        if self.spec and self.spec[1] in ("flip", "replay"):
            self.seen += 1
            if self.seen == self.spec[2]:
                if self.spec[1] == "flip":
                    sealed[len(sealed) // 2] ^= 0x40
                elif self.last is not None:  # the previous chunk's bytes, cut or padded to this one's length
                    n = min(len(sealed), len(self.last))
                    sealed[:n] = self.last[:n]
            self.last = sealed.copy() if self.seen < self.spec[2] else None


class ChunkFold:
    """The reduce-scatter's fold, done chunk by chunk while the last step's chunks arrive.

    ``parts`` holds every rank's contribution to this rank's block, one row per rank; once the last
    step's chunks up to byte ``stop`` are usable, :meth:`upto` folds the elements they complete, in
    rank order, into ``out``. Element by element this is the whole block's fold, so the bits are the
    same whatever the chunk size (a chunk that splits an element leaves it for the next call).
    Nothing is folded once ``state`` holds a failure: no byte of a collective that failed is used.
    """

    def __init__(self, ufunc, parts: np.ndarray, out: np.ndarray, state: dict) -> None:
        self.ufunc, self.parts, self.out, self.state = ufunc, parts, out, state
        self.folded = 0  # elements of ``out`` folded so far

    def upto(self, stop_byte: int) -> None:
        """Fold every element that bytes ``[0, stop_byte)`` of each row complete (call with growing stops)."""
        stop = stop_byte // self.parts.itemsize
        if stop > self.folded and "failure" not in self.state:
            window = slice(self.folded, stop)
            fold_in_rank_order(self.ufunc, list(self.parts[:, window]), self.out[window])
            self.folded = stop


class SealedBackend(Backend):
    """Collectives over sealed messages on ``inner``'s communicator (an MPI backend's)."""

    interruptible_bytes = 0

    def __init__(self, inner: Backend, members: list, keyring: sealed_crypto.Keyring, hosts: list, seal_all: bool,
                 chunk_bytes: int, timeout: float) -> None:
        """``members``: the global rank of each rank of ``inner``; ``hosts``: the host of each member."""
        self.inner, self.comm = inner, inner.comm
        self.name = f"sealed-{inner.name}"
        self.members, self.keyring, self.hosts, self.seal_all = list(members), keyring, list(hosts), seal_all
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.chunk = max(1024, chunk_bytes)
        self.timeout = timeout
        self.abort = None
        self.sequence = 0
        self.workspace = FusionBuffer()  # the blocks received in a reduce-scatter
        self.tamper = _Tamper(keyring.rank)
        self._subsets: dict = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hvps-seal")
        context = b"members:" + b",".join(str(m).encode() for m in self.members) + b"|" + \
            str(keyring_uses(keyring, self.members)).encode()
        me = self.members[self.rank]
        self.send_dir, self.recv_dir = {}, {}
        for peer, other in enumerate(self.members):
            if peer != self.rank and self.sealed(peer):
                self.send_dir[peer] = sealed_crypto.Direction(keyring.key(me, other, context), me, other)
                self.recv_dir[peer] = sealed_crypto.Direction(keyring.key(other, me, context), other, me)
        self._scratch = [np.empty(0, np.uint8)] * (2 * WINDOW)  # send slots, then receive slots

    @property
    def supports_process_sets(self) -> bool:
        return self.inner.supports_process_sets

    def sealed(self, peer: int) -> bool:
        """Whether messages to and from ``peer`` (a rank of this communicator) are sealed."""
        return self.seal_all or self.hosts[peer] != self.hosts[self.rank]

    def interrupt_on(self, event):
        self.abort = event

    # -- moving bytes -------------------------------------------------------------------------------

    def _slot(self, index: int, nbytes: int) -> np.ndarray:
        if self._scratch[index].size < nbytes:
            self._scratch[index] = np.empty(max(nbytes, self.chunk + sealed_crypto.TAG), np.uint8)
        return self._scratch[index][:nbytes]

    def _transfer(self, send: Optional[np.ndarray], dest: int, recv: Optional[np.ndarray], source: int,
                  state: dict, step: int, on_chunk: Optional[Callable[[int], None]] = None) -> None:
        """Send the bytes ``send`` to ``dest`` while receiving ``recv``'s bytes from ``source``, in chunks,
        ``WINDOW`` of them in flight each way; the worker thread seals ahead and opens behind.

        ``on_chunk(stop)``, when given, runs on the worker thread, in chunk order, each time the received
        bytes ``recv[:stop]`` are all usable (authenticated and opened, or received in clear): the caller
        consumes them while later chunks are still on the wire. It never runs for a chunk that failed to
        open, nor for any chunk after it."""
        from mpi4py import MPI

        chunk = self.chunk
        ns = -(-send.size // chunk) if send is not None and send.size else 0
        nr = -(-recv.size // chunk) if recv is not None and recv.size else 0
        seal_send, seal_recv = bool(ns) and self.sealed(dest), bool(nr) and self.sealed(source)
        kind, seq = state["kind"], state["sequence"]
        nonces_s = [self.send_dir[dest].next_nonce() for _ in range(ns)] if seal_send else []
        nonces_r = [self.recv_dir[source].next_nonce() for _ in range(nr)] if seal_recv else []

        def plain(buf, k):
            return buf[k * chunk:(k + 1) * chunk]

        def seal(k):
            data = plain(send, k)
            out = self._slot(k % WINDOW, data.size + sealed_crypto.TAG)
            self.send_dir[dest].seal_into(nonces_s[k], data, out, sealed_crypto.aad(kind, seq, step, k, data.size))
            return out

        def open_(k, box):
            data = plain(recv, k)
            self.tamper.on_receive(box)
            try:
                aad = sealed_crypto.aad(kind, seq, step, k, data.size)
                self.recv_dir[source].open_into(nonces_r[k], box, data, aad)
            except sealed_crypto.invalid_tag():
                state.setdefault("failure", f"a chunk from rank {self.members[source]} failed authentication on rank "
                                            f"{self.members[self.rank]} in {state['what']}")
                failed[0] = True
            usable(k)

        failed = [False]  # a chunk of this transfer failed to open: no later chunk is handed on

        def usable(k):
            if on_chunk is not None and not failed[0]:
                on_chunk(min((k + 1) * chunk, recv.size))

        sealed: dict = {}                 # k -> future of its sealed bytes
        sends: list = []                  # (k, request) in flight
        recvs: list = []                  # (k, request, box) in flight
        opening: list = []                # futures of chunks being opened, in order
        posted_s = posted_r = done_s = opened = 0
        idle, deadline = 0, time.monotonic() + self.timeout
        while done_s < ns or opened < nr:
            moved = False
            while seal_send and len(sealed) + len(sends) < WINDOW and posted_s + len(sealed) < ns:
                k = posted_s + len(sealed)
                sealed[k] = self._pool.submit(seal, k)
            while posted_s < ns and len(sends) < WINDOW and (not seal_send or sealed[posted_s].done()):
                box = sealed.pop(posted_s).result() if seal_send else plain(send, posted_s)
                sends.append((posted_s, self.comm.Isend(box, dest, _TAG)))
                posted_s += 1
                moved = True
            while posted_r < nr and posted_r - opened < WINDOW:
                box = self._slot(WINDOW + posted_r % WINDOW, plain(recv, posted_r).size + sealed_crypto.TAG) \
                    if seal_recv else plain(recv, posted_r)
                recvs.append((posted_r, self.comm.Irecv(box, source, _TAG), box))
                posted_r += 1
            try:
                if sends or recvs:  # one call progresses every request; then take the finished ones in order
                    MPI.Request.Testsome([q for _, q in sends] + [q for _, q, _ in recvs])
                while sends and sends[0][1] == MPI.REQUEST_NULL:
                    sends.pop(0)
                    done_s += 1
                    moved = True
                while recvs and recvs[0][1] == MPI.REQUEST_NULL:
                    k, _, box = recvs.pop(0)
                    moved = True
                    if seal_recv:
                        opening.append(self._pool.submit(open_, k, box))
                    elif on_chunk is not None:  # on the worker too: on_chunk keeps one thread and chunk order
                        opening.append(self._pool.submit(usable, k))
                    else:
                        opened += 1
            except MPI.Exception as exc:  # e.g. a message longer than the chunk expected: truncated, never stored
                self._drain(sends, recvs, opening)
                state.setdefault("failure", f"a message between ranks {self.members[dest]}, {self.members[source]} "
                                            f"and {self.members[self.rank]} was refused in {state['what']}: {exc}")
                return
            while opening and opening[0].done():
                opening.pop(0).result()
                opened += 1
                moved = True
            if moved:
                idle, deadline = 0, time.monotonic() + self.timeout
                continue
            idle += 1
            # sleep(0) hands the GIL to the worker thread at once (a spinning thread keeps it for the
            # interpreter's 5 ms switch interval, which cost every sealed chunk milliseconds)
            time.sleep(min(_MAX_NAP, _NAP * (idle - _SPIN_POLLS)) if idle > _SPIN_POLLS else 0)
            if self.abort is not None and self.abort.is_set():  # the engine's word that ranks were lost
                self._drain(sends, recvs, opening, cancel=True)
                raise HvpsError(f"hvps: {state['what']} (sealed data plane) abandoned: ranks of the job were lost")
            if time.monotonic() > deadline:
                silent = sorted({self.members[dest] for _ in sends[:1]} | {self.members[source] for _ in recvs[:1]})
                self._drain(sends, recvs, opening, cancel=True)
                raise DataPlaneStall(f"hvps: {state['what']} (sealed data plane) failed: no data moved to or from "
                                     f"ranks {silent} for {self.timeout:g} s (HVPS_STALL_CHECK_TIME_SECONDS); a rank "
                                     "died or a link between ranks is down")

    @staticmethod
    def _drain(sends: list, recvs: list, opening: list, cancel: bool = False) -> None:
        """After a failure: finish what is still in flight, or (``cancel``: a peer is gone) cancel it without
        waiting, as the ring does; either way let the worker finish the chunks it is opening."""
        for item in sends + recvs:
            request = item[1]
            try:
                request.Cancel() if cancel else request.Wait()
            except Exception:  # noqa: BLE001 - an errored request is finished too
                pass
        for future in opening:
            future.result()

    def _begin(self, what: str) -> dict:
        self.tamper.refresh()
        self.sequence += 1
        return {"kind": _KINDS[what.split()[0]], "sequence": self.sequence, "what": f"{what} #{self.sequence}"}

    def _end(self, state: dict) -> None:
        """The verdict round: every rank learns whether any rank found a chunk that failed to open."""
        rounds = math.ceil(math.log2(self.size)) if self.size > 1 else 0
        failure = state.get("failure")
        verdict_state = dict(state, kind=_KINDS["verdict"])
        for r in range(rounds):
            dest, source = (self.rank + (1 << r)) % self.size, (self.rank - (1 << r)) % self.size
            mine = np.zeros(_VERDICT_BYTES, np.uint8)
            text = (failure or "").encode()[:_VERDICT_BYTES - 1]
            mine[:len(text)] = np.frombuffer(text, np.uint8)
            mine[-1] = 1 if failure else 0
            theirs = np.zeros(_VERDICT_BYTES, np.uint8)
            self._transfer(mine, dest, theirs, source, verdict_state, r)
            failure = failure or verdict_state.get("failure")
            if theirs[-1] and not failure:
                failure = bytes(theirs[:-1]).rstrip(b"\0").decode(errors="replace")
        if failure:
            raise HvpsError(f"hvps: {state['what']} failed: {failure}; nothing was returned. The network between "
                            "the hosts altered sealed data (HVPS_ENCRYPT): check it for an attacker or a faulty link")

    # -- the collectives ----------------------------------------------------------------------------

    def _pairwise(self, state: dict, outgoing, incoming, on_last_chunk: Optional[Callable[[int], None]] = None) -> None:
        """Step s = 1..n-1: send ``outgoing(to)`` to rank+s while receiving ``incoming(source)`` from rank-s;
        ``on_last_chunk``: the last step's ``on_chunk`` (see :meth:`_transfer`)."""
        exchanges = pairwise_exchanges(self.rank, self.size)
        for exchange in exchanges:
            to, source = exchange.to, exchange.source
            self._transfer(outgoing(to), to, incoming(source), source, state, exchange.step,
                           on_last_chunk if exchange is exchanges[-1] else None)

    def _ring_gather(self, state: dict, block) -> None:
        """Ring allgather: ``block(r)`` is rank r's bytes, filled in place on every rank."""
        right, left = ring_neighbours(self.rank, self.size)
        for step in ring_gather_steps(self.rank, self.size):
            self._transfer(block(step.send_block), right, block(step.recv_block), left, state, 1000 + step.step)

    def _reduce_blocks(self, state: dict, sendbuf: np.ndarray, out: np.ndarray, bounds: list, ufunc) -> None:
        """Rank r receives every rank's block r of ``sendbuf`` and folds them, in rank order, into ``out``."""
        flat = sendbuf.reshape(-1)
        lo, hi = bounds[self.rank]
        n = hi - lo
        parts = self.workspace.view(flat.dtype, n * self.size).reshape(self.size, n) if n else None
        if n:
            parts[self.rank] = flat[lo:hi]
        fold = ChunkFold(ufunc, parts, out, state) if n else None
        self._pairwise(state, lambda to: _bytes(flat[bounds[to][0]:bounds[to][1]]),
                       lambda source: _bytes(parts[source]) if n else None, fold and fold.upto)
        if fold:
            fold.upto(n * flat.itemsize)  # nothing left unless a chunk's bytes split an element

    def allreduce(self, sendbuf, recvbuf, op):
        state = self._begin("allreduce")
        flat = recvbuf.reshape(-1)
        bounds = segments(flat.size, self.size)
        ufunc = dtypes.combine(op, recvbuf.dtype)
        lo, hi = bounds[self.rank]
        # into recvbuf at once, even in place: this rank's block of sendbuf is copied aside first and never sent
        self._reduce_blocks(state, sendbuf, flat[lo:hi], bounds, ufunc)
        self._ring_gather(state, lambda r: _bytes(flat[bounds[r][0]:bounds[r][1]]))
        self._end(state)

    def reducescatter(self, sendbuf, recvbuf, counts, op):
        state = self._begin("reducescatter")
        self._reduce_blocks(state, sendbuf, recvbuf.reshape(-1), bounds_of_counts(counts),
                            dtypes.combine(op, recvbuf.dtype))
        self._end(state)

    def allgatherv(self, sendbuf, recvbuf, counts):
        state = self._begin("allgather")
        flat = recvbuf.reshape(-1)
        bounds = bounds_of_counts(counts)
        flat[slice(*bounds[self.rank])] = sendbuf.reshape(-1)
        self._ring_gather(state, lambda r: _bytes(flat[slice(*bounds[r])]))
        self._end(state)

    def broadcast(self, buf, root):
        state = self._begin(f"broadcast from rank {self.members[root]}")
        whole = _bytes(buf)
        empty = whole[:0]
        self._ring_gather(state, lambda r: whole if r == root else empty)
        self._end(state)

    def alltoallv(self, sendbuf, sendcounts, recvbuf, recvcounts):
        state = self._begin("alltoall")
        send, recv = sendbuf.reshape(-1), recvbuf.reshape(-1)
        sent, received = bounds_of_counts(sendcounts), bounds_of_counts(recvcounts)
        recv[slice(*received[self.rank])] = send[slice(*sent[self.rank])]
        self._pairwise(state, lambda to: _bytes(send[slice(*sent[to])]),
                       lambda source: _bytes(recv[slice(*received[source])]))
        self._end(state)

    def sendrecv(self, sendbuf, dest, recvbuf, source):
        state = self._begin("allreduce (Adasum exchange)")
        self._transfer(_bytes(sendbuf), dest, _bytes(recvbuf), source, state, 0)
        if "failure" in state:
            raise HvpsError(f"hvps: {state['what']} failed: {state['failure']}")

    def subset(self, ranks):
        members = [self.members[r] for r in ranks]
        inner = self.inner.subset(ranks)
        subset = SealedBackend(inner, members, self.keyring, [self.hosts[r] for r in ranks], self.seal_all,
                                  self.chunk, self.timeout)
        subset.interrupt_on(self.abort)
        return subset

    def close(self, failed=False):
        self._pool.shutdown(wait=not failed)
        self.inner.close(failed)


_uses: dict = {}


def keyring_uses(keyring: sealed_crypto.Keyring, members: list) -> int:
    """How many communicators over exactly ``members`` this rank has sealed before (the same on every
    member: process sets are made by their members, in the same order on each), so no two share keys."""
    key = (id(keyring), tuple(members))
    _uses[key] = _uses.get(key, 0) + 1
    return _uses[key]
