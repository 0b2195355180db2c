"""``ShardedEmbeddingBag`` and ``ShardedEmbedding``: torch modules over a sharded table.

Forward (TorchRec's row-wise sharding, with hvps's alltoall): deduplicate the batch's ids,
pull each distinct row from its owner, then pool (bag) or index (embedding) locally with
torch's own kernels.  Backward: push gradient rows to the owners, which combine them and
step the row-wise optimizer in place (so a backward *is* the table's optimizer step; the
table has no ``nn.Parameter`` and no ``state_dict`` entries, and dense optimizers never see
it).  Every member of the process set must run each forward and backward, in the same order.
"""

from __future__ import annotations

import os
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from hvps.runtime.process_sets import ProcessSet, global_process_set

from .exchange import Exchange, PendingPull, check_same_everywhere, combine, gather_pays
from .optim import RowOptimizer, make_optimizer
from .stale import StaleRows
from .table import Initializer, ShardedTable, StoreOptions

COMBINES = ("ordered", "local")
#: the tables built in this process, for the metrics exporter (hvps/metrics/store.py)
_LIVE: "weakref.WeakSet[_ShardedBase]" = weakref.WeakSet()


#: synchronous tables whose prefetched lookup waits for this step's update before the owners
#: answer it, in backward order (the same on every rank); the next forward of any table answers
#: them all, so that their gradient and row exchanges overlap instead of waiting table by table
_AWAITING: list = []


def live_tables() -> list:
    """The store modules alive in this process."""
    return list(_LIVE)


def _answer_awaiting() -> None:
    """Finish every awaiting table's update, then have the owners answer its prefetched lookup."""
    awaiting = list(_AWAITING)
    _AWAITING.clear()
    for module, lookup in awaiting:  # every push was started in the backward: these waits overlap
        module.synchronize()
        module._answer(lookup)


@dataclass
class _Batch:
    """One forward's ids and how they map onto the output."""

    ids: torch.Tensor  # flat int64
    shape: tuple  # the input's shape
    offsets: Optional[torch.Tensor] = None  # bags: start of each bag
    bag: Optional[torch.Tensor] = None  # bags: the bag of each id
    weights: Optional[torch.Tensor] = None  # mean bags: 1 / bag size per id
    error: Optional[str] = None
    distinct: Optional[torch.Tensor] = None
    inverse: Optional[torch.Tensor] = None

    def same_input(self, other: "_Batch") -> bool:
        """Whether ``other`` was made from the same input (a prefetched batch and its forward)."""
        offsets = (self.offsets is None) == (other.offsets is None) and (
            self.offsets is None or torch.equal(self.offsets, other.offsets))
        return (self.shape == other.shape and self.error == other.error and offsets
                and torch.equal(self.ids, other.ids))


@dataclass
class _Lookup:
    """A batch's lookup under way: its distinct ids sent to their owners (by a forward, or
    ahead of it by ``prefetch``), plus, with staleness, the rows this member reuses."""

    batch: _Batch
    pull: PendingPull
    known: Optional[torch.Tensor] = None  # stale mode: distinct ids served from this member's copies
    kept: Optional[torch.Tensor] = None  # ... and their rows
    error: Optional[ValueError] = None  # raised by an early answer: the forward raises it


def check_ids(name: str, ids: Any, num_embeddings: int) -> Optional[str]:
    """Why ``ids`` cannot index table ``name`` (None when they can)."""
    if not isinstance(ids, torch.Tensor):
        return f"table {name!r}: ids must be a torch tensor of integers, got {type(ids).__name__}"
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        return f"table {name!r}: ids must be integers, got dtype {ids.dtype}"
    if ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= num_embeddings:
            bad = ids[(ids < 0) | (ids >= num_embeddings)].flatten()[:5].tolist()
            return (f"table {name!r}: ids must lie in [0, {num_embeddings}), got {bad} "
                    f"(range seen {low}..{high})")
    return None


class _LookupFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module: "_ShardedBase", lookup: _Lookup, anchor: torch.Tensor) -> torch.Tensor:
        ctx.module, ctx.batch, ctx.pull = module, lookup.batch, lookup.pull
        return module._finish(lookup)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.module._push(ctx.batch, ctx.pull, grad)
        return None, None, None


class _ShardedBase(nn.Module):
    """Shared construction, pull and push of the two modules.

    Arguments (keyword-only after the shape): ``name`` (unique per table; names its collectives,
    files and errors), ``optimizer`` ("sgd", "adagrad", "adam", a dict of hyper-parameters or a
    :class:`RowOptimizer`) and ``lr``, ``process_set`` (whose members share the table),
    ``partition`` ("hash" or "range"), ``tier`` ("host" or "disk" with ``disk_dir``),
    ``cache_rows`` / ``cache_bytes`` (0: no cache; with ``tier="host"`` on the CPU none is
    built, see :meth:`stats`) and ``cache_policy`` ("lru", "lfu"),
    ``staleness`` (k >= 0), ``combine`` ("local" or "ordered"), ``seed`` / ``initializer``
    (``f(global_ids, dim) -> rows``; default uniform +-sqrt(1/num_embeddings) by id),
    ``device`` (the cache's; default cuda when available) and ``prefetch_depth`` (how many
    batches :meth:`prefetch` may run ahead of the forward; 1, or 2 for synchronous tables).
    Construction is collective and raises HvpsError when the members' arguments differ.
    """

    kind = ""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, name: str,
                 optimizer: Union[str, RowOptimizer, Mapping[str, Any]] = "sgd", lr: float = 0.01,
                 process_set: ProcessSet = global_process_set, partition: str = "hash", tier: str = "host",
                 disk_dir: Optional[Union[str, os.PathLike]] = None, cache_rows: int = 0, cache_bytes: int = 0,
                 cache_policy: str = "lru", staleness: int = 0, combine: str = "local", seed: int = 0,
                 initializer: Optional[Initializer] = None, device: Optional[str] = None, mode: str = "",
                 prefetch_depth: int = 1) -> None:
        super().__init__()
        if num_embeddings < 1 or embedding_dim < 1:
            raise ValueError(f"table {name!r}: num_embeddings and embedding_dim must be >= 1")
        if combine not in COMBINES:
            raise ValueError(f"table {name!r}: combine must be one of {COMBINES}, got {combine!r}")
        if staleness < 0:
            raise ValueError(f"table {name!r}: staleness must be >= 0, got {staleness}")
        if prefetch_depth not in (1, 2) or prefetch_depth == 2 and staleness:
            raise ValueError(f"table {name!r}: prefetch_depth must be 1, or 2 with staleness=0, "
                             f"got {prefetch_depth} (staleness={staleness})")
        if not process_set.included():
            raise ValueError(f"table {name!r}: this rank is not a member of {process_set}")
        self.name = name
        self.mode = mode
        self.process_set = process_set
        self.options = StoreOptions(partition=partition, tier=tier, disk_dir=disk_dir, cache_rows=cache_rows,
                                    cache_bytes=cache_bytes, cache_policy=cache_policy, staleness=staleness,
                                    combine=combine, seed=seed, device=device)
        row_optimizer = make_optimizer(optimizer, lr)
        check_same_everywhere({"module": self.kind, "mode": mode, "prefetch_depth": prefetch_depth,
                               "num_embeddings": int(num_embeddings),
                               "embedding_dim": int(embedding_dim), "optimizer": row_optimizer.state_dict(),
                               "initializer": initializer is None, **self.options.describe()},
                              name, process_set)
        self.table = ShardedTable(name, num_embeddings, embedding_dim, row_optimizer, self.options,
                                  process_set.rank(), process_set.size(), initializer)
        self.exchange = Exchange(self.table, process_set)
        self.stale = StaleRows(staleness, int(embedding_dim)) if staleness else None
        self._pending: Optional[Callable[[], None]] = None
        self.prefetch_depth = prefetch_depth
        self._ahead: "deque[_Lookup]" = deque()  # prefetched lookups, oldest first
        self._backward_due = False  # a forward's backward (its push) is still to come
        _LIVE.add(self)

    @property
    def num_embeddings(self) -> int:
        return self.table.num_embeddings

    @property
    def embedding_dim(self) -> int:
        return self.table.dim

    # ------------------------------------------------------------------ the round trip
    def prefetch(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None) -> None:
        """Start a coming forward's lookup now, so that its ids travel while this step computes.

        TorchRec's pipelined input distribution: call it with the next batch after the current
        forward; the next forward must then be given the same batch (ValueError otherwise).
        With ``prefetch_depth=2`` call it with the batch after next (after the first forward,
        with the next batch first): its ids then travel during this step and the one
        after, so the backward that answers them never waits for them, and a step of a
        gathering table (below) makes one exchange only.  Forwards take the prefetched
        batches in the order given.  A synchronous table's ids travel in the message of the
        backward to come (one collective fewer), or alone where they are wanted first.
        Synchronous tables, where :func:`~hvps.store.exchange.gather_pays`: this step's backward
        sends its gradients to every member with the owners' answer, and every member brings
        the rows it pulled up to date itself, so the next forward waits for nothing.  Otherwise
        the next forward of any table finishes this step's updates of every table and has the
        owners answer all prefetched lookups at once, so the tables' exchanges overlap instead
        of waiting one after another.  Either way the rows are exact.  With
        ``staleness >= 1`` the owners answer during this step's backward, before its update, so
        nothing waits: the rows then miss that one update, within the bound (and rows this
        member keeps are reused for one step less).  Collective, like a forward.

        Args:
            input: a coming batch's ids, as its forward will take them.
            offsets: the bags' starts for a 1-D ``input`` (``ShardedEmbeddingBag``).

        Raises:
            ValueError: ``prefetch_depth`` batches are prefetched already and no forward took one.
        """
        if len(self._ahead) == self.prefetch_depth:
            times = "twice" if self.prefetch_depth == 1 else f"{self.prefetch_depth + 1} times"
            raise ValueError(f"table {self.name!r}: prefetch called {times} without a forward in between "
                             f"(prefetch_depth={self.prefetch_depth})")
        # a synchronous table's ids ride in the push of the backward to come (one collective fewer)
        defer = self.stale is None and self._backward_due
        self._ahead.append(self._start(self._batch(input, offsets), lag=1, defer=defer))

    def _start(self, batch: _Batch, lag: int, defer: bool = False) -> _Lookup:
        """Deduplicate ``batch``'s ids and send the ones to pull to their owners (``defer``: with
        the next push, :meth:`Exchange.request`)."""
        batch.distinct, batch.inverse = torch.unique(batch.ids, return_inverse=True)
        pushing = (batch.ids if self.options.combine == "ordered" else batch.distinct).numel()
        if self.stale is None or not self.training:
            return _Lookup(batch, self.exchange.request(batch.distinct, batch.error, pushing, defer))
        self.stale.advance(lag)
        known, kept = self.stale.find(batch.distinct)
        return _Lookup(batch, self.exchange.request(batch.distinct[~known], batch.error, pushing), known, kept)

    def _finish(self, lookup: _Lookup) -> torch.Tensor:
        """Wait for ``lookup``'s rows and pool them into the forward's output."""
        if _AWAITING:
            _answer_awaiting()
        if lookup.error is not None:
            error, lookup.error = lookup.error, None
            try:
                raise error
            finally:  # the traceback keeps this frame: no reference from it back to the error (a cycle kept the
                del error  # table, and its push in flight, alive until a garbage collection)
        if lookup.pull.rows is None:  # owners read after the last step's update, which lands meanwhile
            self.synchronize()
        fetched = self.exchange.receive(lookup.pull)
        batch, rows = lookup.batch, fetched
        if lookup.known is not None:
            self.stale.remember(batch.distinct[~lookup.known], fetched)
            rows = fetched.new_empty(batch.distinct.numel(), self.table.dim)
            rows[lookup.known] = lookup.kept.to(rows.device)
            rows[~lookup.known] = fetched
        return self._assemble(rows, batch.inverse, batch)

    def _answer(self, lookup: _Lookup) -> None:
        """Owners answer a prefetched lookup now, from the rows as they are."""
        try:
            self.exchange.answer(lookup.pull)
        except ValueError as exc:  # invalid ids: every member learns it here, and its forward raises
            lookup.error = exc.with_traceback(None)  # kept without this frame (which holds the lookup): no cycle

    def synchronize(self) -> None:
        """Finish the last backward's optimizer step (the next forward does it anyway)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending()

    def _assemble(self, rows: torch.Tensor, inverse: torch.Tensor, batch: _Batch) -> torch.Tensor:
        raise NotImplementedError

    def _push(self, batch: _Batch, pull: PendingPull, grad: torch.Tensor) -> None:
        self._backward_due = False
        grad = grad.contiguous()
        rows = grad[batch.bag] if batch.bag is not None else grad.reshape(-1, self.table.dim)
        self.synchronize()
        ahead = self._ahead[0] if self._ahead else None  # the next forward's lookup
        if ahead is not None and (ahead.pull.rows is not None or ahead.error is not None):
            ahead = None  # already answered
        stale = self.options.staleness > 0
        if ahead is not None and stale:  # before this step's update: one step stale, nothing waits
            self._answer(ahead)
        if self.options.combine == "ordered":
            ids, weights = batch.ids, batch.weights
        else:
            ids, rows, weights = batch.distinct, combine(batch.inverse, rows, batch.distinct.numel(), batch.weights), None
        carry = self._ahead[-1].pull if self._ahead else None  # the newest prefetched ids, if still unsent
        if ahead is not None and not stale and self._gather(pull, ahead, weights is not None):
            self._pending = self.exchange.push_and_answer(ids, rows, weights, ahead.pull, carry)
            return
        self._pending = self.exchange.push(ids, rows, weights, carry)
        if ahead is not None and not stale and ahead.error is None:  # answered with exact rows at the next forward
            _AWAITING.append((self, ahead))

    def _gather(self, pull: PendingPull, ahead: _Lookup, weighted: bool) -> bool:
        """Whether this step sends its gradients to every member with the answer to the prefetched
        lookup ``ahead`` (:func:`gather_pays`, from this batch's counts, which every member was told
        with its ids: the prefetched batch's ids may still be under way, and only the gather waits
        for them)."""
        counts = pull.ids()[2]  # [ids asked, gradient rows pushed] of each member
        dim = self.table.dim
        if not gather_pays([p for _, p in counts], [a for a, _ in counts], dim, self.table.width, dim + 2 + weighted):
            return False
        try:
            ahead.pull.ids()
        except ValueError as exc:  # invalid prefetched ids: every member learns it here, its forward raises
            ahead.error = exc.with_traceback(None)  # as in _answer
            return False
        return True

    def _batch(self, input: Any, offsets: Optional[torch.Tensor]) -> _Batch:
        raise NotImplementedError

    def _run(self, batch: _Batch) -> torch.Tensor:
        if self._ahead and not self._ahead[0].batch.same_input(batch):
            raise ValueError(f"table {self.name!r}: the forward got a different batch than the one prefetched; "
                             "pass the prefetched batch to the next forward")
        lookup = self._ahead.popleft() if self._ahead else self._start(batch, lag=0)
        anchor = torch.zeros((), requires_grad=self.training and torch.is_grad_enabled())
        self._backward_due = anchor.requires_grad  # its push may carry a prefetch's ids
        return _LookupFunction.apply(self, lookup, anchor)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict:
        """Counters, after finishing the last backward's update.

        Returns:
            ``bytes_sent`` (payload this rank put on the wire), ``messages`` (alltoalls it
            started), ``gathers`` (steps whose gradients went to every member), ``tier`` / ``tier_bytes`` / ``cache_bytes`` (memory
            held), ``cache``: ``"lru"`` or ``"lfu"`` when the table has a row cache, then with
            its ``hits``, ``misses``, ``hit_rate``, ``evictions`` and ``bytes_to_cache`` /
            ``bytes_to_tier`` / ``bytes_bypass``; ``"none"`` when none was asked for;
            ``"bypassed: host tier"`` when one was asked for in front of the host tier on the
            CPU, where it would only copy rows within the same memory, so the table reads its
            shard directly and counts no hits or misses. With ``staleness``: ``stale_reused``
            and ``stale_pulled``.
        """
        self.synchronize()
        return self.counters()

    def counters(self) -> dict:
        """The counters of :meth:`stats` as they stand, without waiting for anything (any thread may call it)."""
        out = {"bytes_sent": self.exchange.bytes_sent, "messages": self.exchange.messages,
               "gathers": self.exchange.gathers, "cache": self.table.cache_state, **self.table.memory()}
        if self.table.cache is not None:
            out.update(self.table.cache.stats.as_dict())
        if self.stale is not None:
            out.update(stale_reused=self.stale.reused, stale_pulled=self.stale.pulled)
        return out

    def extra_repr(self) -> str:
        return (f"{self.table.num_embeddings}, {self.table.dim}, name={self.name!r}, "
                f"members={self.table.partition.parts}, optimizer={self.table.optimizer.name}")


class ShardedEmbeddingBag(_ShardedBase):
    """Like ``nn.EmbeddingBag`` (modes "sum" and "mean"), with rows sharded over ``process_set``.

    ``forward(input, offsets=None)``: ``input`` is [B, L] (fixed bags) or 1-D with ``offsets``.
    See :class:`_ShardedBase` for the storage arguments (``tier``, ``cache_rows``, ...).
    """

    kind = "bag"

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str = "mean", **kwargs: Any) -> None:
        if mode not in ("sum", "mean"):
            raise ValueError(f"table {kwargs.get('name')!r}: mode must be 'sum' or 'mean', got {mode!r}")
        super().__init__(num_embeddings, embedding_dim, mode=mode, **kwargs)

    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._run(self._batch(input, offsets))

    def _batch(self, input: Any, offsets: Optional[torch.Tensor]) -> _Batch:
        error = check_ids(self.name, input, self.table.num_embeddings)
        if error is None and not (input.dim() == 2 and offsets is None or input.dim() == 1 and offsets is not None):
            error = f"table {self.name!r}: input must be 2-D, or 1-D with offsets (got {input.dim()}-D)"
        if error is not None:
            return _Batch(torch.empty(0, dtype=torch.int64), (0,), error=error)
        ids = input.reshape(-1).to(torch.int64)
        if offsets is None:  # fixed bags: id i is in bag i // length
            bags, length = input.shape
            offsets = torch.arange(0, bags * length, length, dtype=torch.int64, device=ids.device)
            bag = torch.arange(bags, device=ids.device).repeat_interleave(length)
        else:
            offsets = offsets.to(torch.int64)
            bag = torch.bucketize(torch.arange(ids.numel(), device=ids.device), offsets, right=True) - 1
        weights = None
        if self.mode == "mean":
            sizes = torch.diff(offsets, append=torch.tensor([ids.numel()], device=offsets.device))
            weights = (1.0 / sizes.clamp(min=1).double()).float()[bag]
        return _Batch(ids, tuple(input.shape), offsets=offsets, bag=bag, weights=weights)

    def _assemble(self, rows: torch.Tensor, inverse: torch.Tensor, batch: _Batch) -> torch.Tensor:
        if len(batch.shape) == 2:
            return F.embedding_bag(inverse.view(batch.shape), rows, mode=self.mode)
        return F.embedding_bag(inverse, rows, batch.offsets, mode=self.mode)


class ShardedEmbedding(_ShardedBase):
    """Like ``nn.Embedding``: ``forward(ids)`` returns ``ids.shape + (embedding_dim,)``."""

    kind = "embedding"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._run(self._batch(input, None))

    def _batch(self, input: Any, offsets: Optional[torch.Tensor]) -> _Batch:
        error = check_ids(self.name, input, self.table.num_embeddings)
        if error is None and offsets is not None:
            error = f"table {self.name!r}: an embedding takes no offsets"
        if error is not None:
            return _Batch(torch.empty(0, dtype=torch.int64), (0,), error=error)
        return _Batch(input.reshape(-1).to(torch.int64), tuple(input.shape))

    def _assemble(self, rows: torch.Tensor, inverse: torch.Tensor, batch: _Batch) -> torch.Tensor:
        return F.embedding(inverse.view(batch.shape), rows)
