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
unless ``HVPS_ENCRYPT=all``. Each message is cut into chunks, each sealed just before it is sent and
opened as soon as it has arrived, while the chunks before and after it are on the wire. The
allreduce is one stream from its reduce-scatter's last step on: that step's chunks are folded as they
open (``ChunkFold``), each chunk of this rank's sum is sealed and sent on as soon as it is folded, and each
later ring step sends each chunk as soon as the step before opened it, so the link never waits for a
step to end. Every chunk travels as MPI messages small enough to go eagerly (``MESSAGE_BYTES``).

A chunk that fails to open never ends a collective early on one rank (the others would wait
for it): the rank notes the failure, carries on with the collective's messages, and every
collective ends with a verdict round (dissemination, ``ceil(log2 n)`` sealed 256-byte
messages), so every rank raises the same HvpsError, naming the peer and the collective.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Optional, Sequence

import numpy as np

from ...core import dtypes
from ...core.errors import DataPlaneStall, HvpsError
from ...core.settings import env_text
from .. import sealed_crypto
from ..buffers import FusionBuffer
from ..ring import IdlePolls
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
#: polls without progress before napping between polls (``ring.IdlePolls``): the naps grow while nothing moves (a
#: link slower than the cipher), so the waiting rank leaves the CPU to the other ranks and the kernel's network
#: stack. Measured on a loaded 2-core host, 64 MiB at 1 Gbit/s: 500 polls and a fixed 20 us nap cost 210-300 ms of
#: CPU per call and rank, 50 and growing naps 170-240
_SPIN_POLLS = 50
_TAG = 7301  # MPI tag of every message: the communicator is private to this backend, and MPI keeps order
#: bytes of the MPI messages a chunk travels in: within Open MPI's TCP eager limit (64 KiB with its headers), so
#: none waits on a rendezvous: a large message's reply queues behind the data its peer already streams (the BTL's
#: queue and the testbed's 100 ms tbf queue), and a step that starts while the link is full stalled for that long.
#: Measured at 1 Gbit/s, 2 emulated hosts, a 64 MiB reduce-scatter and allgather streamed chunk by chunk: 4 MiB
#: messages 780-960 ms, these 564-656 ms (560 ms of link time)
MESSAGE_BYTES = 65536 - 1024
#: the first step number of a ring allgather
_GATHER_STEP = 1000


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


class Outgoing:
    """One message of a stream (:meth:`SealedBackend._stream`): the bytes ``data`` to ``peer`` at ``step``.

    ``ready()``, when given, says how many leading bytes of ``data`` hold their final value yet (the stream
    sends each chunk once they cover it); ``units`` are its chunks, set by the stream."""

    def __init__(self, data: Optional[np.ndarray], peer: int, step: int,
                 ready: Optional[Callable[[], int]] = None) -> None:
        self.data, self.peer, self.step, self.ready = data, peer, step, ready
        self.units: list = []


class Incoming:
    """One message of a stream: ``data``'s bytes from ``peer`` at ``step``.

    ``on_chunk(stop)``, when given, runs in chunk order each time ``data[:stop]`` is
    all usable (authenticated and opened, or received in clear): the caller consumes them while later chunks
    are on the wire; it never runs for a chunk that failed to open, nor for any chunk after it. ``usable``
    is that ``stop``. ``after``: an :class:`Outgoing` sending these same bytes first (in place): chunk k is
    received only once its chunk k is sent."""

    def __init__(self, data: Optional[np.ndarray], peer: int, step: int,
                 on_chunk: Optional[Callable[[int], None]] = None, after: Optional[Outgoing] = None) -> None:
        self.data, self.peer, self.step, self.on_chunk, self.after = data, peer, step, on_chunk, after
        self.usable, self.failed = 0, False
        self.units: list = []


class _Unit:
    """Chunk ``k`` of a message: its bytes ``[start, stop)``, nonce (None: in clear), place in the stream,
    and the MPI requests moving it."""

    __slots__ = ("message", "k", "start", "stop", "nonce", "index", "requests", "box", "done")

    def __init__(self, message, k: int, start: int, stop: int, nonce: Optional[bytes], index: int) -> None:
        self.message, self.k, self.start, self.stop, self.nonce, self.index = message, k, start, stop, nonce, index
        self.requests: list = []
        self.box = None
        self.done = False

    @property
    def size(self) -> int:
        return self.stop - self.start

    def plain(self) -> np.ndarray:
        return self.message.data[self.start:self.stop]


def _pieces(box: np.ndarray) -> list:
    """The MPI messages a chunk travels in (``box``: its bytes on the wire), the same on both sides.

    Every chunk, even an exchange's first ones, posted at once: the peer may already be streaming when they
    are (it entered the collective first), and whole 4 MiB chunks there measured 860 ms at 1 Gbit/s where
    pieces took 600; pieces cost more CPU (at 10 Gbit/s about 15 ms per 64 MiB call and rank)."""
    return [box[lo:lo + MESSAGE_BYTES] for lo in range(0, box.size, MESSAGE_BYTES)]


class ChunkFold:
    """The reduce-scatter's fold, done chunk by chunk while the last step's chunks arrive.

    ``parts`` holds every rank's contribution to this rank's block, one row per rank (``out`` may be the
    memory of row 0 or 1, not of a later row: see ``fold_in_rank_order``); once the last
    step's chunks up to byte ``stop`` are usable, :meth:`upto` folds the elements they complete, in
    rank order, into ``out``. Element by element this is the whole block's fold, so the bits are the
    same whatever the chunk size (a chunk that splits an element leaves it for the next call).
    Nothing is folded once ``state`` holds a failure: no byte of a collective that failed is used.
    """

    def __init__(self, ufunc, parts: Sequence[np.ndarray], out: np.ndarray, state: dict) -> None:
        self.ufunc, self.parts, self.out, self.state = ufunc, list(parts), out, state
        self.folded = 0  # elements of ``out`` folded so far

    def upto(self, stop_byte: int) -> None:
        """Fold every element that bytes ``[0, stop_byte)`` of each row complete (call with growing stops)."""
        stop = stop_byte // self.out.itemsize
        if stop > self.folded and "failure" not in self.state:
            window = slice(self.folded, stop)
            fold_in_rank_order(self.ufunc, [row[window] for row in self.parts], self.out[window])
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
        """Send the bytes ``send`` to ``dest`` while receiving ``recv``'s bytes from ``source`` (one message
        each way, see :meth:`_stream`); ``on_chunk`` as :class:`Incoming`'s."""
        self._stream([Outgoing(send, dest, step)], [Incoming(recv, source, step, on_chunk)], state)

    def _stream(self, outgoing: list, incoming: list, state: dict) -> None:
        """Move every message of ``outgoing`` and ``incoming`` as one stream of chunks.

        Chunks are sealed and sent in list order (chunk k of message m when ``m.ready()`` covers it), up to
        ``WINDOW`` in flight, and received in list order, ``WINDOW`` posted ahead (each pass posts receives
        before it sends: a rank busy sending left its peer's data unread), each opened as soon as it has
        arrived. All on this thread: ``cryptography`` holds the GIL while it seals or opens, so a worker thread
        only traded the GIL with this one (RESULTS.md, issue 42 item 4). A message that waits on another's
        bytes (the allgather's on the reduce-scatter's fold, each ring step's on the step before) starts as
        soon as its first chunk can, so the link never waits for a step to end. Each chunk travels as MPI
        messages of at most ``MESSAGE_BYTES``: sent eagerly, none waits on a rendezvous reply queued behind the
        data a peer is already streaming. Nonces are drawn in list order per direction, on both sides alike."""
        from mpi4py import MPI

        sends = self._units(outgoing, self.send_dir)
        recvs = self._units(incoming, self.recv_dir)
        kind, seq = state["kind"], state["sequence"]

        def aad(unit: _Unit) -> bytes:
            return sealed_crypto.aad(kind, seq, unit.message.step, unit.k, unit.size)

        def seal(unit: _Unit) -> np.ndarray:
            box = self._slot(unit.index % WINDOW, unit.size + sealed_crypto.TAG)
            self.send_dir[unit.message.peer].seal_into(unit.nonce, unit.plain(), box, aad(unit))
            return box

        def open_(unit: _Unit) -> None:
            message = unit.message
            self.tamper.on_receive(unit.box)
            try:
                self.recv_dir[message.peer].open_into(unit.nonce, unit.box, unit.plain(), aad(unit))
            except sealed_crypto.invalid_tag():
                state.setdefault("failure", f"a chunk from rank {self.members[message.peer]} failed authentication on "
                                            f"rank {self.members[self.rank]} in {state['what']}")
                message.failed = True
            usable(unit)

        def usable(unit: _Unit) -> None:  # in chunk order
            message = unit.message
            if not message.failed:
                message.usable = unit.stop
                if message.on_chunk is not None:
                    message.on_chunk(unit.stop)

        def ready(unit: _Unit) -> bool:  # may chunk ``unit`` be sealed and sent (or received into) yet
            gate = unit.message.ready
            return gate is None or "failure" in state or unit.stop <= gate()

        def may_receive(unit: _Unit) -> bool:  # in place: the same bytes are sent first
            before = unit.message.after
            return before is None or unit.k >= len(before.units) or before.units[unit.k].done

        posted_s = done_s = posted_r = done_r = 0
        # sleep(0) yields the core at once to whatever else is runnable (the peer's rank on a shared host, the
        # kernel's network work); longer naps once nothing has moved for a while
        polls, deadline = IdlePolls(_SPIN_POLLS, yield_core=True), time.monotonic() + self.timeout
        while done_s < len(sends) or done_r < len(recvs):
            moved = False
            while posted_r < len(recvs) and posted_r - done_r < WINDOW and may_receive(recvs[posted_r]):
                unit = recvs[posted_r]
                unit.box = self._slot(WINDOW + unit.index % WINDOW, unit.size + sealed_crypto.TAG) \
                    if unit.nonce is not None else unit.plain()
                unit.requests = [self.comm.Irecv(piece, unit.message.peer, _TAG) for piece in _pieces(unit.box)]
                posted_r += 1
            if posted_s < len(sends) and posted_s - done_s < WINDOW and ready(sends[posted_s]):
                unit = sends[posted_s]
                box = seal(unit) if unit.nonce is not None else unit.plain()
                unit.requests = [self.comm.Isend(piece, unit.message.peer, _TAG) for piece in _pieces(box)]
                posted_s += 1
                moved = True
            try:  # each call progresses every request; the oldest first, as they finish in order
                while done_s < posted_s and MPI.Request.Testall(sends[done_s].requests):
                    sends[done_s].done = True
                    done_s += 1
                    moved = True
                while done_r < posted_r and MPI.Request.Testall(recvs[done_r].requests):
                    unit = recvs[done_r]
                    done_r += 1
                    moved = True
                    open_(unit) if unit.nonce is not None else usable(unit)
            except MPI.Exception as exc:  # e.g. a message longer than the chunk expected: truncated, never stored
                self._drain(sends[done_s:posted_s] + recvs[done_r:posted_r])
                state.setdefault("failure", f"a message between ranks {self._peers(outgoing, incoming)} and "
                                            f"{self.members[self.rank]} was refused in {state['what']}: {exc}")
                return
            if moved:
                polls.moved()
                deadline = time.monotonic() + self.timeout
                continue
            polls.pause()
            if self.abort is not None and self.abort.is_set():  # the engine's word that ranks were lost
                self._drain(sends[done_s:posted_s] + recvs[done_r:posted_r], cancel=True)
                raise HvpsError(f"hvps: {state['what']} (sealed data plane) abandoned: ranks of the job were lost")
            if time.monotonic() > deadline:
                waiting = sends[done_s:done_s + 1] + recvs[done_r:done_r + 1]
                silent = sorted({self.members[unit.message.peer] for unit in waiting})
                self._drain(sends[done_s:posted_s] + recvs[done_r:posted_r], cancel=True)
                raise DataPlaneStall(f"hvps: {state['what']} (sealed data plane) failed: no data moved to or from "
                                     f"ranks {silent} for {self.timeout:g} s (HVPS_STALL_CHECK_TIME_SECONDS); a rank "
                                     "died or a link between ranks is down")

    def _units(self, messages: list, directions: dict) -> list:
        """The chunks of ``messages`` in order, each with its nonce (drawn now, in order) when sealed."""
        units = []
        for message in messages:
            message.units = []
            size = message.data.size if message.data is not None else 0
            sealed = size > 0 and self.sealed(message.peer)
            for k, lo in enumerate(range(0, size, self.chunk)):
                nonce = directions[message.peer].next_nonce() if sealed else None
                unit = _Unit(message, k, lo, min(lo + self.chunk, size), nonce, len(units))
                message.units.append(unit)
                units.append(unit)
        return units

    def _peers(self, outgoing: list, incoming: list) -> str:
        return ", ".join(str(self.members[p]) for p in sorted({m.peer for m in outgoing + incoming}))

    @staticmethod
    def _drain(units: list, cancel: bool = False) -> None:
        """After a failure: finish what is still in flight, or (``cancel``: a peer is gone) cancel it without
        waiting, as the ring does."""
        for unit in units:
            for request in unit.requests:
                try:
                    request.Cancel() if cancel else request.Wait()
                except Exception:  # noqa: BLE001 - an errored request is finished too
                    pass

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

    def _pairwise(self, state: dict, outgoing, incoming) -> None:
        """Step s = 1..n-1: send ``outgoing(to)`` to rank+s while receiving ``incoming(source)`` from rank-s."""
        for exchange in pairwise_exchanges(self.rank, self.size):
            to, source = exchange.to, exchange.source
            self._transfer(outgoing(to), to, incoming(source), source, state, exchange.step)

    def _ring_gather(self, state: dict, block, first: Optional[Outgoing] = None,
                     first_ready: Optional[Callable[[], int]] = None) -> tuple:
        """Ring allgather: ``block(r)`` is rank r's bytes, filled in place on every rank.

        Returns the ring's messages (outgoing, incoming) for :meth:`_stream`: each step sends the block the
        step before received, chunk by chunk as it opens; ``first_ready``: how much of this rank's own
        block is final yet; ``first``: the message that sends the first step's incoming bytes before."""
        right, left = ring_neighbours(self.rank, self.size)
        outgoing, incoming = [], []
        ready, after = first_ready, first
        for step in ring_gather_steps(self.rank, self.size):
            outgoing.append(Outgoing(block(step.send_block), right, _GATHER_STEP + step.step, ready))
            incoming.append(Incoming(block(step.recv_block), left, _GATHER_STEP + step.step, after=after))
            ready, after = (lambda received=incoming[-1]: received.usable), None
        return outgoing, incoming

    def _reduce_blocks(self, state: dict, sendbuf: np.ndarray, out: np.ndarray, bounds: list, ufunc,
                       gather: Optional[Callable] = None) -> None:
        """Rank r receives every rank's block r of ``sendbuf`` and folds them, in rank order, into ``out``.

        The last step folds each chunk as it opens (:class:`ChunkFold`); ``gather(sent, folded)``, when given,
        returns more messages (outgoing, incoming) to stream with that step: ``sent`` is the last step's
        outgoing message, ``folded()`` how many bytes of ``out`` are final yet."""
        flat = sendbuf.reshape(-1)
        lo, hi = bounds[self.rank]
        n = hi - lo
        parts = self.workspace.view(flat.dtype, n * self.size).reshape(self.size, n) if n else None
        fold = None
        if n:
            rows = list(parts)
            if self.rank < 2 or not np.may_share_memory(flat[lo:hi], out):
                rows[self.rank] = flat[lo:hi]  # folded from where it is: no copy
            else:  # in place, and folded into after rows 0 and 1 were: aside first
                rows[self.rank][...] = flat[lo:hi]
            fold = ChunkFold(ufunc, rows, out, state)

        def to(peer: int) -> np.ndarray:
            return _bytes(flat[bounds[peer][0]:bounds[peer][1]])

        def into(peer: int) -> Optional[np.ndarray]:
            return _bytes(parts[peer]) if n else None

        exchanges = pairwise_exchanges(self.rank, self.size)
        for exchange in exchanges[:-1]:
            self._transfer(to(exchange.to), exchange.to, into(exchange.source), exchange.source, state, exchange.step)
        last = exchanges[-1]
        sent = Outgoing(to(last.to), last.to, last.step)
        outgoing, incoming = [sent], [Incoming(into(last.source), last.source, last.step, fold and fold.upto)]
        if gather is not None:
            more_out, more_in = gather(sent, (lambda: fold.folded * flat.itemsize) if fold else None)
            outgoing, incoming = outgoing + more_out, incoming + more_in
        self._stream(outgoing, incoming, state)
        if fold:
            fold.upto(n * flat.itemsize)  # nothing left unless a chunk's bytes split an element

    def allreduce(self, sendbuf, recvbuf, op):
        state = self._begin("allreduce")
        flat = recvbuf.reshape(-1)
        bounds = segments(flat.size, self.size)
        ufunc = dtypes.combine(op, recvbuf.dtype)
        lo, hi = bounds[self.rank]
        # into recvbuf at once, even in place: this rank's block of sendbuf is copied aside first and never sent;
        # the allgather streams with the reduce-scatter's last step, each chunk of this rank's sum sent once folded
        self._reduce_blocks(state, sendbuf, flat[lo:hi], bounds, ufunc,
                            lambda sent, folded: self._ring_gather(state, lambda r: _bytes(flat[bounds[r][0]:bounds[r][1]]),
                                                                   sent, folded))
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
        self._stream(*self._ring_gather(state, lambda r: _bytes(flat[slice(*bounds[r])])), state)
        self._end(state)

    def broadcast(self, buf, root):
        state = self._begin(f"broadcast from rank {self.members[root]}")
        whole = _bytes(buf)
        empty = whole[:0]
        self._stream(*self._ring_gather(state, lambda r: whole if r == root else empty), state)
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
        self.inner.close(failed)


_uses: dict = {}


def keyring_uses(keyring: sealed_crypto.Keyring, members: list) -> int:
    """How many communicators over exactly ``members`` this rank has sealed before (the same on every
    member: process sets are made by their members, in the same order on each), so no two share keys."""
    key = (id(keyring), tuple(members))
    _uses[key] = _uses.get(key, 0) + 1
    return _uses[key]
