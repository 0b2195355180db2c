"""An elastic job's membership, as hvpsrun's elastic driver publishes it in the job's rendezvous store.

Every change of membership (a worker failed or left, hosts were added or removed) starts a new
*round*. The driver writes, each value sealed with the job's secret (:func:`store_comm.seal`):

- ``elastic/round/N``: round N's slots, ``{worker id: [rank, size, local_rank, local_size,
  cross_rank, cross_size, host]}``; a worker (``host:slot``) that is not listed has no place in it;
- ``elastic/round``: the latest N (written after the round itself);
- ``elastic/notice``: ``{"round": N, "timestamp": t, "kind": HostUpdateResult}``, the host change
  that round N will bring, for rank 0 (the only worker notified, as in Horovod): rank 0's next
  ``commit()`` then interrupts every rank at once.

Workers write two kinds of key: ``elastic/failed/N/<worker id>`` (its reason), when a collective of
round N failed and the worker waits for the next round; ``elastic/gave_up/<worker id>`` (its reason),
when its loop reset too often without a completed commit, and the job must fail. When no worker
exited after a failure report, the driver then starts the next round itself: with the same members
when all of them reported (an error every rank saw), else without those that did not (stopped or
hung: they are ended).

A worker joins the newest round above the one it last joined; its ranks exchange their start-up
values under the round's own key prefix, so nothing of an earlier round is ever read.

Every value carries an HMAC-SHA256 under the job's secret over its key (which holds the round number
and the worker id) and its bytes; hvpsrun draws a new random secret for every job (and every restart of
one), so the secret is the job's nonce and a value of another job never verifies. Readers whose value
can change the job's course check it and treat a value that does not verify as absent, with a warning
(a stranger who can reach the store must not be able to reset, stop or stall the job):

- ``elastic/notice``: rank 0 acts only on an authentic notice of a round above its own; the driver
  writes one only for a change of membership, so nothing else ever interrupts training;
- ``elastic/failed/N/<worker id>``: the driver counts only authentic reports;
- ``elastic/round`` is only a hint: a reader takes the newest N whose authentic ``elastic/round/N``
  exists, counting up from the hint and from the last round it knows (rounds only grow), so a replayed
  old value (authentic, but stale) cannot hold a worker back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

from ..core.errors import HvpsError
from .store_comm import seal, unseal, verify

log = logging.getLogger("hvps")

ROUND_KEY = "elastic/round"
NOTICE_KEY = "elastic/notice"
WHERE = "hvpsrun's elastic rendezvous"


class MembershipChanged(HvpsError):
    """A newer round was published while this worker was joining one: join that one instead."""


@dataclass(frozen=True)
class Slot:
    """Where one rank runs, and its place in Horovod's topology."""

    rank: int
    size: int
    host: str
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    def environment(self) -> dict:
        """Horovod's variables for this rank."""
        return {"HOROVOD_RANK": str(self.rank), "HOROVOD_SIZE": str(self.size),
                "HOROVOD_LOCAL_RANK": str(self.local_rank), "HOROVOD_LOCAL_SIZE": str(self.local_size),
                "HOROVOD_CROSS_RANK": str(self.cross_rank), "HOROVOD_CROSS_SIZE": str(self.cross_size),
                "HOROVOD_HOSTNAME": self.host}

    def as_list(self) -> list:
        return [self.rank, self.size, self.local_rank, self.local_size, self.cross_rank, self.cross_size, self.host]

    @classmethod
    def from_list(cls, values: list) -> "Slot":
        rank, size, local_rank, local_size, cross_rank, cross_size, host = values
        return cls(rank, size, host, local_rank, local_size, cross_rank, cross_size)


def round_key(number: int) -> str:
    return f"{ROUND_KEY}/{number}"


def _get(store: Any, secret: Optional[bytes], key: str) -> Any:
    if not store.check([key]):
        return None
    return unseal(secret, key, store.get(key), WHERE, "hvpsrun's elastic driver")


#: seconds between two warnings about values that do not verify (a flood of forged writes logs little)
WARN_INTERVAL = 10.0
_warned: dict = {"at": None, "dropped": 0}


def _warn_forged(key: str) -> None:
    now = time.monotonic()
    if _warned["at"] is not None and now - _warned["at"] < WARN_INTERVAL:
        _warned["dropped"] += 1
        return
    more = f" (and {_warned['dropped']} more since the last warning)" if _warned["dropped"] else ""
    _warned["at"], _warned["dropped"] = now, 0
    log.warning("hvps: %s: ignored the value under %r%s: it does not carry the job's authentication (someone "
                "who can reach the rendezvous store wrote it)", WHERE, key, more)


def _get_authentic(store: Any, secret: Optional[bytes], key: str) -> Any:
    """The value under ``key`` when it verifies; None when there is none or it does not (with a warning)."""
    if not store.check([key]):
        return None
    ok, value = verify(secret, key, store.get(key))
    if not ok:
        _warn_forged(key)
        return None
    return value


def failed_key(number: int, worker: str) -> str:
    return f"elastic/failed/{number}/{worker}"


def report_failure(store: Any, secret: Optional[bytes], number: int, worker: str, reason: str) -> None:
    """The worker's side: a collective of round ``number`` failed here (``reason``)."""
    key = failed_key(number, worker)
    store.set(key, seal(secret, key, reason[:2000]))


def gave_up_key(worker: str) -> str:
    return f"elastic/gave_up/{worker}"


def report_gave_up(store: Any, secret: Optional[bytes], worker: str, reason: str) -> None:
    """The worker's side: its elastic loop gave up (too many resets without a commit); the job must end."""
    key = gave_up_key(worker)
    store.set(key, seal(secret, key, reason[:2000]))


def gave_up(store: Any, secret: Optional[bytes], worker: str) -> Optional[str]:
    """The driver's side: why ``worker``'s loop gave up, or None (also when the value does not verify)."""
    reason = _get_authentic(store, secret, gave_up_key(worker))
    return reason if isinstance(reason, str) else None


def failure_reports(store: Any, secret: Optional[bytes], number: int, workers) -> dict:
    """The driver's side: {worker: reason} of the ``workers`` that reported round ``number`` failed."""
    found = {}
    for worker in workers:
        reason = _get_authentic(store, secret, failed_key(number, worker))
        if isinstance(reason, str):
            found[worker] = reason
    return found


def publish_round(store: Any, secret: Optional[bytes], number: int, slots: dict) -> None:
    """The driver's side: round ``number`` with ``slots`` ({worker id: Slot})."""
    key = round_key(number)
    store.set(key, seal(secret, key, {worker: slot.as_list() for worker, slot in slots.items()}))
    store.set(ROUND_KEY, seal(secret, ROUND_KEY, number))


def publish_notice(store: Any, secret: Optional[bytes], number: int, timestamp: float, kind: int) -> None:
    """The driver's side: round ``number`` will change the hosts (``kind``: added 2, removed 1, both 3)."""
    store.set(NOTICE_KEY, seal(secret, NOTICE_KEY, {"round": number, "timestamp": timestamp, "kind": int(kind)}))


def latest_round(store: Any, secret: Optional[bytes], known: int = 0) -> int:
    """The newest round the driver published (0: none yet), at least ``known`` (a round already seen):
    the newest N whose authentic ``elastic/round/N`` exists, counting up from ``elastic/round`` (a hint)."""
    hint = _get_authentic(store, secret, ROUND_KEY)
    number = max(int(known), hint if isinstance(hint, int) and not isinstance(hint, bool) else 0)
    if number > known and _get_authentic(store, secret, round_key(number)) is None:
        number = int(known)  # a hint without its round (not authentic, or deleted): count up from what we know
    while store.check([round_key(number + 1)]) and _get_authentic(store, secret, round_key(number + 1)) is not None:
        number += 1
    return number


def round_slots(store: Any, secret: Optional[bytes], number: int) -> dict:
    """Round ``number``'s slots, {worker id: Slot}."""
    values = _get(store, secret, round_key(number))
    if values is None:
        raise HvpsError(f"{WHERE}: round {number} was announced but its slots are missing")
    return {worker: Slot.from_list(slot) for worker, slot in values.items()}


def notice(store: Any, secret: Optional[bytes]) -> Optional[dict]:
    """The driver's latest host-change notice, or None (also when it does not verify: a warning)."""
    found = _get_authentic(store, secret, NOTICE_KEY)
    if not isinstance(found, dict) or not {"round", "timestamp", "kind"} <= found.keys():
        return None
    return found
