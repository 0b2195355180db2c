"""The background thread that owns every data-plane call.

Each rank queues collectives locally; the thread announces them to rank 0's
coordinator, which answers with the responses every rank executes in the same
order (see ``negotiation.py``). Waiting is done by sleeping between
non-blocking probes, never by spinning in a blocking MPI call, so the thread
costs the training loop no CPU while it waits for other ranks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Optional

from mpi4py import MPI

from .collectives import EXECUTORS, Context, Entry
from .errors import HvpsError
from .handle import Handle
from .negotiation import JOIN, SHUTDOWN, Coordinator, Request

log = logging.getLogger("hvps")

_TAG_REQUESTS, _TAG_RESPONSES = 11, 12
_IDLE_POLL_SECONDS = 0.02
#: while waiting on other ranks, each quiet cycle doubles the sleep, up to this many cycles
_MAX_BACKOFF_CYCLES = 8


class Engine:
    """Queues collectives, negotiates them with the other ranks and runs them on a backend."""

    def __init__(self, comm: MPI.Comm, backend, settings) -> None:
        self.control = comm.Dup()
        self.rank, self.size = self.control.Get_rank(), self.control.Get_size()
        self.settings = settings
        self.backend = backend
        self.context = Context(backend, self.rank, self.size)
        self.coordinator = (
            Coordinator(self.size, settings.fusion_threshold, settings.stall_check_seconds)
            if self.rank == 0
            else None
        )
        self._cv = threading.Condition()
        self._queue: deque = deque()
        self._pending: dict[str, Entry] = {}
        self._joined = False
        self._sends: list = []
        self._failure: Optional[BaseException] = None
        self._stopped = threading.Event()
        self._quiet_cycles = 0
        self._thread = threading.Thread(target=self._run, name="hvps-engine", daemon=True)
        self._thread.start()

    # -- called from user threads -------------------------------------------------
    def submit(self, entry: Entry) -> Handle:
        """Queue ``entry`` and return its handle."""
        with self._cv:
            if self._failure is not None:
                raise HvpsError(f"the hvps engine stopped: {self._failure}") from self._failure
            if self._stopped.is_set():
                raise HvpsError("hvps was shut down: call hvps.init() again")
            name = entry.request.name
            if name in self._pending or any(e.request.name == name for e in self._queue):
                raise HvpsError(
                    f"a collective named '{name}' is already in flight on rank {self.rank}; "
                    "names must be unique among outstanding operations"
                )
            entry.handle = entry.handle or Handle(name, (entry.inputs, entry.outputs))
            self._queue.append(entry)
            self._cv.notify()
        return entry.handle

    def shutdown(self) -> None:
        """Agree with the other ranks to stop, then stop the thread."""
        if self._stopped.is_set() or self._failure is not None:
            return
        handle = self.submit(Entry(Request("shutdown", SHUTDOWN), []))
        try:
            handle.wait(timeout=self.settings.stall_check_seconds + 5)
        except HvpsError as exc:
            log.warning("hvps shutdown did not complete on all ranks: %s", exc)
        self._stopped.set()
        with self._cv:
            self._cv.notify()
        self._thread.join(timeout=5)
        self._fail_all(HvpsError("hvps was shut down before this collective completed"))
        for request in self._sends:
            request.Cancel()
        self.control.Free()

    # -- the engine thread ----------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                new = self._next_batch()
                active = self._coordinate(new) if self.rank == 0 else self._work(new)
                self._quiet_cycles = 0 if (active or new) else self._quiet_cycles + 1
                if self._sends:
                    self._sends = [r for r in self._sends if not r.Test()]
        except BaseException as exc:  # noqa: BLE001 - surfaced on every handle
            log.exception("hvps engine thread failed")
            with self._cv:
                self._failure = exc
            self._fail_all(HvpsError(f"the hvps engine failed: {exc!r}"))

    def _busy(self) -> bool:
        return bool(self._pending or self._joined or (self.coordinator is not None and self.coordinator.busy))

    def _sleep_seconds(self) -> float:
        """One cycle after activity, doubling while quiet; an idle rank only checks now and then."""
        if not self._busy():
            return _IDLE_POLL_SECONDS
        cycle = self.settings.cycle_time_ms / 1000.0
        return min(cycle * (1 << min(self._quiet_cycles, 30)), cycle * _MAX_BACKOFF_CYCLES)

    def _next_batch(self) -> list:
        """Sleep until local work arrives or the cycle passes, then take the queue."""
        with self._cv:
            if not self._queue:
                self._cv.wait(self._sleep_seconds())
            new = list(self._queue)
            self._queue.clear()
        for entry in new:
            if entry.request.kind == JOIN:
                self._joined = True
            self._pending[entry.request.name] = entry
        return new

    def _coordinate(self, new: list) -> bool:
        """Rank 0: collect announcements, answer with what is ready, run it. Returns whether anything moved."""
        now = time.monotonic()
        self.coordinator.submit(0, [e.request for e in new], now)
        status = MPI.Status()
        received = False
        while self.control.iprobe(source=MPI.ANY_SOURCE, tag=_TAG_REQUESTS, status=status):
            source = status.Get_source()
            self.coordinator.submit(source, self.control.recv(source=source, tag=_TAG_REQUESTS), now)
            received = True
        responses = self.coordinator.poll(time.monotonic())
        if responses:
            for worker in range(1, self.size):
                self._sends.append(self.control.isend(responses, dest=worker, tag=_TAG_RESPONSES))
            self._execute(responses)
        return received or bool(responses)

    def _work(self, new: list) -> bool:
        """Other ranks: announce new collectives, run what rank 0 answered. Returns whether anything moved."""
        if new:
            self._sends.append(self.control.isend([e.request for e in new], dest=0, tag=_TAG_REQUESTS))
        executed = False
        while self.control.iprobe(source=0, tag=_TAG_RESPONSES):
            self._execute(self.control.recv(source=0, tag=_TAG_RESPONSES))
            executed = True
        return executed

    def _execute(self, responses: list) -> None:
        for response in responses:
            entries = [self._pending.pop(name, None) for name in response.names]
            if response.error:
                self._report_error(response, entries)
            elif response.kind == JOIN:
                self._joined = False
                for entry in entries:
                    if entry is not None:
                        entry.handle.set_result(response.last_joined)
            elif response.kind == SHUTDOWN:
                for entry in entries:
                    if entry is not None:
                        entry.handle.set_result(None)
            else:
                self._run_collective(response, entries)

    def _run_collective(self, response, entries: list) -> None:
        try:
            results = EXECUTORS[response.kind](self.context, response, entries)
        except Exception as exc:  # noqa: BLE001 - one failed collective must not stop the engine
            for entry in entries:
                if entry is not None:
                    entry.handle.set_error(exc)
            return
        for entry, result in zip(entries, results):
            if entry is not None:
                entry.handle.set_result(result)

    def _report_error(self, response, entries: list) -> None:
        mine = [e for e in entries if e is not None]
        if not mine:
            log.warning("rank %d: %s", self.rank, response.error)
        for entry in mine:
            entry.handle.set_error(HvpsError(response.error))

    def _fail_all(self, error: HvpsError) -> None:
        with self._cv:
            entries = list(self._pending.values()) + list(self._queue)
            self._pending.clear()
            self._queue.clear()
        for entry in entries:
            if not entry.handle.poll():
                entry.handle.set_error(error)
