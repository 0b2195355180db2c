"""The engine's roles one at a time, each real, its neighbours simple fakes (issue 41): the submission queue and
the waiter fast path, rank 0's coordination and its shutdown rule, a worker's negotiation and relay, the
executor, the lost-rank finder and the engine's failure. No thread, socket or process: what the multi-rank
suites check end to end is checked here role by role."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque

import numpy as np
import pytest

from hvps.control import tree
from hvps.control.liveness import SILENT, PeerLost
from hvps.control.negotiation import ALLREDUCE, BARRIER, SHUTDOWN, Coordinator, Request, Response
from hvps.control.response_cache import ResponseCache
from hvps.core.errors import DataPlaneStall, DuplicateNameError, HvpsError
from hvps.dataplane.executors import Entry
from hvps.runtime.coordinator import RankZeroCoordinator
from hvps.runtime.engine_status import EngineStatus, NegotiationClock
from hvps.runtime.execution import Executor
from hvps.runtime.failures import EngineFailures
from hvps.runtime.losses import LostRankFinder
from hvps.runtime.submission import FastPath, SubmissionQueue, waits_at_once
from hvps.runtime.worker import WorkerNegotiation

pytestmark = pytest.mark.unit


def entry(name: str, kind: str = ALLREDUCE, count: int = 4) -> Entry:
    data = np.ones(count, np.float32)
    return Entry(Request(name, kind, "float32", ((count,),), "sum"), [data], [np.empty_like(data)])


class Calls:
    """A callable that records its arguments (a fake neighbour's callback)."""

    def __init__(self, result=None) -> None:
        self.calls: list = []
        self.result = result

    def __call__(self, *args):
        self.calls.append(args)
        return self.result


class FakePlane:
    """The control plane's calls the roles make, recorded; a roll call answers ``silent``."""

    def __init__(self, rank: int = 0, size: int = 3, fanout: int = 64, silent: tuple = ()) -> None:
        self.position = tree.position(rank, size, fanout)
        self.parent, self.children = self.position.parent, list(self.position.children)
        self.sent: list = []
        self.sent_down: list = []
        self.reports: list = []
        self.roll_calls = 0
        self.silent = list(silent)
        self.stalled: set = set()
        self.farewells: list = []
        self.wakes = 0

    def send(self, rank: int, message: dict) -> None:
        self.sent.append((rank, message))

    def send_down(self, message: dict) -> None:
        self.sent_down.append(message)

    def report_failure(self, what: str, stall: bool) -> None:
        self.reports.append((what, stall))

    def poll(self, timeout):
        return [], []

    def roll_call(self, seconds: float, stop) -> tuple:
        self.roll_calls += 1
        return self.silent, [], []

    def farewell(self, lost: dict) -> None:
        self.farewells.append(lost)

    def wake(self) -> None:
        self.wakes += 1


# -- the submission queue -------------------------------------------------------------------
def test_the_queue_hands_out_entries_and_announces_requests_in_submission_order():
    queue = SubmissionQueue(0, EngineStatus(), stall_seconds=60, wake=Calls())
    entries = [entry(name) for name in ("c", "a", "b")]
    handles = queue.submit_all(entries[:2]) + [queue.submit_all(entries[2:])[0]]
    assert [h.name for h in handles] == ["c", "a", "b"]
    queue.take(cycle_s=0.001, on_waiter=False)
    assert [r.name for r in queue.due_announcements(cycle_s=0.001)] == ["c", "a", "b"]
    assert queue.due_announcements(cycle_s=0.001) == []  # announced once
    assert queue.take_pending(["a", "zz", "c"]) == [entries[1], None, entries[0]]
    assert queue.drain() == [entries[2]]


def test_a_name_in_flight_is_refused_and_a_stopped_engine_takes_nothing():
    status = EngineStatus()
    queue = SubmissionQueue(1, status, stall_seconds=60, wake=Calls())
    queue.submit_all([entry("w")])
    with pytest.raises(DuplicateNameError, match="'w' is already in flight on rank 1"):
        queue.submit_all([entry("v"), entry("w")])
    assert queue.take_pending(["v"]) == [None]  # all or nothing: 'v' was not queued either
    status.ended = HvpsError("ended by the others")
    status.stopping = True
    with pytest.raises(HvpsError, match="ended by the others"):
        queue.submit_all([entry("u")])
    status.failure = RuntimeError("boom")
    with pytest.raises(HvpsError, match="the hvps engine stopped: boom"):
        queue.submit_all([entry("t")])


def test_a_sleeping_engine_is_woken_once_and_not_for_a_synchronous_call():
    wake = Calls()
    queue = SubmissionQueue(0, EngineStatus(), stall_seconds=60, wake=wake)
    queue.submit_all([entry("awake")])
    assert wake.calls == []  # the engine polls its queue while active
    queue.sleeping = True
    with waits_at_once():
        queue.submit_all([entry("sync")])
    assert wake.calls == []  # its waiter runs it, or wakes the engine then
    queue.submit_all([entry("one")])
    queue.submit_all([entry("two")])
    assert len(wake.calls) == 1  # one wake-up until the engine runs
    queue.take(cycle_s=0.001, on_waiter=False)
    queue.sleeping = True
    queue.submit_all([entry("three")])
    assert len(wake.calls) == 2



def test_only_asynchronous_submissions_keep_the_engine_polling_its_queue():
    queue = SubmissionQueue(0, EngineStatus(), stall_seconds=60, wake=Calls())
    with waits_at_once():
        queue.submit_all([entry("sync")])
    queue.take(cycle_s=0.001, on_waiter=False)
    assert queue.active_until == 0.0  # its waiter runs the next one, or wakes the engine
    queue.submit_all([entry("async")])
    with waits_at_once():
        queue.submit_all([entry("sync.2")])
    queue.take(cycle_s=0.001, on_waiter=False)
    assert queue.active_until > 0.0  # a burst (a backward pass) may be under way

def gradient(name: str, count: int) -> Entry:
    """A gradient as the optimizer's hook submits it: it may wait for the rest of its bucket."""
    grad = entry(name, count=count)
    grad.bucketed = True
    return grad


def test_gradients_wait_for_their_bucket_unless_full_wanted_taken_along_or_overdue(monkeypatch):
    from hvps.runtime import submission

    monkeypatch.setattr(submission, "GRADIENT_BUCKET_BYTES", 64)  # 16 float32
    # no deadline passes while the test runs, however loaded the machine: "overdue" is asked with a later now
    monkeypatch.setattr(submission, "GRADIENT_HOLD_SECONDS", 3600.0)
    wake = Calls()
    queue = SubmissionQueue(0, EngineStatus(), stall_seconds=60, wake=wake)
    queue.sleeping = True
    queue.submit_all([gradient("g.0", 4)])
    queue.submit_all([gradient("g.1", 4)])
    assert len(wake.calls) == 1  # the bucket's start only: the engine then sleeps until its deadline
    queue.take(cycle_s=0.001, on_waiter=False)
    assert queue.due_announcements(cycle_s=0.001) == [] and queue.active_until == 0.0  # held, no polling
    assert queue.deadlines(time.monotonic(), 0.001) and not queue.has_due(time.monotonic())
    assert queue.has_due(time.monotonic() + submission.GRADIENT_HOLD_SECONDS)  # overdue: it goes
    queue.sleeping = True
    queue.submit_all([gradient("g.2", 8)])  # 64 bytes: full
    assert len(wake.calls) == 2
    queue.take(cycle_s=0.001, on_waiter=False)
    assert [r.name for r in queue.due_announcements(cycle_s=0.001)] == ["g.0", "g.1", "g.2"]
    queue.take_pending(["g.0", "g.1", "g.2"])  # executed

    queue.submit_all([gradient("g.3", 4)])
    queue.wake_if_queued()  # a waiter wants it
    queue.take(cycle_s=0.001, on_waiter=False)
    assert [r.name for r in queue.due_announcements(cycle_s=0.001)] == ["g.3"]
    queue.take_pending(["g.3"])
    queue.submit_all([gradient("g.4", 4)])
    queue.submit_all([entry("other")])  # another collective takes the bucket along
    queue.take(cycle_s=0.001, on_waiter=False)
    assert [r.name for r in queue.due_announcements(cycle_s=0.001)] == ["g.4", "other"]
    assert not queue.has_due(time.monotonic())

    small = SubmissionQueue(0, EngineStatus(), stall_seconds=60, wake=Calls(), fusion_threshold=lambda: 0)
    small.submit_all([gradient("alone", 1)])  # no fusion: nothing waits
    small.take(cycle_s=0.001, on_waiter=False)
    assert [r.name for r in small.due_announcements(cycle_s=0.001)] == ["alone"]


# -- the fast path ----------------------------------------------------------------------------
class FakeExecutor:
    def __init__(self) -> None:
        self.backlog: deque = deque()
        self.on_waiter = False


def fast_path(queue: SubmissionQueue, status: EngineStatus, executor: FakeExecutor, cycle, spin_seconds=5.0):
    wake = Calls()
    path = FastPath(queue, status, executor, threading.Lock(), cycle, contextlib.nullcontext, lambda: False, wake,
                    spin_seconds)
    return path, wake


def test_a_waiter_runs_the_cycles_itself_when_its_collective_is_alone():
    status, executor = EngineStatus(), FakeExecutor()
    queue = SubmissionQueue(0, status, stall_seconds=60, wake=Calls())
    ran: list = []

    def cycle() -> None:  # the real cycle would negotiate and execute it; here it finishes on the second
        ran.append(executor.on_waiter)
        queue.take(0.001, executor.on_waiter)
        if len(ran) == 2:
            queue.take_pending([handle.name])[0].handle.set_result("done")

    path, wake = fast_path(queue, status, executor, cycle)
    (handle,) = queue.submit_all([entry("alone")])
    assert path.alone(handle)
    assert path.drive(handle)
    assert ran == [True, True] and not executor.on_waiter
    assert handle.wait() == "done"
    assert queue.active_until == 0.0  # a waiter's cycles do not keep the engine thread polling


def test_the_fast_path_is_refused_beside_other_work_or_when_off_and_the_engine_is_woken_instead():
    status, executor = EngineStatus(), FakeExecutor()
    queue = SubmissionQueue(0, status, stall_seconds=60, wake=Calls())
    cycles = Calls()
    path, _ = fast_path(queue, status, executor, cycles)
    first, _ = queue.submit_all([entry("first"), entry("second")])
    assert not path.alone(first) and not path.drive(first)
    queue.take(0.001, False)
    queue.take_pending(["second"])  # executed meanwhile
    assert path.alone(first)
    executor.backlog.append("a response left for the engine thread")
    assert not path.drive(first)
    executor.backlog.clear()
    path.spin_seconds = 0.0
    assert not path.drive(first)
    path.spin_seconds = 5.0
    status.failure = RuntimeError("failed")
    assert not path.drive(first)
    assert cycles.calls == []
    woken = Calls()
    queue = SubmissionQueue(0, EngineStatus(), stall_seconds=60, wake=woken)
    path, _ = fast_path(queue, EngineStatus(), FakeExecutor(), cycles, spin_seconds=0.0)
    (queued,) = queue.submit_all([entry("queued")])
    path.expedite(queued)  # no driving: the engine thread is woken for it at once
    assert len(woken.calls) == 1 and cycles.calls == []


def test_a_waiter_stops_driving_at_a_response_too_large_for_it():
    status, executor = EngineStatus(), FakeExecutor()
    queue = SubmissionQueue(0, status, stall_seconds=60, wake=Calls())
    cycles = Calls()
    path, wake = fast_path(queue, status, executor, lambda: (cycles(), executor.backlog.append("large")))
    (handle,) = queue.submit_all([entry("big")])
    assert path.drive(handle)
    assert len(cycles.calls) == 1 and not handle.finished
    assert queue.sleeping  # from now on submitters wake the engine thread


# -- rank 0's coordination -------------------------------------------------------------------
def rank_zero(size: int = 3, stall_seconds: float = 10.0, silent: tuple = (), announcements=None):
    status, plane = EngineStatus(), FakePlane(0, size, silent=silent)
    negotiation = Coordinator(size, fusion_threshold=0, stall_seconds=stall_seconds)
    executed, tuning = Calls(), Calls()

    def peers_lost(lost: dict) -> None:
        status.failure = PeerLost(lost)

    finder = LostRankFinder(0, plane, status, peers_lost)
    role = RankZeroCoordinator(size, negotiation, plane, ResponseCache(16, size), status, finder,
                               announcements or (lambda: []), lambda responses: executed(list(responses)),
                               Calls(), peers_lost, tuning, NegotiationClock())
    return role, negotiation, plane, status, executed, tuning


SHUTDOWN_OF_RANK_1 = (1, {"requests": [{"name": "shutdown", "kind": SHUTDOWN, "shapes": [], "splits": []}],
                          "epoch": 0})


def test_rank_zero_issues_shutdown_after_the_stall_time_naming_the_ranks_that_asked(caplog):
    role, negotiation, plane, status, executed, _ = rank_zero(stall_seconds=10.0)
    negotiation.submit(0, [Request("shutdown", SHUTDOWN)], time.monotonic())
    role.cycle([SHUTDOWN_OF_RANK_1], [])
    assert plane.roll_calls == 0 and executed.calls == [([],)]  # rank 2 still has the stall time to follow
    role, negotiation, plane, status, executed, _ = rank_zero(stall_seconds=10.0)
    negotiation.submit(0, [Request("shutdown", SHUTDOWN)], time.monotonic() - 60)  # as if asked a minute ago
    with caplog.at_level("WARNING", logger="hvps"):
        role.cycle([SHUTDOWN_OF_RANK_1], [])
    (responses,) = executed.calls[-1]
    assert [(r.kind, r.asked) for r in responses] == [(SHUTDOWN, [0, 1])]
    assert plane.roll_calls == 1  # rank 2 answered the roll: ended, not lost
    assert [r["kind"] for r in plane.sent_down[-1]["responses"]] == [SHUTDOWN]
    assert status.failure is None
    assert any("ranks [2] have not" in record.getMessage() for record in caplog.records)


def test_a_late_rank_that_answers_no_roll_call_is_lost_and_nothing_is_executed():
    role, negotiation, plane, status, executed, _ = rank_zero(silent=(2,))
    negotiation.submit(0, [Request("shutdown", SHUTDOWN)], time.monotonic() - 60)
    negotiation.submit(1, [Request("shutdown", SHUTDOWN)], time.monotonic() - 60)
    role.cycle([], [])
    assert isinstance(status.failure, PeerLost) and status.failure.lost == {2: SILENT}
    assert executed.calls == [] and plane.sent_down == []


def test_rank_zero_sends_autotuned_settings_with_the_next_responses():
    pending = [[Request("g", ALLREDUCE, "float32", ((4,),), "sum")]]
    role, negotiation, plane, _, executed, tuning = rank_zero(size=2, announcements=lambda: pending.pop() if pending
                                                              else [])
    role.tune(1024, 3.5)
    assert negotiation.fusion_threshold == 1024 and tuning.calls == [({"fusion_threshold": 1024,
                                                                       "cycle_time_ms": 3.5},)]
    role.cycle([(1, {"requests": [{"name": "g", "kind": ALLREDUCE, "dtype": "float32", "shapes": [[4]],
                                   "op": "sum", "splits": []}], "epoch": 0})], [])
    (message,) = plane.sent_down
    assert message["tuning"] == {"fusion_threshold": 1024, "cycle_time_ms": 3.5}
    assert [r.names for r in executed.calls[-1][0]] == [["g"]]


# -- a worker's negotiation, and a relay --------------------------------------------------------
def test_a_worker_announces_to_its_parent_passes_responses_down_and_executes_them():
    plane = FakePlane(rank=1, size=4, fanout=1)  # 0 -> 1 -> 2 -> 3: rank 1 is a relay
    executed, tuning = Calls(), Calls()
    due = [[Request("g", ALLREDUCE, "float32", ((4,),), "sum")]]
    worker = WorkerNegotiation(1, plane, ResponseCache(16, 4, 1, children={2: range(2, 4)}),
                               lambda: due.pop() if due else [], lambda r: executed(list(r)), Calls(), tuning,
                               NegotiationClock(), relay_hold_s=3600)
    assert worker.listens_always and not worker.busy()
    worker.cycle([], [])  # a full (uncached) request goes up at once, unmerged
    assert [(parent, [spans for _, spans in message["batch"]]) for parent, message in plane.sent] == [(0, [[[1, 2]]])]
    worker.cycle([(2, {"requests": [{"name": "g", "kind": ALLREDUCE, "dtype": "float32", "shapes": [[4]],
                                     "op": "sum", "splits": []}], "epoch": 0})], [])  # the child's, passed up
    assert [spans for _, spans in plane.sent[-1][1]["batch"]] == [[[2, 3]]]
    agreed = Response(ALLREDUCE, ["g"], requests=[Request("g", ALLREDUCE, "float32", ((4,),), "sum")])
    down = {"responses": ResponseCache(16, 4).encode_responses([agreed]), "tuning": {"fusion_threshold": 0,
                                                                                    "cycle_time_ms": 1}}
    worker.cycle([(0, down)], [])
    assert plane.sent_down == [down]
    assert [r.names for r in executed.calls[-1][0]] == [["g"]] and len(tuning.calls) == 1


# -- the executor -----------------------------------------------------------------------------
class StallingBackend:
    """A data plane whose transfers stall (a stopped peer)."""

    interruptible_bytes = 64

    def interruptible_bytes_for(self, method):
        return self.interruptible_bytes

    def ordered(self, entries):
        return contextlib.nullcontext()

    def allreduce(self, sendbuf, recvbuf, op):
        raise DataPlaneStall("no data moved for 2 s")


class SegmentLikeBackend:
    """A data plane of one rank whose allreduce gives up at once on a lost rank whatever its size (as the node's
    shared-memory plane's does), while its point-to-point transfers (Adasum's) only up to 64 bytes."""

    interruptible_bytes = 64

    def interruptible_bytes_for(self, method):
        return 1 << 62 if method == "allreduce" else self.interruptible_bytes

    def ordered(self, entries):
        return contextlib.nullcontext()

    def allreduce(self, sendbuf, recvbuf, op):
        recvbuf[...] = sendbuf


def executor_with(queue: SubmissionQueue, status: EngineStatus, find_the_lost, fail_all=None):
    return Executor(0, 3, StallingBackend(), status, queue, find_the_lost, fail_all or Calls(), Calls(), lambda: 0)


def test_a_stalled_transfer_fails_every_handle_naming_the_tensor_and_the_stopped_rank():
    status = EngineStatus()
    queue = SubmissionQueue(0, status, stall_seconds=60, wake=Calls())
    failures = EngineFailures(0, status, FakePlane(), lambda: queue.drain() + executor.running, lambda: True)
    finder = LostRankFinder(0, FakePlane(silent=(2,)), status, failures.peers_lost)
    executor = executor_with(queue, status, finder.find)
    grad, other = queue.submit_all([entry("grad"), entry("other")])
    queue.take(0.001, False)
    request = Request("grad", ALLREDUCE, "float32", ((4,),), "sum")
    with pytest.raises(DataPlaneStall):
        executor.execute([Response(ALLREDUCE, ["grad"], requests=[request])])
    for handle, name in ((grad, "grad"), (other, "other")):
        with pytest.raises(HvpsError, match=f"allreduce '{name}' cannot complete: rank 2 stopped answering"):
            handle.wait()
    assert status.lost.is_set() and finder.roll_called


def test_an_agreed_error_reaches_the_handles_and_the_shutdown_of_others_ends_this_rank():
    status = EngineStatus()
    queue = SubmissionQueue(1, status, stall_seconds=60, wake=Calls())
    failed = Calls()
    executor = Executor(1, 3, StallingBackend(), status, queue, Calls(), lambda error: failed(error), Calls(),
                        lambda: 0)
    (handle,) = queue.submit_all([entry("w")])
    queue.take(0.001, False)
    mismatch = "hvps mismatch: ranks submitted 'w' with different arguments: ranks [0, 1]: ...; ranks [2]: ..."
    executor.execute([Response(ALLREDUCE, ["w"], error=mismatch),
                      Response(BARRIER, ["b"], requests=[Request("b", BARRIER)]),  # not submitted here: no handle
                      Response(SHUTDOWN, ["shutdown"], asked=[0, 2])])
    with pytest.raises(HvpsError, match=r"'w'.*ranks \[0, 1\].*ranks \[2\]"):
        handle.wait()
    assert status.stopping and "ranks [0, 2] called hvps.shutdown()" in str(status.ended)
    assert failed.calls == [(status.ended,)]


def test_a_waiter_leaves_a_collective_too_large_for_it_to_the_engine_thread():
    status = EngineStatus()
    queue = SubmissionQueue(0, status, stall_seconds=60, wake=Calls())
    executor = executor_with(queue, status, Calls())
    queue.submit_all([entry("big", count=1000)])
    queue.take(0.001, True)
    executor.on_waiter = True
    large = Response(ALLREDUCE, ["big"], requests=[Request("big", ALLREDUCE, "float32", ((1000,),), "sum")])
    executor.execute([large])
    assert list(executor.backlog) == [large] and queue.pending_entry("big") is not None


def test_a_waiter_runs_a_large_collective_when_its_plane_abandons_it_at_once_but_leaves_adasum():
    status = EngineStatus()
    queue = SubmissionQueue(0, status, stall_seconds=60, wake=Calls())
    executor = Executor(0, 1, SegmentLikeBackend(), status, queue, Calls(), Calls(), Calls(), lambda: 0)
    (big,) = queue.submit_all([entry("big", count=1000)])
    adasum = Entry(Request("mixed", ALLREDUCE, "float32", ((1000,),), "adasum"), [np.ones(1000, np.float32)],
                   [np.empty(1000, np.float32)])
    queue.submit_all([adasum])
    queue.take(0.001, True)
    executor.on_waiter = True
    large = Response(ALLREDUCE, ["big"], requests=[Request("big", ALLREDUCE, "float32", ((1000,),), "sum")])
    executor.execute([large, Response(ALLREDUCE, ["mixed"], requests=[adasum.request])])
    assert big.finished and executor.driven_collectives == 1
    assert [r.names for r in executor.backlog] == [["mixed"]], "Adasum's exchanges run on the flat plane: left"


# -- losses and failure ------------------------------------------------------------------------
def test_a_worker_reports_its_failure_to_rank_zero_and_rank_zero_calls_the_roll_once():
    status = EngineStatus()
    status.lost.set()  # the word came already: no waiting
    worker_plane = FakePlane(rank=1)
    LostRankFinder(1, worker_plane, status, Calls()).find("allreduce 'g': stalled", stall=True)
    assert worker_plane.reports == [("allreduce 'g': stalled", True)]
    lost, plane = Calls(), FakePlane(silent=(1,))
    finder = LostRankFinder(0, plane, EngineStatus(), lost)
    finder.find("allreduce 'g': stalled", stall=True)
    finder.find("allreduce 'h': stalled", stall=True)
    assert plane.roll_calls == 1 and lost.calls == [({1: SILENT},)]


def test_lost_peers_fail_every_collective_once_and_the_word_is_passed_on():
    status = EngineStatus()
    queue = SubmissionQueue(0, status, stall_seconds=60, wake=Calls())
    plane = FakePlane()
    failures = EngineFailures(0, status, plane, queue.drain, lambda: True)
    handles = queue.submit_all([entry("a"), entry("b")])
    failures.peers_lost({2: "its control connection closed"})
    failures.peers_lost({1: "later news"})  # the engine failed already
    failures.failed(RuntimeError("a consequence"))
    assert plane.farewells == [{2: "its control connection closed"}] and status.lost.is_set()
    for handle in handles:
        with pytest.raises(HvpsError, match=f"'{handle.name}' cannot complete: rank 2 exited"):
            handle.wait()
    with pytest.raises(HvpsError, match="rank 2 exited"):
        queue.submit_all([entry("c")])


def test_a_fault_of_hvps_itself_names_its_type_and_where_its_traceback_went():
    # an internal error with no text of its own (a KeyError(), say) must not reach every handle as "after: ''"
    status = EngineStatus()
    queue = SubmissionQueue(1, status, stall_seconds=60, wake=Calls())
    failures = EngineFailures(1, status, FakePlane(), queue.drain, lambda: True)
    handles = queue.submit_all([entry("a")])
    failures.failed(KeyError())
    with pytest.raises(HvpsError, match=r"stopped on rank 1 after: KeyError: .*internal error.*rank 1's log"):
        handles[0].wait()
    status = EngineStatus()
    queue = SubmissionQueue(1, status, stall_seconds=60, wake=Calls())
    failures = EngineFailures(1, status, FakePlane(), queue.drain, lambda: True)
    handles = queue.submit_all([entry("b")])
    failures.failed(HvpsError("the data plane said why"))  # hvps's own errors pass as they are
    with pytest.raises(HvpsError, match=r"stopped on rank 1 after: the data plane said why$"):
        handles[0].wait()
