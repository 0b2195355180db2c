"""The response cache: in steady state a rank names a collective by a small integer.

A training loop submits the same collectives every step. Once every rank has agreed on a
request (same name, kind, dtype, shapes, ...), each rank gives it the same *bit*: an integer
assigned in the order responses are executed, which every rank sees identically (rank 0
sends each response to every rank, in one order). From then on a worker announces that
request as its bit and rank 0 answers with bits too, instead of full JSON requests: the
control plane carries a few integers per tensor, and rank 0 neither parses requests nor
re-serialises responses. Horovod's ``ResponseCache`` plays the same part
(``HOROVOD_CACHE_CAPACITY``); here the setting is ``HVPS_CACHE_CAPACITY`` (0 disables it).

An allgather's or alltoall's request also names this rank's rows, which may change every step; the
cache also gives its *form* (the request without them: ``form_of``) a bit of its own, for the fast
lane, which agrees on the form and exchanges the rows itself (``hvps/runtime/fast_lane.py``).
Bits are never reused, so a bit always means one request. When the cache is full the least
recently used request is evicted on every rank at the same point of the response sequence.
A worker may have announced a bit just before it learned of the eviction, so rank 0 keeps
evicted requests until every worker has reported (its *epoch*: responses recorded so far)
that it has seen the eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional, Union

from ..core.errors import HvpsError
from .negotiation import ADD_SET, ALLGATHER, ALLTOALL, JOIN, REMOVE_SET, SHUTDOWN, Request, Response, to_wire

#: responses that change the engine's state rather than move tensors: never cached
_UNCACHED = (JOIN, SHUTDOWN, ADD_SET, REMOVE_SET)
#: the kinds whose requests name this rank's rows (``Response.per_rank`` carries every rank's)
SIZED = (ALLGATHER, ALLTOALL)


def form_of(request: Request) -> tuple:
    """``request`` (an allgather or alltoall of one array) without this rank's rows (dim 0 of its shape, its
    splits): every other field, the shape's other dims, and how many it has."""
    r, shape = request, request.shapes[0]
    return (r.name, r.kind, r.dtype, shape[1:], len(shape), r.op, r.root, r.prescale, r.postscale, r.device,
            r.process_set, r.failure)


class ResponseCache:
    """Agreed requests by bit, kept alike on every rank by recording every executed response."""

    def __init__(self, capacity: int, size: int, rank: int = 0, children: Optional[dict] = None) -> None:
        self.capacity = capacity
        #: rank 0's children in the control-plane tree -> the ranks each speaks for (a star: every worker)
        self._children = children if children is not None else {r: range(r, r + 1) for r in range(1, size)}
        #: only rank 0 resolves other ranks' bits, so only it (with workers) keeps evicted requests
        self._keeps_evicted = rank == 0 and size > 1
        #: request -> bit, least recently used first
        self._bits: "OrderedDict[Request, int]" = OrderedDict()
        self._requests: dict[int, Request] = {}
        #: rank 0 only: evicted bit -> (request, epoch at eviction), until every worker is past it
        self._retired: dict[int, tuple] = {}
        #: worker rank -> the epoch it last reported
        self._worker_epochs: dict[int, int] = {}
        self._next_bit = 0
        #: the forms of sized requests (``form_of``) -> bit, least recently used first; by bit, a request of each
        self._forms: "OrderedDict[tuple, int]" = OrderedDict()
        self._form_requests: dict[int, Request] = {}
        #: responses recorded so far (the same sequence on every rank)
        self.epoch = 0

    def __len__(self) -> int:
        return len(self._bits)

    # -- kept alike on every rank ----------------------------------------------------
    def record(self, response: Response) -> None:
        """Note an executed response: its requests get (or refresh) their bits."""
        self.epoch += 1
        if self.capacity <= 0 or response.error or response.kind in _UNCACHED:
            return
        for request in response.requests:
            for old, bit in self._assign(self._bits, self._requests, request, request):
                if self._keeps_evicted:
                    self._retired[bit] = (old, self.epoch)
        if response.kind in SIZED and len(response.requests[0].shapes) == 1:  # its form too (bits never reused)
            self._assign(self._forms, self._form_requests, form_of(response.requests[0]), response.requests[0])

    def _assign(self, bits: OrderedDict, requests: dict, key, request: Request) -> list:
        """Give ``key`` the next bit in ``bits`` (``requests`` names ``request`` by it), or make it the most
        recently used; the ``(key, bit)`` pairs evicted past the capacity, least recently used first."""
        if key in bits:
            bits.move_to_end(key)
            return []
        bits[key] = self._next_bit
        requests[self._next_bit] = request
        self._next_bit += 1
        evicted = []
        while len(bits) > self.capacity:
            old, bit = bits.popitem(last=False)
            del requests[bit]
            evicted.append((old, bit))
        return evicted

    def form_bit_of(self, request: Request) -> Optional[int]:
        """The bit of ``request``'s form (an allgather or alltoall) on this rank now (None: not cached)."""
        return self._forms.get(form_of(request))

    def request_of_form(self, bit: int) -> Optional[Request]:
        """The request recorded when the form ``bit`` names got its bit (the one every rank records)."""
        return self._form_requests.get(bit)

    def bit_of(self, request: Request) -> Optional[int]:
        """The bit of ``request`` on this rank now (None: not cached)."""
        return self._bits.get(request)

    def request_of(self, bit: int) -> Optional[Request]:
        """The request ``bit`` names on this rank now (None: not held)."""
        return self._requests.get(bit)

    # -- a worker's side ---------------------------------------------------------------
    def announce(self, requests: Iterable[Request]) -> dict:
        """The message announcing ``requests``: a bit for each cached one, else its full form."""
        items: list[Union[int, dict]] = []
        for request in requests:
            bit = self._bits.get(request)
            items.append(to_wire(request) if bit is None else bit)
        return {"requests": items, "epoch": self.epoch}

    def decode_responses(self, wire: list) -> list:
        """Responses from rank 0's message, recording each (as rank 0 did when it encoded them)."""
        responses = []
        for item in wire:
            if "bits" in item:
                requests = [self._lookup(bit, 0) for bit in item["bits"]]
                response = Response(item["kind"], [r.name for r in requests], requests=requests,
                                    per_rank=item.get("per_rank", []))
            else:
                response = Response.from_wire(item)
            self.record(response)
            responses.append(response)
        return responses

    # -- rank 0's side -----------------------------------------------------------------
    def canonical(self, requests: list) -> list:
        """Rank 0's own requests, each replaced by the cached object equal to it: then every
        rank's submission of a cached request is one object, and matching needs no comparison."""
        if not self._bits:
            return requests
        return [self._requests.get(self._bits.get(r, -1), r) for r in requests]

    def resolve(self, rank: int, message: dict) -> list:
        """What a child announced, as ``(ranks, request)`` pairs (``ranks``: one rank, or a ``range`` of
        its subtree that announced the same), bits looked up; notes the epoch it reported."""
        epoch = message.get("epoch", 0)
        if not isinstance(epoch, int) or epoch > self.epoch:
            raise HvpsError(f"rank {rank} reported response-cache epoch {epoch!r}, but rank 0 has recorded "
                            f"only {self.epoch} responses: the ranks' caches disagree")
        pairs = [(rank, self._request(item, rank)) for item in message.get("requests", ())]
        subtree = self._children.get(rank, range(0))
        whole = message.get("whole")
        if whole:  # bits every rank of the child's subtree announced
            pairs += [(subtree if len(subtree) > 1 else rank, self._lookup(bit, rank)) for bit in whole]
        batch = message.get("batch")
        if batch:
            for item, spans in batch:
                request = self._request(item, rank)
                pairs += [(self._ranks(span, subtree, rank), request) for span in spans]
        self._worker_epochs[rank] = epoch
        self._prune()
        return pairs

    def _request(self, item: object, rank: int) -> Request:
        return Request.from_wire(item) if isinstance(item, dict) else self._lookup(item, rank)

    @staticmethod
    def _ranks(span: object, subtree: range, rank: int):
        """A span ``[low, high)`` of ``rank``'s ``subtree`` as one rank or a range; HvpsError outside it."""
        low, high = span if isinstance(span, list) and len(span) == 2 else (None, None)
        if type(low) is not int or type(high) is not int or not subtree.start <= low < high <= subtree.stop:
            raise HvpsError(f"rank {rank} relayed announcements of ranks {span!r}, outside its subtree "
                            f"{subtree.start}..{subtree.stop - 1}")
        return low if high - low == 1 else range(low, high)

    def encode_responses(self, responses: list) -> list:
        """The wire form of ``responses`` (bits where every request is cached), recording each."""
        wire = []
        for response in responses:
            bits = self._bits_of(response)
            if bits is None:
                wire.append(to_wire(response))
            else:
                item: dict = {"kind": response.kind, "bits": bits}
                if response.per_rank:
                    item["per_rank"] = response.per_rank
                wire.append(item)
            self.record(response)
        return wire

    def _bits_of(self, response: Response) -> Optional[list]:
        if self.capacity <= 0 or response.error or response.kind in _UNCACHED or not response.requests:
            return None
        bits = [self._bits.get(request) for request in response.requests]
        return None if None in bits else bits

    def _lookup(self, bit: object, rank: int) -> Request:
        if isinstance(bit, int) and not isinstance(bit, bool):
            request = self._requests.get(bit)
            if request is not None:
                return request
            if bit in self._retired:
                return self._retired[bit][0]
        raise HvpsError(f"rank {rank} named response-cache bit {bit!r}, which this rank's cache does not hold "
                        f"(epoch {self.epoch}): the ranks' caches disagree")

    def _prune(self) -> None:
        """Forget evicted requests that every worker has seen evicted."""
        if not self._retired:
            return
        oldest = min((self._worker_epochs.get(rank, 0) for rank in self._children), default=self.epoch)
        for bit in [b for b, (_, evicted_at) in self._retired.items() if evicted_at <= oldest]:
            del self._retired[bit]
