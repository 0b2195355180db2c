"""An elastic job's membership, as hvpsrun's elastic driver publishes it in the job's rendezvous store.

Every change of membership (a worker failed or left, hosts were added or removed) starts a new
*round*. The driver writes, each value sealed with the job's secret (:func:`store_comm.seal`):

- ``elastic/round/N``: round N's slots, ``{worker id: [rank, size, local_rank, local_size,
  cross_rank, cross_size, host]}``; a worker (``host:slot``) that is not listed has no place in it;
- ``elastic/round``: the latest N (written after the round itself);
- ``elastic/notice``: ``{"round": N, "timestamp": t, "kind": HostUpdateResult}``, the host change
  that round N will bring, for rank 0 (the only worker notified, as in Horovod): rank 0's next
  ``commit()`` then interrupts every rank at once.

Workers write one kind of key: ``elastic/failed/N/<worker id>`` (its reason), when a collective of
round N failed and the worker waits for the next round. When no worker exited, the driver then
starts the next round itself: with the same members when all of them reported (an error every rank
saw), else without those that did not (stopped or hung: they are ended).

A worker joins the newest round above the one it last joined; its ranks exchange their start-up
values under the round's own key prefix, so nothing of an earlier round is ever read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..core.errors import HvpsError
from .store_comm import seal, unseal

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


def failed_key(number: int, worker: str) -> str:
    return f"elastic/failed/{number}/{worker}"


def report_failure(store: Any, secret: Optional[bytes], number: int, worker: str, reason: str) -> None:
    """The worker's side: a collective of round ``number`` failed here (``reason``)."""
    key = failed_key(number, worker)
    store.set(key, seal(secret, key, reason[:2000]))


def failure_reports(store: Any, secret: Optional[bytes], number: int, workers) -> dict:
    """The driver's side: {worker: reason} of the ``workers`` that reported round ``number`` failed."""
    found = {}
    for worker in workers:
        reason = _get(store, secret, failed_key(number, worker))
        if reason is not None:
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


def latest_round(store: Any, secret: Optional[bytes]) -> int:
    """The newest round the driver published (0: none yet)."""
    return int(_get(store, secret, ROUND_KEY) or 0)


def round_slots(store: Any, secret: Optional[bytes], number: int) -> dict:
    """Round ``number``'s slots, {worker id: Slot}."""
    values = _get(store, secret, round_key(number))
    if values is None:
        raise HvpsError(f"{WHERE}: round {number} was announced but its slots are missing")
    return {worker: Slot.from_list(slot) for worker, slot in values.items()}


def notice(store: Any, secret: Optional[bytes]) -> Optional[dict]:
    """The driver's latest host-change notice, or None."""
    return _get(store, secret, NOTICE_KEY)
