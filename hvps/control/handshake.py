"""Mutual authentication of a worker rank and rank 0 on the control plane.

Both sides hold the job's random key (rank 0 draws it and hands it out over MPI; it
never crosses the control connection). Like Horovod's runner, which puts an
HMAC-SHA256 of its secret key on every message, hvps then tags every frame, but first
each side proves it holds the key by answering the other's fresh random challenge::

    worker -> rank 0   {"rank": r, "nonce": cw}
    rank 0 -> worker   {"nonce": c0, "proof": HMAC(key, "rank0", cw, c0, r)}
    worker -> rank 0   {"proof": HMAC(key, "worker", cw, c0, r)}
    rank 0 -> worker   tagged {"ack": r}          (session key HMAC(key, "session", cw, c0, r))

A recorded handshake is useless later (the challenges differ), and a stranger learns
nothing that lets it forge the next one. The server side is a state machine fed with
bytes, so rank 0 can run many handshakes at once without one slow peer blocking others. In a
control-plane tree (``tree.py``) every parent plays rank 0's part towards its own children.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import time
from typing import Container, Optional

from .wire import (
    MAX_UNAUTHENTICATED,
    FrameReader,
    ProtocolError,
    Session,
    check_nonce,
    check_rank,
    digest,
    encode,
    frame,
    parse_object,
)

RANK0, WORKER = b"hvps-rank0", b"hvps-worker"
_HELLO = frozenset({"rank", "nonce"})
_CHALLENGE = frozenset({"nonce", "proof"})
_PROOF = frozenset({"proof"})
_ACK = frozenset({"ack"})


def _proof(key: bytes, role: bytes, worker_nonce: bytes, rank0_nonce: bytes, rank: int) -> bytes:
    return digest(key, role, worker_nonce, rank0_nonce, str(rank).encode())


def _session_key(key: bytes, worker_nonce: bytes, rank0_nonce: bytes, rank: int) -> bytes:
    return digest(key, b"hvps-session", worker_nonce, rank0_nonce, str(rank).encode())


def _check_proof(value: object, expected: bytes, who: str) -> None:
    try:
        given = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        given = b""
    if not hmac.compare_digest(given, expected):
        raise ProtocolError(f"{who} does not hold the job's key")


class ServerHandshake:
    """Rank 0's side of one handshake: feed it bytes, send what it returns.

    ``rank`` and ``session`` are set once the peer has proved itself; ``reader``
    then holds any bytes it sent after its proof.
    """

    def __init__(self, key: bytes, size: int, taken: Container, expected: Optional[Container] = None) -> None:
        """``expected``: the ranks that may connect here (a rank's children in the control-plane tree)."""
        self._key, self._size, self._taken, self._expected = key, size, taken, expected
        self.reader = FrameReader(MAX_UNAUTHENTICATED)
        self.rank: Optional[int] = None
        self.session: Optional[Session] = None
        self._nonces: Optional[tuple] = None

    def feed(self, data: bytes) -> bytes:
        """Take bytes from the peer; return the bytes to send back (possibly none)."""
        out = b""
        for payload in self.reader.feed(data):
            if self.session is not None:
                raise ProtocolError("spoke before rank 0 acknowledged it")
            out += self._hello(payload) if self._nonces is None else self._finish(payload)
            if self.session is not None:
                break
        return out

    def _hello(self, payload: bytes) -> bytes:
        hello = _parse(payload, _HELLO)
        rank = check_rank(hello["rank"], self._size, self._taken)
        if self._expected is not None and rank not in self._expected:
            raise ProtocolError(f"rank {rank} does not announce to this rank in the control-plane tree")
        worker_nonce, rank0_nonce = check_nonce(hello["nonce"]), secrets.token_bytes(16)
        self.rank, self._nonces = rank, (worker_nonce, rank0_nonce)
        return frame(encode({"nonce": rank0_nonce.hex(),
                             "proof": _proof(self._key, RANK0, worker_nonce, rank0_nonce, rank).hex()}))

    def _finish(self, payload: bytes) -> bytes:
        worker_nonce, rank0_nonce = self._nonces
        _check_proof(_parse(payload, _PROOF)["proof"],
                     _proof(self._key, WORKER, worker_nonce, rank0_nonce, self.rank), f"a peer claiming rank {self.rank}")
        check_rank(self.rank, self._size, self._taken)
        self.session = Session(_session_key(self._key, worker_nonce, rank0_nonce, self.rank), RANK0, WORKER)
        return self.session.seal({"ack": self.rank})


def _parse(payload: bytes, keys: frozenset) -> dict:
    return parse_object(payload, keys, keys)


def _read_frame(sock: socket.socket, reader: FrameReader, deadline: float) -> bytes:
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ProtocolError("rank 0 did not answer the handshake in time")
        sock.settimeout(remaining)
        try:
            data = sock.recv(4096)
        except socket.timeout:
            raise ProtocolError("rank 0 did not answer the handshake in time") from None
        if not data:
            raise ProtocolError("rank 0 closed the connection during the handshake")
        frames = reader.feed(data)
        if frames:
            if len(frames) > 1:
                raise ProtocolError("rank 0 sent more than one handshake message")
            return frames[0]


def client_handshake(sock: socket.socket, key: bytes, rank: int, deadline: float) -> Session:
    """Authenticate to rank 0 over ``sock`` (blocking, done by ``deadline``) and return the session."""
    reader = FrameReader(MAX_UNAUTHENTICATED)
    worker_nonce = secrets.token_bytes(16)
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    sock.sendall(frame(encode({"rank": rank, "nonce": worker_nonce.hex()})))
    challenge = _parse(_read_frame(sock, reader, deadline), _CHALLENGE)
    rank0_nonce = check_nonce(challenge["nonce"])
    _check_proof(challenge["proof"], _proof(key, RANK0, worker_nonce, rank0_nonce, rank), "the control port's owner")
    sock.sendall(frame(encode({"proof": _proof(key, WORKER, worker_nonce, rank0_nonce, rank).hex()})))
    session = Session(_session_key(key, worker_nonce, rank0_nonce, rank), WORKER, RANK0)
    ack = session.open(_read_frame(sock, reader, deadline), _ACK)
    if ack["ack"] != rank:
        raise ProtocolError(f"rank 0 acknowledged rank {ack['ack']!r} instead of {rank}")
    return session
