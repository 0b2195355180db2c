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

A prefetched pull of a synchronous table costs the next forward a round trip (owners answer
only after the update).  :meth:`Exchange.push_and_answer` removes it where that pays, for small
steps at small member counts (:func:`gather_pays`): every member sends its gradient rows to *every* member
(the sparse allgather of a replicated table) in the same message as its answer to the
prefetched pull, read before the update; owners apply the rows they own and every member brings
the records it pulled up to date with the same combined gradient and optimizer step, so both
ways give the same bits.

Every id message starts each destination's segment with a header: a status word, so when one
member's input is invalid all members learn it from the same collective and raise together
instead of leaving the others blocked in the next alltoall, and the counts :func:`gather_pays`
decides from, so every member knows every member's.

A prefetched pull of a synchronous table may wait for the next push to carry its ids
(``request(..., defer=True)``): each destination's segment of the push then starts with them, and
a step makes one collective fewer.  Whatever needs those ids before a push carried them (a
forward, the gather's answer, a stale table's early answer) sends them alone at that point,
which every member reaches alike.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from hvps.api.collectives import alltoall_async
from hvps.core.errors import HvpsError
from hvps.core.views import as_array, as_tensor
from hvps.runtime.process_sets import ProcessSet

from .table import ShardedTable

OK, BAD = 0, 1
#: words leading each destination's segment of an id message: status, the sender's ids in this
#: request, the gradient rows it will push for this batch (so every member knows every member's)
HEADER = 3
#: extra bytes per member that sending gradients to every member may cost to save the next
#: forward's round trip; measured with benchmarks/recsys.py at 2 members (benchmarks/RESULTS.md, issue 42 item 5):
#: faster at ~190 distinct ids a member (~25 KB more), no faster at ~1,200 (~160 KB), slower at 4
#: and 8 members
GATHER_EXTRA_BYTES = 64 << 10
#: names the id messages of pulls take in turn: more than the pulls that can be in flight at once
#: (a forward's, or up to two prefetched), as a name must be unique among outstanding collectives
REQUEST_NAMES = 3


@dataclass
class PendingPull:
    """A pull under way: ids sent to their owners (or waiting for a push to carry them, in
    ``unsent``); ``rows`` is set once the owners answered."""

    order: torch.Tensor  # position of each id in the owner-grouped message
    sent: torch.Tensor  # the ids in owner-grouped order
    splits: list  # how many of them each member owns
    unsent: Optional[list]  # the id message's segment for each member, until it travels
    parse: Callable[[torch.Tensor, list], tuple]  # reads it: (ids, counts per member) -> what ids() returns
    send: Callable[[list], Callable[[], tuple]]  # sends it alone; returns wait() -> (ids, counts per member)
    rows: Optional[Callable[[], tuple]] = None  # wait for the rows (or records) sent back
    _parsed: Optional[Callable[[], tuple]] = None

    def travel(self, arrived: Callable[[], tuple]) -> None:
        """The ids are under way: ``arrived()`` waits for (the ids received, counts per member)."""
        parse, self.unsent = self.parse, None
        self._parsed = functools.cache(lambda: parse(*arrived()))  # the first result, to every later call

    def ids(self) -> tuple:
        """Wait for the ids that reached this member: ``(ids, counts per member, [[ids asked,
        rows to push]] per member)`` (sent alone now if no push carried them)."""
        if self._parsed is None:
            self.travel(self.send(self.unsent))
        return self._parsed()


def gather_pays(push_rows: list, pull_rows: list, dim: int, width: int, grad_width: int) -> bool:
    """Whether sending gradients to every member beats sending them to their owners.

    Args:
        push_rows: gradient rows each member pushes this step (the same list on every member).
        pull_rows: ids each member's prefetched pull asks for (or an estimate every member shares:
            the module passes those of the step's own batch, known before the prefetched ids arrive).
        dim: embedding values per row (what the owners send back otherwise).
        width: values per record (embedding and optimizer state: what they send back instead).
        grad_width: values per gradient row (with its id and weight).

    Returns:
        True when the bytes the gather adds per member, against sending gradient rows to their
        owners only, stay within :data:`GATHER_EXTRA_BYTES`: the price of the round trip it saves.
        A rule of quantities every member knows, so every member takes the same way.
    """
    n = len(push_rows)
    away = (n - 1) / n  # the share of rows another member owns
    extra = (sum(push_rows) * grad_width * (n - 1 - away) + sum(pull_rows) * (width - dim) * away) * 4 / n
    return extra <= GATHER_EXTRA_BYTES


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
        self.messages = 0  # alltoalls started
        self.gathers = 0  # steps whose gradients went to every member (push_and_answer)
        self.requests = 0  # pulls requested: their messages take turns among REQUEST_NAMES names

    def _alltoall_async(self, tensor: torch.Tensor, splits: list, tag: str) -> Callable[[], tuple]:
        self.bytes_sent += tensor.numel() * tensor.element_size() - self._own_bytes(tensor, splits)
        self.messages += 1
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

    def _id_parser(self, error: Optional[str]) -> Callable[[torch.Tensor, list], tuple]:
        """How a member reads an id message: ``parse(received ids, counts per member) -> (ids,
        counts per member, [[ids asked, rows to push]] per member)``, which raises ValueError on
        every member when any member's status says its input was invalid."""

        def parse(received: torch.Tensor, counts: list) -> tuple:
            starts = torch.tensor([0] + counts[:-1]).cumsum(0)
            heads = received[starts.view(-1, 1) + torch.arange(HEADER)]
            bad = (heads[:, 0] != OK).nonzero().view(-1).tolist()
            if error:
                raise ValueError(error)
            if bad:
                raise ValueError(f"table {self.table.name!r}: member(s) {bad} of the process set passed invalid "
                                 "ids (their error says which)")
            keep = torch.ones(received.numel(), dtype=torch.bool)
            keep[starts.view(-1, 1) + torch.arange(HEADER)] = False
            return received[keep], [c - HEADER for c in counts], heads[:, 1:].tolist()

        return parse

    def request(self, ids: torch.Tensor, error: Optional[str] = None, push_rows: int = 0,
                defer: bool = False) -> "PendingPull":
        """Start sending distinct ``ids`` to their owners (the first half of a pull).

        Args:
            ids: distinct ids.
            error: why this member's input is invalid (every member raises it at ``ids()``).
            push_rows: the gradient rows this member will push for the batch (told to every member).
            defer: leave the ids for the next :meth:`push` to carry (sent alone if wanted first).

        Returns:
            The pull; its ``ids()`` waits for the ids sent to this member, each segment led by
            :data:`HEADER` words.
        """
        order, splits = self._route(ids)
        sent = ids[order]
        self.requests += 1
        tag = f"pull.ids.{self.requests % REQUEST_NAMES}"
        message = sent[:0] if error else sent
        header = torch.tensor([BAD if error else OK, message.numel(), push_rows], dtype=torch.int64)
        parts = torch.split(message.to(torch.int64).cpu(), [0] * self.members if error else splits)
        pull = PendingPull(order, sent, splits, [torch.cat([header, part]) for part in parts], self._id_parser(error),
                           lambda segments: self._alltoall_async(torch.cat(segments), [t.numel() for t in segments], tag))
        if not defer:
            pull.travel(pull.send(pull.unsent))
        return pull

    def _start_message(self, parts: list, tag: str, carry: Optional["PendingPull"]) -> Callable[[], list]:
        """Start an alltoall of flat float32 ``parts`` (one per member); when ``carry`` is a pull
        whose ids are unsent, each part is led by its id segment (its length in one int64, then
        the segment), so that they travel together.

        Returns:
            ``wait() -> the part received from each member`` (later calls return the first result).
        """
        segments = carry.unsent if carry is not None else None
        if segments is not None:
            lead = [torch.cat([torch.tensor([t.numel()]), t]).view(torch.float32) for t in segments]
            parts = [torch.cat([a, b]) for a, b in zip(lead, parts)]
        wait = self._alltoall_async(torch.cat(parts), [t.numel() for t in parts], tag)

        @functools.cache
        def received() -> tuple:
            message, sizes = wait()
            parts = torch.split(message, sizes)
            if segments is None:
                return list(parts), None
            counts = [int(p[:2].clone().view(torch.int64)) for p in parts]
            ids = torch.cat([p[2: 2 + 2 * n].clone().view(torch.int64) for p, n in zip(parts, counts)])
            return [p[2 + 2 * n:] for p, n in zip(parts, counts)], (ids, counts)

        if segments is not None:
            carry.travel(lambda: received()[1])
        return lambda: received()[0]

    def answer(self, pending: "PendingPull") -> None:
        """Owner side: wait for the ids sent to this member, read their rows now and start
        sending them back (every member calls it at the same point)."""
        wanted, counts, _ = pending.ids()
        rows = self.table.lookup(self.table.partition.slot(wanted))
        pending.rows = self._alltoall_async(rows, counts, "pull.rows")

    def receive(self, pending: "PendingPull") -> torch.Tensor:
        """The rows of a request, in the order its ids were given (answers it first if needed)."""
        if pending.rows is None:
            self.answer(pending)
        back, _ = pending.rows()
        out = torch.empty(back.shape[0], self.table.dim, dtype=back.dtype, device=back.device)
        out[pending.order] = back[:, : self.table.dim]
        return out

    def push(self, ids: torch.Tensor, grads: torch.Tensor, weights: Optional[torch.Tensor] = None,
             carry: Optional["PendingPull"] = None) -> Callable[[], None]:
        """Start sending gradient rows of ``ids`` (repeats allowed, in batch order) to their owners.

        Returns ``finish()``, which waits and makes the owner's optimizer step.  ``weights`` scale
        each row (the 1 / bag size of a mean bag).  The owner adds the rows of one id in member
        order, then in each member's order: the global batch's order.  The ids travel in the
        same message as the gradients, their int64 bits carried in two float32 columns; so do
        ``carry``'s ids when that pull's are unsent (:meth:`request` with ``defer``).
        """
        order, splits = self._route(ids)
        rows = self._gradient_rows(ids, grads, weights, order)
        width = rows.shape[1]
        wait = self._start_message(list(torch.split(rows.reshape(-1), [n * width for n in splits])), "push", carry)

        def finish() -> None:
            self._apply(torch.cat(wait()).view(-1, width), weights is not None)

        return finish

    def push_and_answer(self, ids: torch.Tensor, grads: torch.Tensor, weights: Optional[torch.Tensor],
                        pending: "PendingPull", carry: Optional["PendingPull"] = None) -> Callable[[], tuple]:
        """:meth:`push` to every member, in one message with this owner's answer to ``pending``
        (a prefetched pull), its records read before this step's update (and ``carry``'s ids, as
        :meth:`push` carries them).

        Sets ``pending.rows`` to the records it pulled, brought up to date with the update that
        the returned ``finish()`` applies (whichever is called first waits and applies it).
        """
        self.gathers += 1
        wanted, counts, _ = pending.ids()
        records = self.table.records_of(self.table.partition.slot(wanted))
        gradient = self._gradient_rows(ids, grads, weights)
        flat, width = gradient.reshape(-1), self.table.width
        answers = torch.split(records.reshape(-1), [c * width for c in counts])
        wait = self._start_message([torch.cat([part, flat]) for part in answers], "push.answer", carry)

        @functools.cache  # whichever of the module and the pull calls it first
        def finish() -> tuple:
            asked = [c * width for c in pending.splits]
            parts = wait()
            pulled = torch.cat([p[:a] for p, a in zip(parts, asked)]).view(-1, width)
            rows = torch.cat([p[a:] for p, a in zip(parts, asked)]).view(-1, gradient.shape[1])
            distinct, combined = self._apply(rows, weights is not None)
            if distinct.numel():  # the same combined rows and optimizer step as their owners'
                at = torch.searchsorted(distinct, pending.sent).clamp(max=distinct.numel() - 1)
                hit = (distinct[at] == pending.sent).nonzero().view(-1)
                pulled[hit] = self.table.optimizer.step(pulled[hit], combined[at[hit]], self.table.dim)
            return pulled, pending.splits

        pending.rows = finish
        return finish

    def _gradient_rows(self, ids: torch.Tensor, grads: torch.Tensor, weights: Optional[torch.Tensor],
                       order: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One message row per gradient row: the gradient, the id's int64 bits in two float32
        columns, and the weight when there is one."""
        pick = (lambda t: t[order]) if order is not None else (lambda t: t)
        columns = [pick(grads).cpu(), pick(ids).to(torch.int64).cpu().view(torch.float32).view(-1, 2)]
        if weights is not None:
            columns.append(pick(weights).cpu().view(-1, 1))
        return torch.cat(columns, dim=1)

    def _apply(self, received: torch.Tensor, weighted: bool) -> tuple:
        """Combine gradient rows (from :meth:`_gradient_rows`, in member order) by id and step the
        optimizer on the rows this member owns; returns ``(distinct ids, combined gradients)``."""
        dim = self.table.dim
        received_ids = received[:, dim: dim + 2].reshape(-1).clone().view(torch.int64)
        scale = received[:, dim + 2].contiguous() if weighted else None
        distinct, inverse = torch.unique(received_ids, return_inverse=True)
        combined = combine(inverse, received[:, :dim], distinct.numel(), scale)
        partition = self.table.partition
        mine = partition.owner(distinct) == self.table.member
        self.table.apply(partition.slot(distinct[mine]), combined[mine])
        return distinct, combined


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
