"""Keys, nonces and AES-256-GCM for the sealed data plane (``HVPS_ENCRYPT``).

Why its own module: the cryptography is small and must be easy to review apart from the
collectives that move the bytes (``backends/sealed.py``).

- **Keys.** At ``init`` every rank draws an X25519 key pair and the ranks exchange the public
  halves over the bootstrap communicator; each pair of ranks then shares a secret that never
  travelled. When the job has a secret (``HVPS_SECRET``/``HVPS_SECRET_FILE``), every public key
  carries an HMAC under a key derived from it (a stranger cannot slip in its own), and the
  secret salts the derivation. Each direction of each pair, in each communicator, gets its own
  AES-256 key by HKDF-SHA256 over that shared secret, the job's random id, the communicator's
  members and the (sender, receiver) pair: keys live as long as one ``init``.
- **Nonces** are 4 bytes of the direction (sender and receiver) and a 64-bit counter of the
  messages sent that way: both sides count, so nonces never travel and never repeat.
- **Associated data** binds every message to its collective (kind and sequence number), step,
  chunk and length: a replayed, reordered, truncated or misdirected chunk fails to open.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import Optional

from ..core.errors import HvpsError

#: bytes of the GCM tag each sealed message carries
TAG = 16
#: the oldest ``cryptography`` with everything used here (AESGCM, X25519, HKDF)
MIN_CRYPTOGRAPHY = (41, 0)
_INSTALL = "pip install 'hvps[encrypt]' (the cryptography package, OpenSSL underneath)"


def crypto():
    """The ``cryptography`` primitives used here; HvpsError saying what to install when missing or too old."""
    try:
        import cryptography
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import x25519
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError as exc:
        raise HvpsError(f"HVPS_ENCRYPT needs the cryptography package ({exc}); {_INSTALL}") from None
    version = tuple(int(p) for p in cryptography.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_CRYPTOGRAPHY:
        raise HvpsError(f"HVPS_ENCRYPT needs cryptography >= {'.'.join(map(str, MIN_CRYPTOGRAPHY))}, "
                        f"found {cryptography.__version__}; {_INSTALL}")
    return hashes, x25519, AESGCM, HKDF


def _mac_key(secret: bytes) -> bytes:
    return hmac.new(secret, b"hvps data plane public keys", hashlib.sha256).digest()


class Keyring:
    """This rank's secret shared with every other rank of the job, and the keys derived from it."""

    def __init__(self, rank: int, shared: dict, salt: bytes, job_id: bytes) -> None:
        self.rank = rank
        self._shared = shared  # global rank -> X25519 shared secret
        self._salt = salt
        self.job_id = job_id

    def key(self, sender: int, receiver: int, context: bytes) -> bytes:
        """The AES-256 key of messages ``sender`` -> ``receiver`` (global ranks) in ``context``."""
        hashes, _, _, HKDF = crypto()
        peer = receiver if sender == self.rank else sender
        info = b"hvps data plane v1|" + self.job_id + b"|" + context + struct.pack(">II", sender, receiver)
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=self._salt, info=info).derive(self._shared[peer])


def agree(comm, secret: Optional[bytes]) -> Keyring:
    """Exchange public keys over ``comm`` (collective) and return this rank's keyring."""
    _, x25519, _, _ = crypto()
    from cryptography.hazmat.primitives import serialization

    rank = comm.Get_rank()
    private = x25519.X25519PrivateKey.generate()
    public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    job_id = os.urandom(16) if rank == 0 else b""
    tag = hmac.new(_mac_key(secret), struct.pack(">I", rank) + public + job_id, hashlib.sha256).digest() \
        if secret else b""
    entries = comm.allgather((rank, public, job_id, tag))
    shared = {}
    for peer, entry in enumerate(entries):
        if not (isinstance(entry, tuple) and len(entry) == 4 and entry[0] == peer
                and isinstance(entry[1], bytes) and len(entry[1]) == 32):
            raise HvpsError(f"HVPS_ENCRYPT: rank {peer}'s public key is malformed; the key exchange was tampered with")
        if secret:
            want = hmac.new(_mac_key(secret), struct.pack(">I", peer) + entry[1] + entry[2], hashlib.sha256).digest()
            if not hmac.compare_digest(want, entry[3]):
                raise HvpsError(f"HVPS_ENCRYPT: rank {peer}'s public key fails the job secret's HMAC: a stranger "
                                "on the network replaced it, or the ranks hold different HVPS_SECRET values")
        if peer != rank:
            shared[peer] = private.exchange(x25519.X25519PublicKey.from_public_bytes(entry[1]))
    job_id = entries[0][2]
    if len(job_id) != 16:
        raise HvpsError("HVPS_ENCRYPT: rank 0's job id is malformed; the key exchange was tampered with")
    salt = hmac.new(secret, b"hvps data plane salt", hashlib.sha256).digest() if secret else job_id
    return Keyring(rank, shared, salt, job_id)


class Direction:
    """One direction of one pair of ranks in one communicator: its key and message counter."""

    def __init__(self, key: bytes, sender: int, receiver: int) -> None:
        _, _, AESGCM, _ = crypto()
        self.aead = AESGCM(key)
        self.prefix = struct.pack(">HH", sender & 0xFFFF, receiver & 0xFFFF)
        self.counter = 0
        self._into = hasattr(self.aead, "encrypt_into")

    def next_nonce(self) -> bytes:
        """The nonce of the next message this way (call in message order, on both sides)."""
        nonce = self.prefix + struct.pack(">Q", self.counter)
        self.counter += 1
        return nonce

    def seal_into(self, nonce: bytes, plain, out, aad: bytes) -> None:
        """Encrypt ``plain`` into ``out`` (``len(plain) + TAG`` bytes)."""
        if self._into:
            self.aead.encrypt_into(nonce, plain, aad, out)
        else:
            out[:] = self.aead.encrypt(nonce, bytes(plain), aad)

    def open_into(self, nonce: bytes, sealed, out, aad: bytes) -> None:
        """Decrypt and authenticate ``sealed`` into ``out``; ``cryptography``'s InvalidTag when it fails."""
        if self._into:
            self.aead.decrypt_into(nonce, sealed, aad, out)
        else:
            out[:] = self.aead.decrypt(nonce, bytes(sealed), aad)


def aad(kind: int, sequence: int, step: int, chunk: int, length: int) -> bytes:
    """Associated data of one message: collective kind and number, step, chunk, plaintext length."""
    return struct.pack(">4sBQIIQ", b"hvp1", kind, sequence, step, chunk, length)


def invalid_tag():
    """The exception class a failed authentication raises."""
    from cryptography.exceptions import InvalidTag

    return InvalidTag
