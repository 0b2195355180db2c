"""hvpsrun's elastic mode: the driver that keeps a job running while hosts come and go.

Horovod's driver semantics (``horovod/runner/elastic/driver.py``, ``docs/elastic.rst``), on hvps's
rendezvous (:mod:`hvps.control.membership`):

- the hosts come from the discovery script, polled every ``--discovery-interval`` seconds, or from
  ``-H`` (fault tolerance without scaling); a slot is a worker id ``host:index``;
- every change of membership publishes a new round: the oldest hosts keep the lowest ranks, at most
  ``--max-np`` slots, and rank 0 alone is notified of host changes (its next ``commit()``
  interrupts every rank at once); a worker of a removed slot leaves with status 0 when it
  re-initializes;
- a worker that fails (non-zero exit, a signal, a lost ssh connection) is seen at once through its
  process; its whole host is blacklisted (for good, or for a cool-down doubling per failure), and
  the survivors, whose collectives fail on the closed connections, join the next round;
- a worker that exits with status 0 has finished: its slot is never refilled. While others still
  train (a worker deleted with status 0, Horovod issue 3852) they go on without it;
- the job fails, with a one-line reason and a non-zero exit, when a worker's loop reset
  ``--resets-without-commit`` times in a row (default 8) without completing a commit, on ``--reset-limit``
  resets, when every
  host is blacklisted for good, or after ``--elastic-timeout`` seconds below ``--min-np``; it ends
  with status 0 when every worker has finished.
"""

from __future__ import annotations

import itertools
import queue
import signal
import sys
import threading
import time
from typing import Callable, Mapping, Optional, Sequence

from ..control import membership
from ..control.membership import Slot
from . import hosts as hostlib
from .discovery import Blacklist, Discovery, DiscoveryScript, FixedHosts
from .elastic_settings import ElasticSettings
from .errors import LaunchError
from . import gloo_run
from .gloo_run import GlooJob, Plan, assign_slots, signal_group, status_text

#: seconds between two looks at the deadlines while nothing happens
TICK_SECONDS = 0.1
#: seconds after a worker finished before the others, still training, go on without it
DEPART_SECONDS = 2.0
#: seconds after the first report of a failed collective (with no worker exited) before the members that
#: did not report are taken for stopped or hung and ended
REPORT_GRACE_SECONDS = 3.0


def assign(hosts: Sequence[hostlib.Host], finished: set, max_np: Optional[int]) -> dict:
    """A round's slots, {worker id: Slot}: ``hosts`` in age order (oldest first), each host's slots
    ``host:0``, ``host:1``, ... except those whose worker finished, at most ``max_np`` in all."""
    chosen: list = []  # (host, [worker ids])
    room = float("inf") if max_np is None else max_np
    for host in hosts:
        ids = [f"{host.name}:{i}" for i in range(host.slots) if f"{host.name}:{i}" not in finished][:int(
            min(room, host.slots))]
        if ids:
            chosen.append((host.name, ids))
            room -= len(ids)
    total = sum(len(ids) for _, ids in chosen)
    slots = assign_slots([hostlib.Host(name, len(ids)) for name, ids in chosen], total) if total else []
    workers = [worker for _, ids in chosen for worker in ids]
    return dict(zip(workers, slots))


class Failed(Exception):
    """The job cannot go on; the message is the one-line reason."""


class ElasticJob(GlooJob):
    """The elastic driver: workers, rounds, discovery, blacklist."""

    def __init__(self, plan: Plan, env: Mapping[str, str], clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(plan, env)
        self.settings = ElasticSettings(**{**plan.elastic, "cooldown": tuple(plan.elastic["cooldown"])
                                           if plan.elastic.get("cooldown") else None})
        self.clock = clock
        source = (DiscoveryScript(self.settings.discovery_script, self.settings.slots_per_host)
                  if self.settings.discovery_script else FixedHosts(plan.host_list()))
        self.discovery = Discovery(source)
        self.blacklist = Blacklist(self.settings.cooldown)
        self.events: queue.Queue = queue.Queue()
        self.running: dict = {}  # worker id -> Popen
        self.every: list = []  # every Popen started (ended at the end)
        self.finished: set = set()  # worker ids that exited 0 as members of the latest round
        self.members: dict = {}  # the latest round's {worker id: Slot}
        self.round = 0
        self.available: list = []  # the hosts discovered last, blacklisted ones left out
        self.age: dict = {}  # host -> when first seen (oldest hosts keep the lowest ranks)
        self.short_since: Optional[float] = None  # below --min-np since then
        self.pending_notice = 0  # the host-change kind that the next round brings
        self._stop = threading.Event()
        self._ages = itertools.count()
        self.departed: Optional[float] = None  # when a member finished while others still trained
        self.first_report: Optional[float] = None  # when a member first reported this round's failure

    # -- the job ----------------------------------------------------------------------------------
    def run(self) -> int:
        store = self._open_rendezvous(self.plan.host_list())
        self.store = store
        self.key = bytes.fromhex(self.secret)
        threading.Thread(target=self._discover, daemon=True).start()
        self.short_since = self.clock()
        try:
            return self._loop()
        except Failed as failure:
            self._log(f"error: {failure}")
            return 1
        finally:
            self._stop.set()
            self._end_all()
            for pump in self.pumps:
                pump.join(timeout=2.0)
            del store

    def _processes(self) -> list:
        return list(self.every)

    def _loop(self) -> int:
        while True:
            if self._stop_signal is not None:
                self._log(f"got signal {self._stop_signal}; ending the job's {len(self.running)} workers")
                return 128 + self._stop_signal
            try:
                event = self.events.get(timeout=TICK_SECONDS)
            except queue.Empty:
                event = ("tick",)
            if event[0] == "hosts":
                self._on_hosts(event[1])
            elif event[0] == "exit":
                self._on_exit(event[1], event[2])
                if not self.running and self.members and all(w in self.finished for w in self.members):
                    self._log(f"all workers finished; the job ran {self.round} membership(s)")
                    return 0
            elif event[0] == "error":
                raise Failed(str(event[1]))
            if self.round == 0 or self.short_since is not None:
                self._next_round()
            self._check_departed()
            self._check_reports()
            self._check_deadline()

    def _discover(self) -> None:
        while not self._stop.is_set():
            try:
                hosts = self.discovery.find()
            except LaunchError as exc:
                self.events.put(("error", exc))
                return
            if hosts is not None:
                self.events.put(("hosts", hosts))
            self._stop.wait(self.settings.discovery_interval)

    # -- events -----------------------------------------------------------------------------------
    def _on_hosts(self, hosts: list) -> None:
        for host in hosts:  # first seen first; hosts seen together keep the script's order
            self.age.setdefault(host.name, next(self._ages))
        self.available = sorted((h for h in hosts if not self.blacklist.blocked(h.name)),
                                key=lambda h: (self.age[h.name], h.name))
        training = {w for w in self.members if w not in self.finished}
        if self.round and assign(self.available, self.finished, self.settings.max_np).keys() != training:
            self._next_round(host_change=True)

    def _on_exit(self, worker: str, status: int) -> None:
        self.running.pop(worker, None)
        if worker not in self.members:
            return  # a worker of a removed slot leaving
        host = self.members[worker].host
        reason = membership.gave_up(self.store, self.key, worker) if status else None
        if reason is not None:
            raise Failed(f"worker {worker} (rank {self.members[worker].rank}): {reason}")
        if status == 0:  # finished; the others normally follow within moments
            self.finished.add(worker)
            self.departed = self.departed or self.clock()
            return
        delay = self.blacklist.add(host)
        self.age.pop(host, None)  # back from the blacklist it is the newest host
        self.available = [h for h in self.available if h.name != host]
        until = "for good" if delay == float("inf") else f"for {delay:.0f} s"
        self._log(f"worker {worker} (rank {self.members[worker].rank}) {status_text(status)}; blacklisting host "
                  f"{host} {until}")
        self._next_round()

    # -- rounds -----------------------------------------------------------------------------------
    def _next_round(self, host_change: bool = False) -> None:
        """Publish the next round when enough slots are available; else start (or keep) waiting."""
        slots = assign(self.available, self.finished, self.settings.max_np)
        if host_change and self.round:
            old = {w for w in self.members if w in self.running}
            kind = (1 if old - slots.keys() else 0) | (2 if slots.keys() - old else 0)
            self.pending_notice |= kind
            membership.publish_notice(self.store, self.key, self.round + 1, time.time(), self.pending_notice or 3)
        if len(slots) < self.settings.min_np:
            if self.short_since is None:
                self.short_since = self.clock()
                if self.round:
                    self._log(f"{len(slots)} slot(s) available, below --min-np {self.settings.min_np}; waiting up to "
                              f"{self.settings.elastic_timeout:g} s (--elastic-timeout) for more hosts")
            return
        if self.round and self.settings.reset_limit is not None and self.round > self.settings.reset_limit:
            raise Failed(f"the job reset {self.round} times, more than --reset-limit {self.settings.reset_limit}")
        self.short_since = None
        self.round += 1
        self.members, self.pending_notice = slots, 0
        membership.publish_round(self.store, self.key, self.round, slots)
        sizes = ", ".join(f"{w}=rank {s.rank}" for w, s in slots.items())
        self._log(f"membership {self.round}: {len(slots)} worker(s) ({sizes})")
        for worker, slot in slots.items():
            if worker not in self.running:
                self._start_worker(worker, slot)

    def _check_blacklisted(self) -> None:
        names = set(self._discovered_names())
        if names and all(self.blacklist.permanent(n) for n in names):
            raise Failed(f"every host is blacklisted ({', '.join(sorted(names))}): a worker failed on each; the "
                         "job cannot go on (--blacklist-cooldown-range lets hosts come back)")

    def _discovered_names(self) -> list:
        return [h.name for h in (self.discovery.last or [])]

    def _check_departed(self) -> None:
        """Members that finished while the others still train after DEPART_SECONDS (a worker deleted with
        status 0, Horovod issue 3852): the others go on without them."""
        if self.departed is None or self.clock() - self.departed < DEPART_SECONDS:
            return
        self.departed = None
        if any(w in self.running for w in self.members):
            gone = sorted(w for w in self.members if w in self.finished)
            self._log(f"worker(s) {', '.join(gone)} finished while the others still train; they go on without them")
            self._next_round()

    def _check_reports(self) -> None:
        """Members that reported a failed collective while nobody exited (an error on every rank, or a
        stopped peer caught by the stall timeout): the next round, without those that did not report."""
        training = [w for w in self.members if w in self.running]
        if not self.round or self.short_since is not None or not training or self.departed is not None:
            return  # (a member that finished: _check_departed starts the next round)
        reports = membership.failure_reports(self.store, self.key, self.round, training)
        if not reports:
            self.first_report = None
            return
        self.first_report = self.first_report or self.clock()
        silent = [w for w in training if w not in reports]
        if silent and self.clock() - self.first_report < REPORT_GRACE_SECONDS:
            return
        self.first_report = None
        if not silent:
            self._log(f"every worker of membership {self.round} reports a failed collective; starting the next "
                      f"(the first report: {next(iter(reports.values()))[:300]})")
            self._next_round()
            return
        for worker in silent:  # its exit blacklists its host and starts the next round
            self._log(f"worker {worker} (rank {self.members[worker].rank}) did not report the failed collective that "
                      f"the others did within {REPORT_GRACE_SECONDS:g} s (stopped or hung); ending it")
            signal_group(self.running[worker], signal.SIGKILL)

    def _check_deadline(self) -> None:
        if self.short_since is None:
            return
        if self.round:
            self._check_blacklisted()
        waited = self.clock() - self.short_since
        if waited > self.settings.elastic_timeout:
            have = len(assign(self.available, self.finished, self.settings.max_np))
            raise Failed(f"only {have} slot(s) were available for {waited:.0f} s, fewer than --min-np "
                         f"{self.settings.min_np} (--elastic-timeout {self.settings.elastic_timeout:g})")

    def _start_worker(self, worker: str, slot: Slot) -> None:
        env = self._worker_env(slot)
        env.update(HVPS_ELASTIC="1", HVPS_ELASTIC_WORKER=worker,
                   HVPS_ELASTIC_TIMEOUT=f"{self.settings.elastic_timeout:g}",
                   HVPS_ELASTIC_RESETS_WITHOUT_COMMIT=str(self.settings.resets_without_commit))
        proc = self._start(slot, env)
        self.running[worker] = proc
        self.every.append(proc)
        threading.Thread(target=lambda: self.events.put(("exit", worker, proc.wait())), daemon=True).start()


def main(argv: Optional[Sequence[str]] = None) -> int:
    return gloo_run.main(argv, job=ElasticJob)


if __name__ == "__main__":
    sys.exit(main())
