"""hvps.control.liveness: the watch that tells a closed control connection (a dead peer) at once, and
the error every collective in flight then fails with. Real sockets, no processes."""

from __future__ import annotations

import queue
import re
import socket
import threading
import time

import pytest

from hvps.control.liveness import CLOSED, SILENT, PeerLost, PeerWatch
from hvps.control.plane import ControlPlane
from hvps.core.errors import HvpsError
from hvps.metrics.instruments import error_kind

pytestmark = pytest.mark.unit


def _pairs(n):
    return [socket.socketpair() for _ in range(n)]


def test_watch_reports_each_closed_connection_once_and_never_for_data():
    pairs = _pairs(3)
    seen: queue.Queue = queue.Queue()
    watch = PeerWatch([(mine, rank) for rank, (mine, _) in enumerate(pairs)], seen.put)
    watch.start()
    try:
        for _, theirs in pairs:
            theirs.sendall(b"data is not a hangup")
        with pytest.raises(queue.Empty):
            seen.get(timeout=0.3)
        pairs[1][1].close()  # what the kernel does for a killed process
        assert seen.get(timeout=2) == 1  # reported without waiting for any timeout (how fast: not pass/fail)
        pairs[2][1].shutdown(socket.SHUT_WR)  # rank 0's last word: its sending side shut
        assert seen.get(timeout=2) == 2
        with pytest.raises(queue.Empty):  # level-triggered in the kernel, reported once here
            seen.get(timeout=0.3)
        # the watch never read: the data is still there for the sockets' owner
        assert pairs[0][0].recv(100) == b"data is not a hangup"
    finally:
        watch.stop()
        for mine, theirs in pairs:
            mine.close()
            theirs.close()
    assert not watch.is_alive()


def test_watch_stops_at_once_and_reports_nothing_after():
    mine, theirs = socket.socketpair()
    seen: queue.Queue = queue.Queue()
    watch = PeerWatch([(mine, 0)], seen.put)
    watch.start()
    watch.stop()
    assert not watch.is_alive()
    theirs.close()
    with pytest.raises(queue.Empty):
        seen.get(timeout=0.2)
    mine.close()


def _named(message):
    return {int(r) for group in re.findall(r"\branks? \[?(\d+(?:, \d+)*)\]?", message) for r in group.split(", ")}


def test_peer_lost_names_the_collective_and_only_the_dead_ranks():
    lost = PeerLost({2: CLOSED})
    assert isinstance(lost, HvpsError)
    error = lost.for_collective("allreduce", "allreduce.grad.fc1")
    text = str(error)
    assert "allreduce 'allreduce.grad.fc1'" in text and CLOSED in text and "--max-restarts" in text
    assert _named(text) == {2} and _named(str(lost)) == {2}
    assert error.__cause__ is lost
    # the metrics exporter counts these as lost ranks (hvps.metrics.instruments.error_kind)
    assert " exited before submitting " in text

    coordinator = PeerLost({"0": CLOSED})  # as rank 0's notice carries them: JSON keys are text
    assert coordinator.lost == {0: CLOSED}
    assert "rank 0 (the coordinator)" in str(coordinator) and _named(str(coordinator)) == {0}

    several = PeerLost({3: CLOSED, 1: "it shut its control connection down alone"})
    text = str(several.for_collective("broadcast", "broadcast.w"))
    assert _named(text) == {1, 3} and "ranks [1, 3]" in text
    assert "rank 1: it shut its control connection down alone" in text and f"rank 3: {CLOSED}" in text


def test_a_rank_lost_to_the_roll_call_is_said_to_have_stopped_answering_not_to_have_exited():
    error = PeerLost({"1": SILENT})  # as rank 0's notice carries it
    text = str(error.for_collective("allreduce", "allreduce.large"))
    assert "allreduce 'allreduce.large'" in text and "rank 1 stopped answering before " in text and SILENT in text
    assert " exited " not in text and _named(text) == {1}
    assert error_kind(text) == "rank_lost"
    both = str(PeerLost({1: SILENT, 2: CLOSED}).for_collective("allreduce", "g"))
    assert "ranks [1, 2] exited or stopped answering before " in both and error_kind(both) == "rank_lost"


class _ThreadComm:
    """The two calls a ControlPlane makes on its bootstrap communicator, for ranks that are threads."""

    def __init__(self, shared: dict, rank: int, size: int) -> None:
        self.shared, self.rank, self.size = shared, rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def allgather(self, value):
        self.shared["offers"][self.rank] = value
        self.shared["barrier"].wait()
        return list(self.shared["offers"])

    def Barrier(self):
        self.shared["barrier"].wait()


def _planes(size: int) -> list:
    shared = {"offers": [None] * size, "barrier": threading.Barrier(size, timeout=20)}
    planes = [None] * size

    def build(rank):
        planes[rank] = ControlPlane(_ThreadComm(shared, rank, size), connect_timeout=10)

    threads = [threading.Thread(target=build, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(planes), "the control planes did not connect"
    return planes


def test_the_roll_call_names_the_child_that_neither_answers_nor_reports(monkeypatch):
    """Rank 1 answers from its poll (its engine reads it), rank 2 reads nothing (stopped): rank 2 is silent;
    once rank 2 reports a failed transfer instead, nobody is. Probes and answers never reach the engine."""
    monkeypatch.setenv("HVPS_CONTROL_ADDR", "127.0.0.1")
    planes = _planes(3)
    seen: list = []
    stop_polling = threading.Event()

    def engine_of_rank_1():
        while not stop_polling.is_set():
            messages, _ = planes[1].poll(0.01)
            seen.extend(messages)

    poller = threading.Thread(target=engine_of_rank_1)
    poller.start()
    try:
        silent, messages, closed = planes[0].roll_call(0.5, threading.Event())
        assert silent == [2] and messages == [] and closed == []
        planes[2].report_failure("allreduce 'allreduce.large': no data moved", stall=True)
        silent, _, _ = planes[0].roll_call(2.0, threading.Event())
        assert silent == [] and planes[0].stalled == {2} and "no data moved" in planes[0].failed[2]
        planes[0].send(1, {"responses": []})  # what the engine gets is everything else
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [(0, {"responses": []})]
        stopped = threading.Event()
        stopped.set()  # ranks were found dead meanwhile: the roll call ends at once, before rank 1 answers
        assert planes[0].roll_call(30.0, stopped)[0] == [1]
    finally:
        stop_polling.set()
        poller.join(5)
        for plane in planes:
            plane.close()
