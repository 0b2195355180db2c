"""Inner test: strangers attack rank 0's control port while a real job starts.

Rank 0 launches every attack in attackers.py as soon as its listener exists
(before any real rank can connect); rank 1 records its own handshake and
replays it as an impostor; with 3 ranks, rank 2 connects late so the listener
stays open for the replay. The job must start on time, use no extra memory,
log each stranger it dropped and then run collectives normally.
"""

import logging
import resource
import select
import socket
import time

import attackers
import numpy as np
import pytest
from hvps_testutil import world_size_env

import hvps
from hvps.control.plane import HANDSHAKE_SECONDS
from hvps.core.launchers import env_rank

pytestmark = pytest.mark.timeout(120)


def _rank():
    return env_rank()


def _arm_rank0(monkeypatch, state):
    real = socket.create_server

    def create_server(*args, **kwargs):
        listener = real(*args, **kwargs)
        state["port"] = listener.getsockname()[1]
        state["threads"] = attackers.launch("127.0.0.1", state["port"])
        time.sleep(0.5)  # every stranger is connected and has spoken before any real rank knows the port
        return listener

    monkeypatch.setattr(socket, "create_server", create_server)


def _arm_worker(monkeypatch, rank, state):
    real = socket.create_connection

    def create_connection(address, *args, **kwargs):
        if rank == 2:
            time.sleep(2.0)  # keeps rank 0's listener open for rank 1's impostor
        sock = real(address, *args, **kwargs)
        if rank != 1:
            return sock

        def on_proof(transcript):
            select.select([sock], [], [], 5)  # rank 0's ack is here: rank 1 is registered
            attackers.replay(*address, transcript)

        return attackers.Recorder(sock, on_proof)

    monkeypatch.setattr(socket, "create_connection", create_connection)


def test_job_survives_attacks_during_init(monkeypatch, caplog):
    rank, size = _rank(), world_size_env()
    state = {}
    if rank == 0:
        _arm_rank0(monkeypatch, state)
    else:
        _arm_worker(monkeypatch, rank, state)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="hvps"):
        hvps.init()
    elapsed = time.monotonic() - started
    monkeypatch.undo()
    try:
        assert hvps.size() == size
        if rank == 0:
            # the slow-loris is still trickling: init did not wait for it
            assert elapsed < HANDSHAKE_SECONDS, f"init took {elapsed:.1f} s"
            grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
            assert grown_mb < 64, f"rank 0 grew by {grown_mb:.0f} MB"
            reasons = "\n".join(r.getMessage() for r in caplog.records)
            for expected in ["expected a JSON object", "nested deeper than", "exceeds the limit",
                             "is not in 1..", "expected keys among"]:
                assert expected in reasons, f"{expected!r} not among:\n{reasons}"
            if size > 2:  # the impostors had time to finish their handshakes
                assert "does not hold the job's key" in reasons, reasons
                assert "already connected" in reasons, reasons
            with pytest.raises(OSError):  # the port closed when every rank had joined
                socket.create_connection(("127.0.0.1", state["port"]), timeout=2).close()
        # the job works, including a reply of megabytes (a 3 MB name once deadlocked it)
        x = np.arange(1000, dtype=np.float32) + rank
        total = sum(range(size))
        np.testing.assert_allclose(hvps.allreduce(x, op=hvps.Sum), np.arange(1000) * size + total)
        long_name = "n" * 3_000_000
        np.testing.assert_allclose(hvps.allreduce(x, op=hvps.Sum, name=long_name),
                                   np.arange(1000) * size + total)
        hvps.barrier()
    finally:
        hvps.shutdown()
