"""The control plane: small JSON messages between rank 0 and every other rank over TCP.

MPI offers no way to wait for a message without spinning a core, so the engine
negotiates over plain sockets instead: its thread blocks in ``select`` until a
message, a local submission or a deadline arrives, costing no CPU while it
waits and answering within microseconds. A closed connection tells at once
that a rank has died. Messages are JSON, never pickle, and a connection must
present the job's random token before it is trusted.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import selectors
import socket
import struct
import time
from typing import Optional

from .errors import HvpsError

_HEADER = struct.Struct("!I")
_SIOCGIFADDR = 0x8915


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
    explicit = os.environ.get("HVPS_CONTROL_ADDR")
    if explicit:
        return [explicit]
    wanted = os.environ.get("HVPS_NETWORK_INTERFACE")
    names = [wanted] if wanted else [name for _, name in socket.if_nameindex()]
    found = [a for a in (interface_address(n) for n in names) if a]
    if wanted and not found:
        raise HvpsError(f"HVPS_NETWORK_INTERFACE={wanted!r} has no IPv4 address on {socket.gethostname()}")
    return sorted(set(found), key=lambda a: (a.startswith("127."), a))


class ConnectionClosed(Exception):
    """The peer closed its end (it exited or its host went away)."""


class _Peer:
    """One non-blocking connection with length-prefixed JSON framing in both directions."""

    def __init__(self, sock: socket.socket, rank: int) -> None:
        self.sock = sock
        self.rank = rank
        self.inbox = bytearray()
        self.outbox = bytearray()

    def queue(self, message: dict) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        self.outbox += _HEADER.pack(len(data)) + data

    def flush(self) -> None:
        while self.outbox:
            try:
                sent = self.sock.send(self.outbox)
            except BlockingIOError:
                return
            except OSError as exc:
                raise ConnectionClosed(str(exc)) from exc
            del self.outbox[:sent]

    def receive(self) -> list:
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return []
        except OSError as exc:
            raise ConnectionClosed(str(exc)) from exc
        if not data:
            raise ConnectionClosed("connection closed")
        self.inbox += data
        messages = []
        while len(self.inbox) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self.inbox)
            if len(self.inbox) < _HEADER.size + length:
                break
            messages.append(json.loads(self.inbox[_HEADER.size : _HEADER.size + length]))
            del self.inbox[: _HEADER.size + length]
        return messages


def _send_blocking(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_blocking(sock: socket.socket) -> dict:
    def exactly(n: int) -> bytes:
        chunks = bytearray()
        while len(chunks) < n:
            chunk = sock.recv(n - len(chunks))
            if not chunk:
                raise ConnectionClosed("connection closed during handshake")
            chunks += chunk
        return bytes(chunks)

    (length,) = _HEADER.unpack(exactly(_HEADER.size))
    return json.loads(exactly(length))


class ControlPlane:
    """Rank 0 holds one connection per other rank; every other rank holds one to rank 0."""

    def __init__(self, comm, connect_timeout: float = 60.0) -> None:
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for sock in (self._wake_r, self._wake_w):
            sock.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self.peers: dict[int, _Peer] = {}
        listener = None
        if self.rank == 0:
            listener = socket.create_server(("", 0), backlog=max(self.size, 16))
            offer = (candidate_addresses(), listener.getsockname()[1], secrets.token_hex(16))
        else:
            offer = None
        addresses, port, token = comm.bcast(offer, root=0)
        try:
            if self.rank == 0:
                self._accept(listener, token, connect_timeout)
            elif self.size > 1:
                self._connect(addresses, port, token, connect_timeout)
        finally:
            if listener is not None:
                listener.close()
        comm.Barrier()
        for peer in self.peers.values():
            peer.sock.setblocking(False)
            peer.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._selector.register(peer.sock, selectors.EVENT_READ, peer)

    def _accept(self, listener: socket.socket, token: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.peers) < self.size - 1:
            listener.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                sock, _ = listener.accept()
            except socket.timeout:
                missing = sorted(set(range(1, self.size)) - set(self.peers))
                raise HvpsError(
                    f"rank 0 heard nothing from ranks {missing} within {timeout:g} s on port "
                    f"{listener.getsockname()[1]}; set HVPS_NETWORK_INTERFACE (hvpsrun --network-interface) "
                    "to an interface every host can reach"
                ) from None
            sock.settimeout(5)
            try:
                hello = _recv_blocking(sock)
            except (OSError, ConnectionClosed, ValueError):
                sock.close()
                continue
            if hello.get("token") != token or not isinstance(hello.get("rank"), int):
                sock.close()  # not one of ours
                continue
            self.peers[hello["rank"]] = _Peer(sock, hello["rank"])

    def _connect(self, addresses: list, port: int, token: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        errors = {}
        while time.monotonic() < deadline:
            for address in addresses:
                try:
                    sock = socket.create_connection((address, port), timeout=2)
                except OSError as exc:
                    errors[address] = exc
                    continue
                _send_blocking(sock, {"rank": self.rank, "token": token})
                self.peers[0] = _Peer(sock, 0)
                return
            time.sleep(0.2)
        tried = ", ".join(f"{a}:{port} ({e})" for a, e in errors.items())
        raise HvpsError(
            f"rank {self.rank} could not reach rank 0's control port: {tried}; set HVPS_NETWORK_INTERFACE "
            "(hvpsrun --network-interface) or HVPS_CONTROL_ADDR to an address every host can reach"
        )

    def wake(self) -> None:
        """Interrupt a ``poll`` in progress (called by user threads after queueing work)."""
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already awake, or closing

    def send(self, rank: int, message: dict) -> None:
        """Queue ``message`` for ``rank`` and send what the socket takes now."""
        peer = self.peers.get(rank)
        if peer is None:
            return
        peer.queue(message)
        try:
            peer.flush()
        except ConnectionClosed:
            pass  # reported by the next poll
        if peer.outbox:
            self._selector.modify(peer.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, peer)

    def poll(self, timeout: Optional[float]) -> tuple:
        """Wait up to ``timeout`` s (None: until something happens).

        Returns ``(messages, closed)``: a list of ``(rank, message)`` and the ranks
        whose connection closed.
        """
        messages, closed = [], []
        for key, events in self._selector.select(timeout):
            peer = key.data
            if peer is None:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except BlockingIOError:
                    pass
                continue
            try:
                if events & selectors.EVENT_WRITE:
                    peer.flush()
                    if not peer.outbox:
                        self._selector.modify(peer.sock, selectors.EVENT_READ, peer)
                if events & selectors.EVENT_READ:
                    messages.extend((peer.rank, m) for m in peer.receive())
            except ConnectionClosed:
                closed.append(peer.rank)
                self._drop(peer)
        return messages, closed

    def _drop(self, peer: _Peer) -> None:
        self._selector.unregister(peer.sock)
        peer.sock.close()
        self.peers.pop(peer.rank, None)

    def close(self) -> None:
        """Flush what is queued (briefly) and close every socket."""
        deadline = time.monotonic() + 2
        for peer in list(self.peers.values()):
            peer.sock.setblocking(True)
            peer.sock.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                peer.sock.sendall(peer.outbox)
            except OSError:
                pass
            self._drop(peer)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
