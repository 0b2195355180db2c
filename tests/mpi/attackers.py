"""Strangers that connect to rank 0's control port while ``hvps.init`` runs.

Each attack is a function ``(host, port) -> None`` that does its damage and
returns; none of them knows the job's key. Used by mpi_control_attacks.py.
"""

import json
import os
import secrets
import socket
import struct
import threading
import time

from hvps.control.wire import digest

HEADER = struct.Struct("!I")
#: taken at import, before a test wraps socket.create_connection
_connect = socket.create_connection


def _send(host, port, data, linger=1.0):
    with _connect((host, port), timeout=5) as sock:
        try:
            sock.sendall(data)
            time.sleep(linger)
        except OSError:
            pass  # dropped by rank 0: expected


def garbage(host, port):
    """Valid JSON that is not an object (raised AttributeError once)."""
    _send(host, port, b"\0\0\0\x07[1,2,3]")


def random_bytes(host, port):
    _send(host, port, os.urandom(3000))


def deep_json(host, port):
    """Nesting too deep for json's recursive parser, in a frame under the size cap..."""
    _send(host, port, HEADER.pack(4000) + b"[" * 4000)


def deep_json_large(host, port):
    """... and 100,000 brackets (raised RecursionError once)."""
    _send(host, port, HEADER.pack(100_000) + b"[" * 100_000)


def oversized_header(host, port, megabytes=256):
    """A header declaring 4 GiB, then as much data as rank 0 accepts (grew rank 0 by 1.6 GB once)."""
    chunk = b"\0" * (1 << 20)
    with _connect((host, port), timeout=5) as sock:
        try:
            sock.sendall(HEADER.pack(0xFFFFFFFF))
            for _ in range(megabytes):
                sock.sendall(chunk)
        except OSError:
            pass


def slow_loris(host, port, seconds=8.0):
    """One byte at a time, every 0.3 s (once held start-up past its timeout)."""
    message = json.dumps({"rank": 1, "nonce": "00" * 16}).encode()
    data = HEADER.pack(len(message)) + message
    end = time.monotonic() + seconds
    with _connect((host, port), timeout=5) as sock:
        try:
            for byte in data:
                if time.monotonic() > end:
                    break
                sock.sendall(bytes([byte]))
                time.sleep(0.3)
        except OSError:
            pass


def out_of_range_rank(host, port):
    """A hello claiming rank 99 (it once displaced a real rank)."""
    message = json.dumps({"rank": 99, "nonce": secrets.token_hex(16)}).encode()
    _send(host, port, HEADER.pack(len(message)) + message)


def old_token_hello(host, port):
    """The pre-authentication hello with a token seen on the wire: no longer a thing."""
    message = json.dumps({"rank": 1, "token": secrets.token_hex(16)}).encode()
    _send(host, port, HEADER.pack(len(message)) + message)


def wrong_key(host, port, rank=1):
    """Follow the handshake, but with a key of its own."""
    key, nonce = secrets.token_bytes(32), secrets.token_bytes(16)
    hello = json.dumps({"rank": rank, "nonce": nonce.hex()}).encode()
    with _connect((host, port), timeout=5) as sock:
        try:
            sock.sendall(HEADER.pack(len(hello)) + hello)
            length = HEADER.unpack(sock.recv(4, socket.MSG_WAITALL))[0]
            challenge = json.loads(sock.recv(length, socket.MSG_WAITALL))
            theirs = bytes.fromhex(challenge["nonce"])
            proof = digest(key, b"hvps-worker", nonce, theirs, str(rank).encode()).hex()
            reply = json.dumps({"proof": proof}).encode()
            sock.sendall(HEADER.pack(len(reply)) + reply)
            sock.recv(4096)
        except (OSError, ValueError, struct.error):
            pass


ALL = [garbage, random_bytes, deep_json, deep_json_large, oversized_header, slow_loris,
       out_of_range_rank, old_token_hello, wrong_key]


def launch(host, port, attacks=ALL):
    """Start every attack in a thread of its own; return the threads."""
    threads = [threading.Thread(target=attack, args=(host, port), daemon=True, name=attack.__name__)
               for attack in attacks]
    for thread in threads:
        thread.start()
    return threads


class Recorder:
    """A socket wrapper that keeps every byte a real rank sends during its handshake."""

    def __init__(self, sock, on_proof):
        self._sock, self._on_proof = sock, on_proof
        self.sent = []

    def sendall(self, data, *args):
        self._sock.sendall(data, *args)
        self.sent.append(bytes(data))
        if len(self.sent) == 2:  # hello and proof: the whole transcript a sniffer would see
            self._on_proof(list(self.sent))

    def __getattr__(self, name):
        return getattr(self._sock, name)


def replay(host, port, transcript, claim_ranks=(1, 2)):
    """Replay a real rank's recorded hello and proof, as itself and as another rank."""
    for rank in claim_ranks:
        hello = json.loads(transcript[0][4:])
        hello["rank"] = rank
        data = json.dumps(hello).encode()
        try:
            with _connect((host, port), timeout=5) as sock:
                sock.sendall(HEADER.pack(len(data)) + data)
                sock.recv(4096)
                sock.sendall(transcript[1])
                sock.recv(4096)
        except (OSError, ValueError):
            pass
