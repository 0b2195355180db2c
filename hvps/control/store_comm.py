"""A bootstrap communicator over a key-value store, for jobs started without MPI.

Under ``hvpsrun --gloo`` (the launcher hosts the store) and ``torchrun`` (its agent does), ``init``
has no MPI communicator to learn the job's shape on. :class:`StoreComm` offers the few mpi4py
object methods that ``init`` and the backends use (``Get_rank``, ``Get_size``, ``bcast``,
``allgather``, ``Barrier``, ``Split``, ``Dup``, ``Free``) plus :meth:`StoreComm.subset`, on any
store with torch.distributed's ``set``/``get``/``check`` (``TCPStore``, ``HashStore``).

Each collective writes its values under a key of its own: the communicator's prefix and a count
of the collectives called on it, which every member calls in the same order (as with MPI).

The store has no authentication (anyone who reaches its port can read and write it), so values
are JSON, never pickle; and when the job has a secret (``hvpsrun`` hands every worker one,
``HVPS_SECRET_FILE`` elsewhere), each value carries an HMAC over its key and its bytes. A
stranger may then deny service, but cannot inject or move a value.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from typing import Any, Callable, Optional, Sequence

from ..core.errors import HvpsError

_MAC_BYTES = 32
#: the longest pause between two looks for a missing value
_MAX_PAUSE = 0.02


def _encode(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(obj)).decode()}
    if isinstance(obj, (list, tuple)):
        return [_encode(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _encode(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"the bootstrap store carries JSON values and bytes, not {type(obj).__name__}")


def _decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_decode(x) for x in obj]
    if isinstance(obj, dict):
        if set(obj) == {"$bytes"}:
            return base64.b64decode(obj["$bytes"])
        return {k: _decode(v) for k, v in obj.items()}
    return obj


def mac(secret: Optional[bytes], key: str, data: bytes) -> bytes:
    """The HMAC that binds ``data`` to ``key`` under ``secret`` (empty without a secret)."""
    if secret is None:
        return b""
    return hmac.new(secret, key.encode() + b"\0" + data, hashlib.sha256).digest()


def seal(secret: Optional[bytes], key: str, obj: Any) -> bytes:
    """``obj`` as JSON, authenticated for ``key``: what goes into the store."""
    data = json.dumps(_encode(obj), separators=(",", ":")).encode()
    return mac(secret, key, data) + data


def verify(secret: Optional[bytes], key: str, raw: bytes) -> tuple:
    """``(True, value)`` when ``raw`` is what :func:`seal` wrote under ``key`` with ``secret``, else
    ``(False, None)``."""
    raw = bytes(raw)
    tag, data = (raw[:_MAC_BYTES], raw[_MAC_BYTES:]) if secret is not None else (b"", raw)
    if not hmac.compare_digest(tag, mac(secret, key, data)):
        return False, None
    try:
        return True, _decode(json.loads(data))
    except ValueError:
        return False, None


def unseal(secret: Optional[bytes], key: str, raw: bytes, where: str, origin: str) -> Any:
    """The value :func:`seal` wrote under ``key``; HvpsError naming ``origin`` when it is not authentic."""
    raw = bytes(raw)
    tag, data = (raw[:_MAC_BYTES], raw[_MAC_BYTES:]) if secret is not None else (b"", raw)
    if not hmac.compare_digest(tag, mac(secret, key, data)):
        raise HvpsError(f"{where}: the value under {key!r} (from {origin}) does not carry the job's "
                        "authentication: someone else wrote it, or the ranks hold different secrets "
                        "(HVPS_SECRET_FILE)")
    try:
        return _decode(json.loads(data))
    except ValueError:
        raise HvpsError(f"{where}: the value under {key!r} (from {origin}) is not JSON") from None


class StoreComm:
    """``size`` processes that share ``store``; this one is ``rank``.

    ``secret`` (bytes, or None) authenticates every value; ``timeout`` bounds every wait for a
    value, and a rank that never writes one is named in the HvpsError. ``abandon()``, called while
    waiting, may raise to stop the wait early (an elastic job whose membership changed meanwhile).
    """

    def __init__(self, store: Any, rank: int, size: int, secret: Optional[bytes] = None, *,
                 prefix: str = "hvps", timeout: float = 120.0, where: str = "the bootstrap store",
                 abandon: Optional[Callable[[], None]] = None) -> None:
        if not 0 <= rank < size:
            raise HvpsError(f"rank {rank} is outside a job of size {size}")
        self.store, self.secret, self.prefix, self.timeout, self.where = store, secret, prefix, timeout, where
        self.abandon = abandon
        self._rank, self._size = rank, size
        self._calls = 0
        self._subsets: dict = {}

    # -- mpi4py's object API ----------------------------------------------------------
    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's name
        return self._rank

    def Get_size(self) -> int:  # noqa: N802
        return self._size

    def bcast(self, obj: Any, root: int = 0) -> Any:
        key = self._next("bcast")
        if self._rank == root:
            self._put(key, obj)
            return obj
        return self._take([key], [root])[0]

    def allgather(self, obj: Any) -> list:
        key = self._next("allgather")
        self._put(f"{key}/{self._rank}", obj)
        return self._take([f"{key}/{r}" for r in range(self._size)], range(self._size))

    def Barrier(self) -> None:  # noqa: N802
        self.allgather(None)

    def Split(self, color: Any = 0, key: int = 0) -> "StoreComm":  # noqa: N802
        """The members that gave the same ``color`` (any JSON value), ordered by ``key``, then rank."""
        entries = self.allgather([color, key])
        name = self._calls  # the allgather's number names the split
        members = sorted((k, r) for r, (c, k) in enumerate(entries) if c == color)
        rank = [r for _, r in members].index(self._rank)
        return self._child(f"{name}/split/{json.dumps(color)}", rank, len(members))

    def Dup(self) -> "StoreComm":  # noqa: N802
        """A communicator over the same members, whose collectives never meet this one's."""
        return self._child(f"{self._next('dup')}", self._rank, self._size)

    def Free(self) -> None:  # noqa: N802
        """Nothing to release (the keys stay in the store, which lives as long as the job)."""

    # -- beyond mpi4py ----------------------------------------------------------------
    def subset(self, ranks: Sequence[int]) -> Optional["StoreComm"]:
        """A communicator over ``ranks`` (of this one), for them only: only they call it, so it is
        named by the ranks and how many subsets over them this rank made, not by the call count."""
        ranks = sorted(int(r) for r in ranks)
        if self._rank not in ranks:
            return None
        count = self._subsets[tuple(ranks)] = self._subsets.get(tuple(ranks), 0) + 1
        return self._child(f"set/{','.join(map(str, ranks))}/{count}", ranks.index(self._rank), len(ranks))

    # -- the store --------------------------------------------------------------------
    def _child(self, name: str, rank: int, size: int) -> "StoreComm":
        return StoreComm(self.store, rank, size, self.secret, prefix=f"{self.prefix}/{name}", timeout=self.timeout,
                         where=self.where, abandon=self.abandon)

    def _next(self, what: str) -> str:
        self._calls += 1
        return f"{self.prefix}/{self._calls}/{what}"

    def _put(self, key: str, obj: Any) -> None:
        self.store.set(key, seal(self.secret, key, obj))

    def _take(self, keys: list, ranks) -> list:
        """The values under ``keys``, written by ``ranks`` (one each), once all are there."""
        ranks = list(ranks)
        self._wait(keys, ranks)
        return [unseal(self.secret, name, self.store.get(name), self.where, f"rank {rank}")
                for name, rank in zip(keys, ranks)]

    def _wait(self, keys: list, ranks: list) -> None:
        deadline = time.monotonic() + self.timeout
        pending, pause = list(zip(keys, ranks)), 0.0005
        while pending:
            pending = [(k, r) for k, r in pending if not self.store.check([k])]
            if not pending:
                return
            if self.abandon is not None:
                self.abandon()
            if time.monotonic() >= deadline:
                raise HvpsError(f"{self.where}: ranks {[r for _, r in pending]} did not reach the job's start-up "
                                f"exchange ({keys[0].rsplit('/', 1)[0]}) within {self.timeout:g} s; they exited, "
                                "hang before hvps.init(), or cannot reach the store")
            # polled, not store.wait(timeout): torch logs a warning for every wait that times out
            time.sleep(pause)
            pause = min(2 * pause, _MAX_PAUSE)
