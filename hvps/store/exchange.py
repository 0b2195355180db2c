"""Moving ids, rows and gradients between members with hvps's alltoall (any backend).

The two directions of a parameter-server round trip (ps-lite's pull and push, TorchRec's
input and output distribution), without a server: every member is the owner of one shard.

* a pull sends each distinct id to its owner (:meth:`Exchange.request`), the owner reads its
  row (:meth:`Exchange.answer`, when the module decides) and sends it back
  (:meth:`Exchange.receive`);
* :meth:`Exchange.push` sends gradient rows to the owners, which combine the rows of one id
  and hand the result to the optimizer; it returns while the rows travel, and the step is
  finished before the owners answer the next pull (so lookups see every update of the
  previous step unless the table allows staleness).

Every id message starts each destination's segment with a status word, so when one member's
input is invalid all members learn it from the same collective and raise together instead of
leaving the others blocked in the next alltoall.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from hvps.api.collectives import alltoall_async
from hvps.core.errors import HvpsError
from hvps.core.views import as_array, as_tensor
from hvps.runtime.process_sets import ProcessSet

from .table import ShardedTable

OK, BAD = 0, 1


@dataclass
class PendingPull:
    """A pull under way: ids sent to their owners; ``rows`` is set once the owners answered."""

    order: torch.Tensor  # position of each id in the owner-grouped message
    ids: Callable[[], tuple]  # wait for the ids that reached this member
    rows: Optional[Callable[[], tuple]] = None  # wait for the rows sent back


def combine(inverse: torch.Tensor, grads: torch.Tensor, count: int,
            weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum ``grads`` rows (each scaled by ``weights``) into ``count`` rows by ``inverse``.

    On CPU ``index_add_`` adds the rows in their order (a serial loop), so with the rows in
    global batch order the result does not depend on how many members there are.
    """
    if weights is not None:
        grads = grads * weights.view(-1, 1)
    out = torch.zeros(count, grads.shape[1], dtype=grads.dtype, device=grads.device)
    return out.index_add_(0, inverse, grads)


class Exchange:
    """Pull and push for one table over ``process_set``."""

    def __init__(self, table: ShardedTable, process_set: ProcessSet) -> None:
        self.table = table
        self.process_set = process_set
        self.members = table.partition.parts
        self.bytes_sent = 0  # payload bytes this member put on the wire

    def _alltoall_async(self, tensor: torch.Tensor, splits: list, tag: str) -> Callable[[], tuple]:
        self.bytes_sent += tensor.numel() * tensor.element_size() - self._own_bytes(tensor, splits)
        handle = alltoall_async(as_array(tensor.detach().contiguous().cpu()), splits,
                                name=f"store.{self.table.name}.{tag}", process_set=self.process_set)

        def wait() -> tuple:
            out, received = handle.wait()
            return as_tensor(out).to(tensor.device), [int(n) for n in received]

        return wait

    def _own_bytes(self, tensor: torch.Tensor, splits: list) -> int:
        """Bytes a member sends to itself never cross the wire."""
        row_bytes = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
        return splits[self.table.member] * row_bytes

    def _route(self, ids: torch.Tensor) -> tuple:
        owners = self.table.partition.owner(ids)
        order = torch.argsort(owners, stable=True)
        splits = torch.bincount(owners, minlength=self.members).tolist()
        return order, splits

    def _send_ids(self, ids: torch.Tensor, splits: list, tag: str, error: Optional[str]) -> Callable[[], tuple]:
        """Start an alltoall of ids grouped by owner, each segment led by a status word.

        Returns ``wait() -> (received ids, counts per member)``, which raises ValueError on every
        member when any member's status says its input was invalid.
        """
        status = torch.tensor([BAD if error else OK], dtype=torch.int64)
        if error:
            ids, splits = ids[:0], [0] * self.members
        parts = torch.split(ids.to(torch.int64).cpu(), splits)
        message = torch.cat([t for part in parts for t in (status, part)])
        pending = self._alltoall_async(message, [s + 1 for s in splits], tag)

        def wait() -> tuple:
            received, counts = pending()
            starts = torch.tensor([0] + counts[:-1]).cumsum(0)
            bad = [m for m, start in enumerate(starts.tolist()) if int(received[start]) != OK]
            if error:
                raise ValueError(error)
            if bad:
                raise ValueError(f"table {self.table.name!r}: member(s) {bad} of the process set passed invalid "
                                 "ids (their error says which)")
            keep = torch.ones(received.numel(), dtype=torch.bool)
            keep[starts] = False
            return received[keep], [c - 1 for c in counts]

        return wait

    def request(self, ids: torch.Tensor, error: Optional[str] = None) -> "PendingPull":
        """Start sending distinct ``ids`` to their owners (the first half of a pull)."""
        order, splits = self._route(ids)
        return PendingPull(order, self._send_ids(ids[order], splits, "pull.ids", error))

    def answer(self, pending: "PendingPull") -> None:
        """Owner side: wait for the ids sent to this member, read their rows now and start
        sending them back (every member calls it at the same point)."""
        wanted, counts = pending.ids()
        rows = self.table.lookup(self.table.partition.slot(wanted))
        pending.rows = self._alltoall_async(rows, counts, "pull.rows")

    def receive(self, pending: "PendingPull") -> torch.Tensor:
        """The rows of a request, in the order its ids were given (answers it first if needed)."""
        if pending.rows is None:
            self.answer(pending)
        back, _ = pending.rows()
        out = torch.empty_like(back)
        out[pending.order] = back
        return out

    def push(self, ids: torch.Tensor, grads: torch.Tensor,
             weights: Optional[torch.Tensor] = None) -> Callable[[], None]:
        """Start sending gradient rows of ``ids`` (repeats allowed, in batch order) to their owners.

        Returns ``finish()``, which waits and makes the owner's optimizer step.  ``weights`` scale
        each row (the 1 / bag size of a mean bag).  The owner adds the rows of one id in member
        order, then in each member's order: the global batch's order.  The ids travel in the
        same message as the gradients, their int64 bits carried in two float32 columns.
        """
        order, splits = self._route(ids)
        columns = [grads[order].cpu(), ids[order].to(torch.int64).cpu().view(torch.float32).view(-1, 2)]
        if weights is not None:
            columns.append(weights[order].cpu().view(-1, 1))
        wait = self._alltoall_async(torch.cat(columns, dim=1), splits, "push")
        dim = self.table.dim

        def finish() -> None:
            received, _ = wait()
            received_ids = received[:, dim: dim + 2].reshape(-1).clone().view(torch.int64)
            scale = received[:, dim + 2].contiguous() if weights is not None else None
            distinct, inverse = torch.unique(self.table.partition.slot(received_ids), return_inverse=True)
            self.table.apply(distinct, combine(inverse, received[:, :dim], distinct.numel(), scale))

        return finish


def check_same_everywhere(description: dict, name: str, process_set: ProcessSet) -> None:
    """Raise HvpsError on every member unless all members describe table ``name`` alike."""
    from hvps.api.collectives import allgather_object

    seen = allgather_object(description, name=f"store.{name}.config", process_set=process_set)
    differing = sorted({key for other in seen for key in set(other) | set(description)
                        if other.get(key) != seen[0].get(key)})
    if differing:
        values = {key: [d.get(key) for d in seen] for key in differing}
        raise HvpsError(f"table {name!r} is configured differently across the process set's members: "
                        f"{values} (one value per member); construct it with the same arguments everywhere")
