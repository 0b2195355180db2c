"""Coordinator logic: which collectives every rank has submitted, checked and fused.

Pure bookkeeping with no MPI in it: rank 0's engine feeds it the requests that
arrive from every rank and sends the responses it returns, in order, to all
ranks, so every rank executes the same collectives in the same order.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Optional

from ..core.dtypes import ITEMSIZE

#: kinds of request; "join" and "shutdown" are control requests.
ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, BARRIER, JOIN, SHUTDOWN = (
    "allreduce",
    "allgather",
    "broadcast",
    "alltoall",
    "reducescatter",
    "barrier",
    "join",
    "shutdown",
)
#: process-set bookkeeping, negotiated on the global set like a collective: the new set's id
#: travels in ``root`` and its ranks in ``splits``
ADD_SET, REMOVE_SET = "add_process_set", "remove_process_set"
#: the global process set's id
GLOBAL_SET = 0


@dataclass(frozen=True)
class Request:
    """What one rank announces about one collective it has submitted (small, picklable)."""

    name: str
    kind: str
    dtype: str = ""
    shapes: tuple = ()
    op: str = ""
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    #: alltoall: the rows this rank sends to each member; allgather: ``(rows,)`` of the ``out`` it writes into
    splits: tuple = ()
    #: where the data lives: "cpu" (numpy arrays, CPU tensors) or "cuda"
    device: str = "cpu"
    #: the process set the collective runs on (0: every rank)
    process_set: int = GLOBAL_SET
    #: set when this rank could not submit the collective (its arguments were refused here): why.
    #: The coordinator then fails it on every rank at once, with this reason.
    failure: str = ""

    @property
    def nbytes(self) -> int:
        return ITEMSIZE.get(self.dtype, 1) * sum(math.prod(s) for s in self.shapes)

    def signature(self) -> tuple:
        """The fields every rank must agree on; allgather and alltoall may differ in dim 0."""
        if self.kind in (ALLGATHER, ALLTOALL):
            return (self.kind, self.dtype, tuple(s[1:] for s in self.shapes), len(self.shapes[0]), self.device)
        if self.kind in (ADD_SET, REMOVE_SET):
            return (self.kind, self.root, self.splits)
        return (self.kind, self.dtype, self.shapes, self.op, self.root, self.prescale, self.postscale, self.device)

    @classmethod
    def from_wire(cls, data: dict) -> "Request":
        """Rebuild a request from its JSON form (lists back to tuples)."""
        data = dict(data)
        data["shapes"] = tuple(tuple(s) for s in data["shapes"])
        data["splits"] = tuple(data["splits"])
        return cls(**data)

    def describe(self) -> str:
        shapes = ", ".join(str(tuple(s)) for s in self.shapes)
        extra = f" root={self.root}" if self.kind == BROADCAST else ""
        if self.kind in (ADD_SET, REMOVE_SET):
            return f"{self.kind} id={self.root} ranks={list(self.splits)}"
        op = f" op={self.op}" if self.op else ""
        return f"{self.kind} {self.dtype} [{shapes}]{op}{extra} on {self.device}"


@dataclass
class Response:
    """One collective (or several fused allreduces) that all ranks now execute."""

    kind: str
    names: list
    error: str = ""
    #: per name: the request every rank agreed on (joined ranks read shapes from it)
    requests: list = field(default_factory=list)
    #: allgather: dim 0 of every rank; alltoall: the splits every rank sends
    per_rank: list = field(default_factory=list)
    #: join: the rank that joined last
    last_joined: int = -1
    #: shutdown: the ranks that asked to shut down (fewer than all: the others waited past the stall time)
    asked: list = field(default_factory=list)

    @classmethod
    def from_wire(cls, data: dict) -> "Response":
        """Rebuild a response from its JSON form."""
        data = dict(data)
        data["requests"] = [Request.from_wire(r) for r in data["requests"]]
        return cls(**data)


def to_wire(message) -> dict:
    """The JSON-ready form of a Request or Response (shallow: ``dataclasses.asdict`` deep-copies
    every shape tuple, which cost rank 0 a sixth of its engine thread at 161 tensors a step)."""
    wire = {f: getattr(message, f) for f in _FIELDS[type(message)]}
    if isinstance(message, Response):
        wire["requests"] = [to_wire(r) for r in message.requests]
    return wire


@dataclass
class _Pending:
    first_seen: float
    #: who submitted it -> the request: a rank, or a ``range`` of ranks that a relay reported together
    by_rank: dict
    #: submissions that complete it when no rank has joined (its set's size; 0: unknown set)
    needed: int = 0
    #: whether a rank sent a ``failure`` request for it
    failed: bool = False
    #: ranks that submitted it (a range counts each of its ranks)
    count: int = 0
    #: whether ``by_rank`` holds ranges
    grouped: bool = False
    #: whether the stall warning (Horovod's check time, before the shutdown time) was given
    warned: bool = False

    def add(self, who, request: Request) -> None:
        """Record ``request`` from ``who``: a rank, or a ``range`` of ranks."""
        if who not in self.by_rank:
            if type(who) is int:
                self.count += 1
            else:
                self.count += len(who)
                self.grouped = True
        self.by_rank[who] = request

    def ranks(self) -> dict:
        """``by_rank`` with every range spelled out, rank by rank."""
        if not self.grouped:
            return self.by_rank
        spelled: dict = {}
        for who, request in self.by_rank.items():
            spelled.update(dict.fromkeys(who, request) if isinstance(who, range) else {who: request})
        return spelled


class Coordinator:
    """Matches submissions across ``size`` ranks, detects mismatches and stalls, plans fusion."""

    def __init__(self, size: int, fusion_threshold: int, stall_seconds: float,
                 warn_seconds: Optional[float] = None) -> None:
        self.size = size
        self.fusion_threshold = fusion_threshold
        #: a collective short of submissions fails after this long
        self.stall_seconds = stall_seconds
        #: ... and is warned about (once) after this long, when it is shorter (Horovod's check and shutdown times)
        self.warn_seconds = warn_seconds if warn_seconds is not None and warn_seconds < stall_seconds else None
        self._first_look = self.stall_seconds if self.warn_seconds is None else self.warn_seconds
        self._table: dict[str, _Pending] = {}
        self._joined: list[int] = []
        self._shutdown: set[int] = set()
        #: when the first rank asked to shut down (the others have the stall time to follow)
        self._shutdown_since = 0.0
        #: names that failed on some rank before being submitted (a ``failure`` request): the error,
        #: and the members that have not submitted them yet (each gets the error when it does)
        self._failed: dict[str, tuple] = {}
        #: errors for late submissions of failed names, returned by the next poll
        self._late: list[Response] = []
        #: process set id -> its ranks (the global set, then those added since)
        self.sets: dict[int, tuple] = {GLOBAL_SET: tuple(range(size))}

    @property
    def busy(self) -> bool:
        """Whether anything awaits other ranks (so stall checks must keep running)."""
        return bool(self._table or self._joined or self._shutdown or self._late)

    def next_deadline(self) -> Optional[float]:
        """When the oldest pending collective, or the shutdown some ranks asked for, stalls; or None."""
        if not self._table and not self._shutdown:  # after every cycle of a synchronous call: nothing pending
            return None
        deadlines = [p.first_seen + (self.stall_seconds if p.warned else self._first_look) for p in self._table.values()]
        if self._shutdown:
            deadlines.append(self._shutdown_since + self.stall_seconds)
        return min(deadlines, default=None)

    def submit(self, rank, requests: list, now: float) -> None:
        """Record requests that ``rank`` (a rank, or a ``range`` of ranks that all announced the same,
        from a relay of the control-plane tree) announced at time ``now``."""
        self.submit_pairs([(rank, request) for request in requests], now)

    def submit_pairs(self, pairs: list, now: float) -> None:
        """Record ``(ranks, request)`` pairs announced at ``now``: ``ranks`` as in ``submit``."""
        failed = self._failed
        for who, req in pairs:
            if req.kind == JOIN or req.kind == SHUTDOWN or req.failure or req.name in failed:
                for rank in who if isinstance(who, range) else (who,):
                    self._submit_special(rank, req, now)
                continue
            self._pending(req, now).add(who, req)

    def _pending(self, req: Request, now: float) -> _Pending:
        """The table's entry for ``req``'s name, made (first seen ``now``) if there is none."""
        pending = self._table.get(req.name)
        if pending is None:
            pending = self._table[req.name] = _Pending(now, {}, len(self.sets.get(req.process_set, ())))
        return pending

    def _submit_special(self, rank: int, req: Request, now: float) -> None:
        """A join, a shutdown, a failure (``abandon``) or a submission of a name that failed elsewhere."""
        if req.kind == JOIN:
            if rank not in self._joined:
                self._joined.append(rank)
            return
        if req.kind == SHUTDOWN:
            if not self._shutdown:
                self._shutdown_since = now
            self._shutdown.add(rank)
            return
        failed = self._failed.get(req.name)
        if failed is not None and rank in failed[1]:
            self._late_submission(req, rank, failed)
            return
        pending = self._pending(req, now)
        pending.add(rank, req)
        pending.failed = pending.failed or bool(req.failure)

    def _late_submission(self, req: Request, rank: int, failed: tuple) -> None:
        """``rank`` submitted a collective that failed elsewhere before: it gets the same error now."""
        error, waiting = failed
        waiting.discard(rank)
        if not waiting:
            del self._failed[req.name]
        if not req.failure:
            self._late.append(Response(req.kind, [req.name], error=error))

    def poll(self, now: float) -> list:
        """Responses that are ready now, in the order all ranks must execute them."""
        ready: list[Response] = self._late
        self._late = []
        joined = set(self._joined)
        #: ranks that were waiting in a collective reported as stalled in this poll
        released: set = set()
        #: without joined or shut-down ranks or a stall, a collective short of submissions needs no look
        settled = not joined and not self._shutdown
        for name in list(self._table):
            pending = self._table[name]
            if (settled and not released and not pending.failed and pending.count < pending.needed
                    and now - pending.first_seen < (self.stall_seconds if pending.warned else self._first_look)):
                continue
            set_id = next(iter(pending.by_rank.values())).process_set
            members = self.sets.get(set_id)
            if members is None:
                del self._table[name]
                ready.append(self._unknown_set(name, pending, set_id))
                continue
            if pending.failed:
                del self._table[name]
                ready.append(self._failed_on_some(name, pending, members))
                released.update(r for r, q in pending.ranks().items() if not q.failure)
                continue
            # every rank of the job submitted it (each rank submits a name once): no sets to build
            everyone = set_id == GLOBAL_SET and not joined and pending.count == self.size
            # join() only excuses ranks from collectives on the global set
            present = set() if everyone else set(pending.ranks()) | (joined if set_id == GLOBAL_SET else set())
            if not everyone and not present.issuperset(members):
                left = (set(members) - present) & self._shutdown
                if left:  # a rank that asked to shut down submits nothing more: fail now, not at the stall
                    ready.append(self._left(name, pending, left))
                    del self._table[name]
                    released.update(pending.ranks())
                elif (set(members) - present) & released:
                    pending.first_seen = now
                elif now - pending.first_seen >= self.stall_seconds:
                    ready.append(self._stalled(name, pending, present, members))
                    del self._table[name]
                    released.update(pending.ranks())
                elif (self.warn_seconds is not None and not pending.warned
                      and now - pending.first_seen >= self.warn_seconds):
                    pending.warned = True
                    kind = next(iter(pending.by_rank.values())).kind
                    logging.getLogger("hvps").warning(
                        "hvps stall warning: %s '%s' was submitted by ranks %s but ranks %s have not submitted it for "
                        "%g s; it fails after %g s (HVPS_STALL_SHUTDOWN_TIME_SECONDS)", kind, name,
                        sorted(pending.ranks()), sorted(set(members) - present), self.warn_seconds, self.stall_seconds)
                continue
            del self._table[name]
            response = self._check(name, pending, joined if set_id == GLOBAL_SET else set(), members)
            self._track_sets(response)
            ready.append(response)
        if released:
            self._restart_clocks(released, joined, now)
        if len(self._joined) == self.size and not self._table:
            ready.append(Response(JOIN, ["join"], last_joined=self._joined[-1]))
            self._joined.clear()
        if self._shutdown and (len(self._shutdown) == self.size or now - self._shutdown_since >= self.stall_seconds):
            ready.append(self._shut_down(now))
        return self._fuse(ready)

    def _restart_clocks(self, released: set, joined: set, now: float) -> None:
        """Give every collective still waiting for a ``released`` rank a full stall window from now.

        Those ranks were blocked in a collective that has just been reported as stalled, so they
        could not submit anything else; without this, a rank held up for one stall window arrives
        just too late for the next collective of the others, and the stall passes back and forth.
        """
        for pending in self._table.values():
            set_id = next(iter(pending.by_rank.values())).process_set
            members = set(self.sets.get(set_id, ()))
            present = set(pending.ranks()) | (joined if set_id == GLOBAL_SET else set())
            if (members - present) & released:
                pending.first_seen = now

    def _track_sets(self, response: Response) -> None:
        """Apply an agreed process-set change, so requests for the new set are matched from now on."""
        if response.error or response.kind not in (ADD_SET, REMOVE_SET):
            return
        req = response.requests[0]
        if response.kind == ADD_SET:
            self.sets[req.root] = tuple(req.splits)
        else:
            self.sets.pop(req.root, None)

    def _unknown_set(self, name: str, pending: _Pending, set_id: int) -> Response:
        kind = next(iter(pending.by_rank.values())).kind
        return Response(kind, [name], error=(
            f"hvps: {kind} '{name}' names process set {set_id}, which is not registered (removed, or never added "
            "on every rank)"))

    def _shut_down(self, now: float) -> Response:
        """Every rank's engine stops: all asked to, or the first asked ``stall_seconds`` ago. Then, as in
        Horovod (one rank's shutdown ends the job's collectives), the others stop too, each collective they
        submit from then on failing at once, and every rank finalizes normally: a rank that is late to shut
        down (still evaluating, saving, or sleeping) is no failure, so the job is not aborted for it."""
        asked, self._shutdown = sorted(self._shutdown), set()
        if len(asked) < self.size:
            late = sorted(set(range(self.size)) - set(asked))
            logging.getLogger("hvps").warning(
                "hvps: ranks %s shut hvps down %.0f s ago and ranks %s have not (%s): ending hvps on every rank "
                "now, as Horovod does; their next collective fails, and each rank's exit waits for the others in "
                "MPI_Finalize", asked, now - self._shutdown_since, late, self._stall_variable)
        return Response(SHUTDOWN, ["shutdown"], asked=asked)

    def _left(self, name: str, pending: _Pending, left: set) -> Response:
        kind = next(iter(pending.by_rank.values())).kind
        return Response(kind, [name], error=(
            f"hvps: {kind} '{name}' was submitted by ranks {sorted(pending.ranks())} but ranks {sorted(left)} shut "
            "hvps down (hvps.shutdown(), or the script ended, e.g. sys.exit) and will never submit it. Every rank "
            "must submit the same collectives; check for rank-dependent control flow or an early exit"))

    def _failed_on_some(self, name: str, pending: _Pending, members: tuple) -> Response:
        """A collective some ranks could not submit: the error every rank gets at once, naming them
        and their reason; members that have not submitted it yet get the same when they do."""
        failures = {r: q for r, q in sorted(pending.ranks().items()) if q.failure}
        reasons = "; ".join(f"rank {r}: {q.failure}" for r, q in failures.items())
        kind = next(iter(failures.values())).kind
        error = (f"hvps: {kind} '{name}' failed on ranks {sorted(failures)} before they could submit it "
                 f"({reasons}); it fails on every rank, so that all of them go on in step")
        waiting = set(members) - set(pending.ranks())
        if waiting:
            self._failed[name] = (error, waiting)
        return Response(kind, [name], error=error)

    @property
    def _stall_variable(self) -> str:
        return "HVPS_STALL_CHECK_TIME_SECONDS" if self.warn_seconds is None else "HVPS_STALL_SHUTDOWN_TIME_SECONDS"

    def _stalled(self, name: str, pending: _Pending, present: set, members: tuple) -> Response:
        missing = sorted(set(members) - present)
        submitted = sorted(pending.ranks())
        kind = next(iter(pending.by_rank.values())).kind
        return Response(
            kind,
            [name],
            error=(
                f"hvps stall: {kind} '{name}' was submitted by ranks {submitted} but ranks {missing} "
                f"did not submit it within {self.stall_seconds:g} s ({self._stall_variable}). "
                "Every rank must submit the same collectives; check for rank-dependent control flow "
                "or a rank that died or stopped early."
            ),
        )

    def _check(self, name: str, pending: _Pending, joined: set, members: tuple) -> Response:
        reference = next(iter(pending.by_rank.values()))
        groups: dict[tuple, list[int]] = {}
        # requests named by a response-cache bit are one object on every rank: equal by construction
        uniform = all(request is reference for request in pending.by_rank.values())
        by_rank = pending.by_rank if uniform and reference.kind not in (ALLGATHER, ALLTOALL) else pending.ranks()
        if not uniform:
            for rank in sorted(by_rank):
                groups.setdefault(by_rank[rank].signature(), []).append(rank)
        if len(groups) > 1:
            detail = "; ".join(
                f"ranks {ranks}: {by_rank[ranks[0]].describe()}" for ranks in groups.values()
            )
            return Response(
                reference.kind,
                [name],
                error=f"hvps mismatch: ranks submitted '{name}' with different arguments: {detail}",
            )
        if joined and reference.kind != ALLREDUCE:
            return Response(
                reference.kind,
                [name],
                error=(
                    f"hvps: {reference.kind} '{name}' cannot run while ranks {sorted(joined)} have "
                    "called join(); only allreduce continues after join"
                ),
            )
        per_rank: list = []  # in the set's rank order
        if reference.kind == ALLGATHER:
            per_rank = [by_rank[r].shapes[0][0] for r in members]
            rows = sum(per_rank)
            short = {r: by_rank[r].splits[0] for r in members if by_rank[r].splits and by_rank[r].splits[0] != rows}
            if short:  # an ``out`` of the wrong size (its rows travel in ``splits``)
                return Response(ALLGATHER, [name], error=(
                    f"hvps: allgather '{name}': ranks {sorted(short)} gave an output of "
                    f"{sorted(set(short.values()))} rows, but the members' rows add up to {rows} ({per_rank} by rank)"))
        elif reference.kind == ALLTOALL:
            per_rank = [list(by_rank[r].splits) for r in members]
        return Response(reference.kind, [name], requests=[reference], per_rank=per_rank)

    def _fuse(self, responses: list) -> list:
        """Merge consecutive compatible allreduces up to the fusion threshold."""
        fused: list[Response] = []
        size_of_last = 0
        for resp in responses:
            last = fused[-1] if fused else None
            if (
                last is not None
                and self.fusion_threshold > 0
                and resp.kind == ALLREDUCE == last.kind
                and not resp.error
                and not last.error
                and _fusion_key(resp.requests[0]) == _fusion_key(last.requests[0])
                and size_of_last + resp.requests[0].nbytes <= self.fusion_threshold
            ):
                last.names.extend(resp.names)
                last.requests.extend(resp.requests)
                size_of_last += resp.requests[0].nbytes
                continue
            fused.append(resp)
            size_of_last = resp.requests[0].nbytes if resp.requests else 0
        return fused


_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in (Request, Response)}


def _fusion_key(req: Request) -> tuple:
    # Adasum combines each tensor with coefficients of its own: never fused (the name keeps keys apart)
    return (req.dtype, req.op, req.prescale, req.postscale, req.device, req.process_set,
            req.name if req.op == "adasum" else "")
