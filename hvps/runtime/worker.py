"""A worker rank's side of the negotiation (every rank but 0): it announces its requests to its parent in the
control-plane tree (``control/tree.py``), passes rank 0's responses on to its children and hands them to its
executor. A rank between rank 0 and others is a relay: it merges its subtree's announcements before they go
up (``control/relay.py``)."""

from __future__ import annotations

import time
from typing import Callable, Optional, Protocol

from ..control.negotiation import ADD_SET, GLOBAL_SET
from ..control.relay import RelayBuffer
from .engine_status import NegotiationClock

#: a relay of the control-plane tree holds a request some ranks of its subtree have not announced for up to
#: this many cycles, so that the whole block's announcements go up together (control/relay.py)
RELAY_HOLD_CYCLES = 10


class WorkerPlane(Protocol):
    """What a worker's role needs of the control plane (``ControlPlane``)."""

    parent: Optional[int]
    children: list
    position: object

    def send(self, rank: int, message: dict) -> None: ...

    def send_down(self, message: dict) -> None: ...


class WorkerNegotiation:
    """A worker's negotiation cycle: announce up (merged with the subtree's, on a relay), pass rank 0's
    responses down, execute them."""

    def __init__(self, rank: int, control: WorkerPlane, cache, announcements: Callable[[], list],
                 execute: Callable[[list], None], left_alone: Callable[[list], None],
                 apply_tuning: Callable[[dict], None], clock: NegotiationClock, relay_hold_s: float) -> None:
        """``cache``: the response cache (``ResponseCache``); ``announcements()``: this rank's requests due now;
        ``execute(responses)``: the executor's; ``left_alone(closed)``: what to do about peers that said goodbye
        alone; ``apply_tuning(tuning)``: put the settings rank 0's autotuner sent in force; ``relay_hold_s``: how
        long a relay holds a request part of its subtree has not announced."""
        self.rank = rank
        self._control = control
        self._cache = cache
        self._announcements = announcements
        self._execute = execute
        self._left_alone = left_alone
        self._apply_tuning = apply_tuning
        self._clock = clock
        tree = control.position
        #: process set id -> how many of its ranks are in this rank's subtree (what a relay waits for)
        self._members_below: dict = {}
        #: a rank between rank 0 and others merges its subtree's announcements (control-plane tree)
        self.relay = RelayBuffer(tree.subtree, tree.blocks, relay_hold_s, self.announcers) if tree.is_relay else None
        #: a relay passes on what it hears at once, whether or not anything of its own is in flight
        self.listens_always = self.relay is not None

    def deadline(self) -> Optional[float]:
        """When the relay must send up what it holds, or None."""
        return self.relay.deadline() if self.relay else None

    def busy(self) -> bool:
        """Whether the relay holds announcements to send up."""
        return bool(self.relay)

    def cycle(self, messages: list, closed: list) -> None:
        """One turn on ``messages`` (``(rank, message)`` pairs the control plane read) and the ranks whose
        connections ``closed``: announce, relay, pass responses down, execute."""
        mark = self._clock.start()
        due = self._announcements()
        parent, relay = self._control.parent, self.relay
        if due and relay is None:
            self._control.send(parent, self._cache.announce(due))
        elif due:
            relay.add(self.rank, self._cache.announce(due), time.monotonic())
        responses: list = []
        for source, message in messages:
            if source != parent:  # a child's announcements, to merge and pass up
                relay.add(source, message, time.monotonic())
                continue
            if self._control.children:
                self._control.send_down(message)
            responses += self._cache.decode_responses(message["responses"])
            if "tuning" in message:
                self._apply_tuning(message["tuning"])
        upward = relay.take(time.monotonic(), self._cache.epoch) if relay is not None else None
        if upward is not None:
            self._control.send(parent, upward)
        self._clock.stop(mark)
        self._execute(responses)
        self._left_alone(closed)

    def announcers(self, bit: int) -> int:
        """How many ranks of this relay's subtree announce the request ``bit`` names: its process set's."""
        request = self._cache.request_of(bit)
        subtree = self._control.position.subtree
        if request is None or request.process_set == GLOBAL_SET:
            return len(subtree)
        return self._members_below.get(request.process_set, len(subtree))

    def set_changed(self, response) -> None:
        """An agreed process set was added or removed (``response``): count its ranks in this subtree."""
        req = response.requests[0]
        if response.kind == ADD_SET:
            self._members_below[req.root] = sum(rank in self._control.position.subtree for rank in req.splits)
        else:
            self._members_below.pop(req.root, None)
