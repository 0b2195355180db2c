"""hvps.control.liveness: the watch that tells a closed control connection (a dead peer) at once, and
the error every collective in flight then fails with. Real sockets, no processes."""

from __future__ import annotations

import queue
import re
import socket

import pytest

from hvps.control.liveness import CLOSED, PeerLost, PeerWatch
from hvps.core.errors import HvpsError

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
