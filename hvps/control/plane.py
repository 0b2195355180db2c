"""The control plane: small JSON messages between each rank and its parent over TCP, up to rank 0.

MPI offers no way to wait for a message without spinning a core, so the engine
negotiates over plain sockets instead: its thread blocks in ``select`` until a
message, a local submission or a deadline arrives, costing no CPU while it
waits and answering within microseconds. A closed connection tells at once
that a rank has died, even while the engine is busy in a transfer: a watch thread
notices it (``liveness.py``). Messages are JSON, never pickle.

Rank 0's port is open to the network while ``init`` runs, so anything may connect.
A connection is trusted only after a mutual challenge-response proves it holds the
job's key (``control_handshake.py``), and every later frame carries an HMAC
(``control_wire.py``). Strangers are dropped and logged, one at a time and each
within its own deadline, so that none of them can stop, stall or bloat the job.

The connections form a tree (``tree.py``, ``HVPS_CONTROL_FANOUT``): a star below that many ranks,
else every rank with children listens the way rank 0 does, and relays its block's announcements up
and rank 0's responses down (``relay.py``).
"""

from __future__ import annotations

import fcntl
import logging
import secrets
import selectors
import socket
import struct
import threading
import time
from typing import Callable, Optional

from ..core.errors import HvpsError
from ..core.settings import env_text
from .handshake import ServerHandshake, client_handshake
from .liveness import CLOSED, PeerWatch
from .tree import position
from .wire import MAX_AUTHENTICATED, FrameReader, ProtocolError, Session, encode

log = logging.getLogger("hvps")


class _Throttle:
    """At most ``burst`` warnings about refused and dropped connections per ``interval`` seconds; the rest
    are counted and summed up in one line (a connection flood once wrote 1,600 lines in 20 s)."""

    def __init__(self, burst: int = 10, interval: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.interval, self.clock = burst, interval, clock
        self._lock = threading.Lock()
        self.start, self.count, self.suppressed = clock(), 0, 0

    def warning(self, message: str, *args) -> None:
        with self._lock:
            now = self.clock()
            if now - self.start >= self.interval:
                self._flush()
                self.start, self.count = now, 0
            if self.count < self.burst:
                self.count += 1
                log.warning(message, *args)
            else:
                self.suppressed += 1

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        if self.suppressed:
            log.warning("hvps control plane: %d more connections refused or dropped in the last %.0f s (not logged "
                        "one by one)", self.suppressed, self.clock() - self.start)
        self.suppressed = 0


#: the warnings of every listener in this process (rank 0's, and a relay's in a control-plane tree)
_dropped = _Throttle()
_SIOCGIFADDR = 0x8915
#: each connection must finish its handshake within this many seconds of connecting
HANDSHAKE_SECONDS = 5.0
#: connections rank 0 keeps in handshake at once; more are refused until some finish
_MAX_PENDING = 64
#: bytes per recv: below malloc's mmap threshold (a 1 MiB buffer cost 16 us per message in mmap/munmap)
_RECV_BYTES = 1 << 16
#: what children send their parent, and a parent its children; "bye" ends a connection on purpose (close()),
#: "lost" is a rank's last word when ranks died; "failed" (with "stall"), "probe" and "alive" make the roll call
#: that names stopped ranks (see liveness.py), and never reach the engine
_REQUESTS = frozenset({"requests", "whole", "batch", "epoch", "bye", "lost", "failed", "stall", "alive"})
_RESPONSES = frozenset({"responses", "tuning", "bye", "lost", "probe"})


def interface_address(name: str) -> Optional[str]:
    """The IPv4 address of network interface ``name`` (Linux), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def candidate_addresses() -> list:
    """Addresses other ranks may reach this host at, most specific first.

    ``HVPS_CONTROL_ADDR`` wins; ``HVPS_NETWORK_INTERFACE`` (hvpsrun's
    ``--network-interface``) restricts to one interface; otherwise every
    interface's IPv4 address, loopback last.
    """
    explicit = env_text("HVPS_CONTROL_ADDR")
    if explicit:
        return [explicit]
    wanted = env_text("HVPS_NETWORK_INTERFACE")
    names = [wanted] if wanted else [name for _, name in socket.if_nameindex()]
    found = [a for a in (interface_address(n) for n in names) if a]
    if wanted and not found:
        raise HvpsError(f"HVPS_NETWORK_INTERFACE={wanted!r} has no IPv4 address on {socket.gethostname()}")
    return sorted(set(found), key=lambda a: (a.startswith("127."), a))


def listen_address() -> str:
    """Where rank 0 listens: the address of ``HVPS_NETWORK_INTERFACE`` when set, else every interface."""
    return candidate_addresses()[0] if env_text("HVPS_NETWORK_INTERFACE") else ""


def reachable(addresses: list, port: int, what: str, timeout: float = 2.0) -> tuple:
    """The first of ``addresses`` that accepts a connection on ``port``, and this host's address
    towards it; an HvpsError naming ``what`` and the addresses tried when none does."""
    for address in addresses:
        try:
            with socket.create_connection((address, port), timeout=timeout) as probe:
                return address, probe.getsockname()[0]
        except OSError:
            continue
    raise HvpsError(
        f"could not reach {what} at any of {addresses} port {port} from {socket.gethostname()}; set "
        "HVPS_NETWORK_INTERFACE (hvpsrun --network-interface) to an interface every host can reach")


class ConnectionClosed(Exception):
    """The peer closed its end (it exited or its host went away)."""


class _Peer:
    """One authenticated, non-blocking connection.

    Its engine thread reads it; the watch thread too, once the peer's end has closed (to find its
    last words), so reading holds ``lock``, and what the watch read waits in ``stash``.
    """

    def __init__(self, sock: socket.socket, rank: int, session: Session, reader: FrameReader,
                 accepts: frozenset) -> None:
        self.sock, self.rank, self.session, self.reader = sock, rank, session, reader
        self.accepts = accepts
        self.reader.limit = MAX_AUTHENTICATED
        self.outbox = bytearray()
        #: shut our sending side once the outbox is out (the last word: see ControlPlane.farewell)
        self.closing = False
        self.lock = threading.Lock()
        self.stash: list = []
        #: the stream has ended (the peer's end closed, or it broke the protocol)
        self.ended = False
        #: how it ended: with a goodbye, with a notice of lost ranks, or neither (a dead peer)
        self.said_bye = False
        self.notice: dict = {}
        self.judged = False

    def flush(self) -> None:
        """Send what the socket takes now (never blocks)."""
        while self.outbox:
            try:
                sent = self.sock.send(self.outbox)
            except BlockingIOError:
                return
            except OSError as exc:
                self.outbox.clear()
                raise ConnectionClosed(str(exc)) from exc
            del self.outbox[:sent]
        if self.closing:
            self.closing = False
            try:
                self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def read(self) -> list:
        """The messages that have arrived: what the watch read first, then what the socket holds now.
        ``ended`` then tells whether the stream is over."""
        with self.lock:
            messages, self.stash = self.stash, []
            messages += self._receive(until_end=False)
            return messages

    def drain(self) -> None:
        """The peer's end has closed: read all that is left into the stash (the watch thread)."""
        with self.lock:
            self.stash += self._receive(until_end=True)

    def _receive(self, until_end: bool) -> list:
        messages: list = []
        while not self.ended:
            try:
                data = self.sock.recv(_RECV_BYTES)
            except BlockingIOError:
                self.ended = until_end  # the peer shut its end: nothing more will come
                break
            except OSError:
                self.ended = True
                break
            if not data:
                self.ended = True
                break
            try:
                for payload in self.reader.feed(data):
                    message = self.session.open(payload, self.accepts)
                    if "bye" in message:
                        self.said_bye = True
                    elif "lost" in message:
                        self.notice = _lost_ranks(message["lost"])
                    else:
                        messages.append(message)
            except ProtocolError as exc:
                log.error("hvps control plane: dropping rank %d: %s", self.rank, exc)
                self.ended = True
                break
            if not until_end and len(data) < _RECV_BYTES:  # a full read: more may wait in the socket
                break
        return messages

    def judge(self) -> dict:
        """Once the stream has ended, and only the first time: the ranks it tells are lost
        (its notice, else this peer unless it said goodbye). Empty otherwise."""
        with self.lock:
            if not self.ended or self.judged:
                return {}
            self.judged = True
            return self.notice or ({} if self.said_bye else {self.rank: CLOSED})


def _lost_ranks(value: object) -> dict:
    """Rank 0's notice ``{"rank": why}`` as ``{rank: why}``; ProtocolError if it is not one."""
    if not isinstance(value, dict) or not value:
        raise ProtocolError("a notice of lost ranks must name them")
    try:
        return {int(rank): str(why) for rank, why in value.items()}
    except ValueError:
        raise ProtocolError("a notice of lost ranks must name them by number") from None


class _Writer(threading.Thread):
    """Sends what the engine thread could not send at once, so that a large reply never
    waits for the engine (which may be inside a collective the receiver also needs)."""

    def __init__(self, peers: dict) -> None:
        super().__init__(name="hvps-control-writer", daemon=True)
        self.peers = peers
        self.lock = threading.Condition()
        self.stopping = False

    def run(self) -> None:
        drain_until = None
        while True:
            with self.lock:
                while not self.stopping and not any(p.outbox for p in list(self.peers.values())):
                    self.lock.wait()
                busy = [p for p in list(self.peers.values()) if p.outbox and p.sock.fileno() >= 0]
                if self.stopping:
                    drain_until = drain_until or time.monotonic() + 2.0
                    if not busy or time.monotonic() > drain_until:
                        return
            with selectors.DefaultSelector() as selector:
                for peer in busy:
                    selector.register(peer.sock, selectors.EVENT_WRITE, peer)
                try:
                    ready = [key.data for key, _ in selector.select(0.5)]
                except (OSError, ValueError):
                    ready = []  # a socket was closed meanwhile: look again
            with self.lock:
                for peer in ready:
                    try:
                        peer.flush()
                    except ConnectionClosed:
                        pass  # the engine's poll sees the closed connection

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify()
        self.join(timeout=3)


class ControlPlane:
    """Each rank holds one connection to its parent in the tree (none on rank 0) and one per child."""

    def __init__(self, comm, connect_timeout: float = 60.0, key: Optional[bytes] = None,
                 fanout: int = 0) -> None:
        """Connect the job's ranks over ``comm``. ``key`` authenticates the connections when every rank
        already holds it (derived from the job's secret); without it rank 0 draws one and sends it
        over ``comm``. ``fanout``: children per rank (``tree.py``; 0: a star)."""
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._fanout = fanout or max(self.size - 1, 1)
        self.position = position(self.rank, self.size, self._fanout)
        self.parent, self.children = self.position.parent, self.position.children
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for sock in (self._wake_r, self._wake_w):
            sock.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._wake_selector = selectors.DefaultSelector()
        self._wake_selector.register(self._wake_r, selectors.EVENT_READ, None)
        self.peers: dict[int, _Peer] = {}
        listener, offer = None, None
        if self.children:
            listener = socket.create_server((listen_address(), 0), backlog=max(len(self.children), 16) + _MAX_PENDING)
            offer = [candidate_addresses(), listener.getsockname()[1], b""]
        if self.rank == 0 and offer is not None and not key:
            # The key travels over the bootstrap communicator only (MPI, or an authenticated store when the
            # ranks share a secret, which then never travels), never over the control connection.
            offer[2] = secrets.token_bytes(32)
        offers = comm.allgather(offer) if self.size > 1 else [offer]
        key = key or (offers[0][2] if offers[0] else b"")
        try:
            if self.parent is not None:  # first up, then down: the parent listens before it connects
                addresses, port, _ = offers[self.parent]
                self._connect(addresses, port, key, connect_timeout)
            if listener is not None:
                self._accept(listener, key, connect_timeout)
        finally:
            if listener is not None:
                listener.close()
        comm.Barrier()
        for peer in self.peers.values():
            peer.sock.setblocking(False)
            peer.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._selector.register(peer.sock, selectors.EVENT_READ, peer)
        self._writer = _Writer(self.peers)
        self._writer.start()
        self._watch: Optional[PeerWatch] = None
        self._on_lost: Optional[Callable[[dict], None]] = None
        #: peers whose stream the watch found ended: the next poll drops them
        self._ended: list = []
        #: children that reported a collective failed in their data plane (rank -> what failed); those whose
        #: transfer stalled; the roll call's round and who answered its probe (rank -> round): see ``roll_call``
        self.failed: dict[int, str] = {}
        self.stalled: set[int] = set()
        self._round = 0
        self._answered: dict[int, int] = {}

    @property
    def is_star(self) -> bool:
        """Whether every rank's parent is rank 0 (``tree.py``: at most ``fanout + 1`` ranks)."""
        return self.size - 1 <= self._fanout

    def _accept(self, listener: socket.socket, key: bytes, timeout: float) -> None:
        """Run handshakes side by side until every other rank has proved itself."""
        deadline = time.monotonic() + timeout
        listener.setblocking(False)
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ, None)
        pending: dict = {}  # socket -> (ServerHandshake, expiry, address)
        try:
            while any(child not in self.peers for child in self.children):
                now = time.monotonic()
                if now >= deadline:
                    missing = sorted(set(self.children) - set(self.peers))
                    raise HvpsError(
                        f"rank {self.rank} heard nothing from ranks {missing} within {timeout:g} s on port "
                        f"{listener.getsockname()[1]}; set HVPS_NETWORK_INTERFACE (hvpsrun --network-interface) "
                        "to an interface every host can reach")
                wait = min([deadline] + [expiry for _, expiry, _ in pending.values()]) - now
                for event, _ in selector.select(max(0.0, wait)):
                    if event.data is None:
                        self._admit(listener, key, selector, pending)
                    else:
                        self._advance(event.fileobj, selector, pending)
                now = time.monotonic()
                for sock, (_, expiry, _) in list(pending.items()):
                    if now >= expiry:
                        self._refuse(sock, selector, pending, f"no handshake within {HANDSHAKE_SECONDS:g} s")
        finally:
            for sock in list(pending):
                self._refuse(sock, selector, pending, "still in its handshake when every rank had joined")
            selector.close()
            _dropped.flush()

    def _admit(self, listener: socket.socket, key: bytes, selector, pending: dict) -> None:
        try:
            sock, address = listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        if len(pending) >= _MAX_PENDING:
            _dropped.warning("hvps control plane: refused %s: %d handshakes already open", address[0], _MAX_PENDING)
            sock.close()
            return
        sock.setblocking(False)
        handshake = ServerHandshake(key, self.size, taken=self.peers, expected=self.children)
        pending[sock] = (handshake, time.monotonic() + HANDSHAKE_SECONDS, address[0])
        selector.register(sock, selectors.EVENT_READ, handshake)

    def _advance(self, sock: socket.socket, selector, pending: dict) -> None:
        handshake, _, _ = pending[sock]
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError as exc:
            self._refuse(sock, selector, pending, str(exc))
            return
        if not data:
            self._refuse(sock, selector, pending, "closed the connection")
            return
        try:
            reply = handshake.feed(data)
            if reply and sock.send(reply) != len(reply):  # a real peer waits for it: its buffer has room
                raise ProtocolError("does not read its replies")
        except (ProtocolError, OSError) as exc:
            self._refuse(sock, selector, pending, str(exc))
            return
        if handshake.session is not None:
            selector.unregister(sock)
            del pending[sock]
            self.peers[handshake.rank] = _Peer(sock, handshake.rank, handshake.session, handshake.reader, _REQUESTS)

    @staticmethod
    def _refuse(sock: socket.socket, selector, pending: dict, reason: str) -> None:
        _, _, address = pending.pop(sock)
        _dropped.warning("hvps control plane: dropped a connection from %s: %s", address, reason)
        selector.unregister(sock)
        sock.close()

    def _connect(self, addresses: list, port: int, key: bytes, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        errors = {}
        while time.monotonic() < deadline:
            for address in addresses:
                try:
                    sock = socket.create_connection((address, port), timeout=2)
                except OSError as exc:
                    errors[address] = exc
                    continue
                try:
                    session = client_handshake(sock, key, self.rank,
                                               min(deadline, time.monotonic() + 2 * HANDSHAKE_SECONDS))
                except (ProtocolError, OSError) as exc:
                    errors[address] = exc
                    sock.close()
                    continue
                self.peers[self.parent] = _Peer(sock, self.parent, session, FrameReader(MAX_AUTHENTICATED),
                                                _RESPONSES)
                return
            time.sleep(0.2)
        tried = ", ".join(f"{a}:{port} ({e})" for a, e in errors.items())
        raise HvpsError(
            f"rank {self.rank} could not reach rank {self.parent}'s control port: {tried}; set HVPS_NETWORK_INTERFACE "
            "(hvpsrun --network-interface) or HVPS_CONTROL_ADDR to an address every host can reach"
        )

    def watch(self, on_lost: Callable[[dict], None]) -> None:
        """From now on, call ``on_lost({rank: why})`` (from any thread, at once) when ranks die: a peer's
        connection ends without a goodbye, or a peer's last word names the ranks it lost. A goodbye
        (a peer that shut down) is not a loss: ``poll`` reports that connection as closed."""
        self._on_lost = on_lost
        if self.peers:
            self._watch = PeerWatch([(peer.sock, peer) for peer in self.peers.values()], self._hung_up)
            self._watch.start()

    def _hung_up(self, peer: _Peer) -> None:
        """The watch thread saw ``peer``'s end close: read its last words, judge, and let the engine's
        next poll take what it read and drop the connection."""
        peer.drain()
        self._ended.append(peer)
        self._judge(peer)
        self.wake()

    def _judge(self, peer: _Peer) -> None:
        lost = peer.judge()
        if lost and self._on_lost is not None:
            self._on_lost(lost)

    def farewell(self, lost: dict) -> None:
        """This rank's last word: tell every peer still there which ranks were lost, then shut our sending
        side (so that a rank whose engine is busy notices at once too, through its watch). Each rank
        passes the word on, so it floods the tree."""
        body = encode({"lost": {str(rank): why for rank, why in lost.items()}})
        for rank, peer in list(self.peers.items()):
            if rank not in lost:
                with self._writer.lock:
                    peer.closing = True
                self._send_encoded(rank, body)

    def wake(self) -> None:
        """Interrupt a ``poll`` in progress (called by user threads after queueing work)."""
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already awake, or closing

    def send(self, rank: int, message: dict) -> None:
        """Queue ``message`` for ``rank``; send what the socket takes now, the rest from the writer thread."""
        self._send_encoded(rank, encode(message))

    def send_down(self, message: dict) -> None:
        """``send`` to every child, encoding ``message`` once."""
        body = encode(message)
        for rank in self.children:
            self._send_encoded(rank, body)

    def _send_to_all(self, body: bytes) -> None:
        for rank in list(self.peers):
            self._send_encoded(rank, body)

    def _send_encoded(self, rank: int, body: bytes) -> None:
        peer = self.peers.get(rank)
        if peer is None:
            return
        with self._writer.lock:
            idle = not peer.outbox
            peer.outbox += peer.session.seal_encoded(body)
            if idle:
                try:
                    peer.flush()
                except ConnectionClosed:
                    return  # reported by the next poll
            if peer.outbox:
                self._writer.lock.notify()

    def wait(self, timeout: Optional[float], messages: bool = True) -> None:
        """Block until a message (only a wake-up when ``messages`` is false), a wake-up or ``timeout``
        (None: forever); reads nothing, so that whichever thread then runs the engine's cycle reads
        with ``poll``. An idle engine waits for wake-ups only: a thread asleep on the sockets would be
        woken by every message that a waiter driving the engine reads (an inter-processor interrupt,
        tens of microseconds on a virtual machine, charged to the sender)."""
        if not self._ended:
            (self._selector if messages else self._wake_selector).select(timeout)

    def poll(self, timeout: Optional[float]) -> tuple:
        """Wait up to ``timeout`` s (None: until something happens).

        Returns ``(messages, closed)``: a list of ``(rank, message)`` and the ranks
        whose connection closed. A closed connection that tells of lost ranks is also
        reported to ``watch``'s callback, before this returns.
        """
        messages, closed = [], []
        ready = [key.data for key, _ in self._selector.select(timeout)]
        if self._ended:
            ready += [self._ended.pop() for _ in range(len(self._ended))]
        for peer in ready:
            if peer is None:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except BlockingIOError:
                    pass
                continue
            if self.peers.get(peer.rank) is not peer:
                continue  # dropped already
            messages.extend((peer.rank, m) for m in peer.read() if not self._roll(peer.rank, m))
            if peer.ended:
                self._judge(peer)
                closed.append(peer.rank)
                self._drop(peer)
        return messages, closed

    # -- the roll call that names stopped ranks (liveness.py) ------------------------------
    def report_failure(self, what: str, stall: bool) -> None:
        """Tell the parent that ``what`` (a collective and its error) failed in this rank's data plane, by a
        ``stall`` (nothing moved for the stall time) or not: this rank is out of it and alive, and counts as
        having answered rank 0's roll call; a stall makes rank 0 call one."""
        if self.parent is not None:
            self.send(self.parent, {"failed": what, "stall": stall})

    def _roll(self, rank: int, message: dict) -> bool:
        """Handle ``message`` from ``rank`` if it belongs to a roll call (answer a probe, note an answer or a
        report); whether it did."""
        if "probe" in message and rank == self.parent:
            self.send(rank, {"alive": message["probe"]})
        elif "alive" in message:
            round_ = message["alive"]
            if isinstance(round_, int) and not isinstance(round_, bool):
                self._answered[rank] = round_
        elif "failed" in message:
            self.failed[rank] = str(message["failed"])[:500]
            if message.get("stall") is True:
                self.stalled.add(rank)
            log.warning("hvps rank %d: rank %d reports that its data plane failed: %s", self.rank, rank,
                        self.failed[rank])
        else:
            return False
        return True

    def roll_call(self, seconds: float, stop: threading.Event) -> tuple:
        """Probe every child and wait up to ``seconds`` for each to answer or to report a failed transfer
        (``report_failure``); stop early when ``stop`` is set (ranks were found dead meanwhile). Only the thread
        that polls may call it.

        Returns ``(silent, messages, closed)``: the children still connected that did neither, and what
        ``poll`` returned meanwhile (for the engine's next cycle).
        """
        self._round += 1
        for rank in self.children:
            self.send(rank, {"probe": self._round})
        deadline = time.monotonic() + seconds
        messages: list = []
        closed: list = []
        while True:
            silent = [rank for rank in self.children if rank in self.peers and rank not in self.failed
                      and self._answered.get(rank) != self._round]
            now = time.monotonic()
            if not silent or now >= deadline or stop.is_set():
                return silent, messages, closed
            got, gone = self.poll(min(0.05, deadline - now))  # any message wakes it; 50 ms: to look at ``stop``
            messages += got
            closed += gone

    def _drop(self, peer: _Peer) -> None:
        self._selector.unregister(peer.sock)
        with self._writer.lock:
            self.peers.pop(peer.rank, None)
            peer.sock.close()

    def close(self) -> None:
        """Say goodbye, send what is queued (for up to 2 s) and close every socket."""
        if self._watch is not None:
            self._watch.stop()
        self._send_to_all(encode({"bye": True}))
        self._writer.stop()
        for peer in list(self.peers.values()):
            self._drop(peer)
        self._selector.close()
        self._wake_selector.close()
        self._wake_r.close()
        self._wake_w.close()
