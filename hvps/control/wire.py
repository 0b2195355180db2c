"""Framing, parsing and message authentication for the control plane.

Everything here is pure (no sockets) so that it can be tested and fuzzed on its own:
a stranger may write any bytes at rank 0's control port, and each function below
must answer them with :class:`ProtocolError`, never with another exception, a hang
or unbounded memory.

A frame is a 4-byte big-endian length and that many bytes. Before a peer has
authenticated, a frame holds one small JSON object; afterwards it holds an
HMAC-SHA256 tag (32 bytes) followed by the JSON, and the tag covers the direction
and a sequence number, so that a message can be neither forged, replayed, reordered
nor reflected back to its sender.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from typing import Container, Optional

HEADER = struct.Struct("!I")
DIGEST_BYTES = 32
#: the largest frame accepted before a peer has authenticated (the handshake's are ~150 bytes)
MAX_UNAUTHENTICATED = 4096
#: the largest authenticated frame (responses naming many tensors, alltoall split tables)
MAX_AUTHENTICATED = 1 << 30
#: JSON nesting depth allowed in any control message (requests nest shapes: depth 5)
MAX_DEPTH = 16


class ProtocolError(Exception):
    """A peer sent something that is not a valid control message; the connection is dropped."""


def digest(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts``, each length-prefixed so that no two part lists collide."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(HEADER.pack(len(part)))
        mac.update(part)
    return mac.digest()


def _keyed(key: bytes, first: bytes) -> "hmac.HMAC":
    """An HMAC-SHA256 state keyed with ``key`` that has taken ``first`` as ``digest``'s first part."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    mac.update(HEADER.pack(len(first)))
    mac.update(first)
    return mac


_COUNT = struct.Struct("!IQ")


def _finish(keyed: "hmac.HMAC", count: int, body: bytes) -> bytes:
    """``digest(key, first, count as 8 bytes, body)``, from ``keyed`` (``_keyed(key, first)``), which is
    left as it was."""
    mac = keyed.copy()
    mac.update(_COUNT.pack(8, count))
    mac.update(HEADER.pack(len(body)))
    mac.update(body)
    return mac.digest()


def _depth_ok(data: bytes) -> bool:
    """Whether brackets outside strings nest at most MAX_DEPTH deep (checked before json.loads,
    whose recursive parser would otherwise raise RecursionError)."""
    depth, in_string, escaped = 0, False, False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > MAX_DEPTH:
                return False
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return True


def parse_object(data: bytes, allowed: frozenset, required: frozenset = frozenset(),
                 check_depth: bool = True) -> dict:
    """The JSON object in ``data``: its keys among ``allowed``, every one of ``required``
    present; ProtocolError otherwise. ``check_depth=False`` skips the nesting check
    (authenticated frames, which may be megabytes long)."""
    if check_depth and not _depth_ok(data):
        raise ProtocolError(f"JSON nested deeper than {MAX_DEPTH} levels")
    try:
        message = _DECODER.decode(data.decode())
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ProtocolError(f"not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"expected a JSON object, got {type(message).__name__}")
    if not message or not set(message) <= allowed or not required <= set(message):
        raise ProtocolError(f"expected keys among {sorted(allowed)}, got {sorted(message)[:8]}")
    return message


#: made once: ``json.dumps`` with ``separators`` builds an encoder per call, and ``json.loads`` of bytes guesses
#: their encoding first (together ~5 us of a 4 B allreduce's ~10 us per control message)
_ENCODER = json.JSONEncoder(separators=(",", ":"))
_DECODER = json.JSONDecoder()


def encode(message: dict) -> bytes:
    """The compact JSON bytes of ``message``."""
    return _ENCODER.encode(message).encode()


def frame(payload: bytes) -> bytes:
    """``payload`` with its length prefix."""
    return HEADER.pack(len(payload)) + payload


class FrameReader:
    """Cuts a byte stream into frames, refusing any frame longer than ``limit`` as soon as
    its header arrives (before its bytes are buffered)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list:
        """Append ``data``; return the payloads now complete."""
        self._buffer += data
        frames = []
        while len(self._buffer) >= HEADER.size:
            (length,) = HEADER.unpack_from(self._buffer)
            if length > self.limit:
                raise ProtocolError(f"frame of {length} bytes exceeds the limit of {self.limit}")
            end = HEADER.size + length
            if len(self._buffer) < end:
                break
            frames.append(bytes(self._buffer[HEADER.size:end]))
            del self._buffer[:end]
        return frames


class Session:
    """Tags and checks the frames of one authenticated connection.

    Each side counts the frames it sends and receives; the tag covers the sender's role
    and that count, so frames cannot be replayed, dropped, reordered or reflected.
    """

    def __init__(self, key: bytes, mine: bytes, theirs: bytes) -> None:
        self._key = key
        self._mine, self._theirs = mine, theirs
        self._sent = self._received = 0
        # The keyed HMAC states with each direction's role already fed (``digest``'s first part): a frame's
        # tag copies one (a C-level copy) instead of keying a new HMAC, tens of microseconds per frame.
        self._sending = _keyed(key, mine)
        self._receiving = _keyed(key, theirs)

    def seal(self, message: dict) -> bytes:
        """The frame carrying ``message``."""
        return self.seal_encoded(encode(message))

    def seal_encoded(self, body: bytes) -> bytes:
        """The frame carrying a message already encoded (one encoding serves many peers)."""
        tag = _finish(self._sending, self._sent, body)
        self._sent += 1
        return frame(tag + body)

    def open(self, payload: bytes, allowed: frozenset) -> dict:
        """The message in ``payload`` after checking its tag; ProtocolError if it is forged."""
        tag, body = payload[:DIGEST_BYTES], payload[DIGEST_BYTES:]
        expected = _finish(self._receiving, self._received, body)
        if len(tag) != DIGEST_BYTES or not hmac.compare_digest(tag, expected):
            raise ProtocolError("message authentication failed")
        self._received += 1
        return parse_object(body, allowed, check_depth=False)


def check_rank(value: object, size: int, taken: Optional[Container] = None) -> int:
    """``value`` as a worker rank: an int with 0 < rank < size, not in ``taken``."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < size:
        raise ProtocolError(f"rank {value!r} is not in 1..{size - 1}")
    if taken is not None and value in taken:
        raise ProtocolError(f"rank {value} is already connected")
    return value


def check_nonce(value: object) -> bytes:
    """``value`` (hex text) as a 16-byte nonce."""
    if not isinstance(value, str) or len(value) != 32:
        raise ProtocolError("nonce must be 32 hex digits")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ProtocolError("nonce must be 32 hex digits") from None
