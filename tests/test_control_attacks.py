"""Outer test: a real 2- and 3-rank job starts and runs while strangers attack its
control port (garbage, deep JSON, slow-loris, an oversized header, an out-of-range
rank, a replayed handshake, a wrong key): see tests/mpi/mpi_control_attacks.py. Runs in the jobs
shared with the other small multi-rank modules (conftest.SHARED_JOBS)."""

import pytest
from conftest import SHARED_JOBS, case


@pytest.mark.inner_cases(cases=lambda np_: [(np_, case("control-attacks", "mpi_control_attacks.py", timeout=150))],
                         share=SHARED_JOBS)
@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_job_survives_control_plane_attacks(np_, inner_results):
    inner_results["control-attacks"].assert_all_passed()


@pytest.mark.unit
def test_a_connection_flood_logs_a_few_lines_not_one_per_connection(caplog):
    """Issue 38: a relay (or rank 0) logged one warning per dropped connection, 1,600 lines for a 20 s flood.
    Now at most 10 per 10 s, then one line that counts the rest."""
    import logging

    from hvps.control import plane

    class Fake:
        def unregister(self, sock):
            pass

        def close(self):
            pass

    now = [0.0]
    throttle = plane._Throttle(clock=lambda: now[0])
    old, plane._dropped = plane._dropped, throttle
    try:
        with caplog.at_level(logging.WARNING, logger="hvps"):
            for i in range(1600):  # 80 connections a second for 20 s
                sock = Fake()
                plane.ControlPlane._refuse(sock, Fake(), {sock: (None, 0, "198.51.100.7")}, "garbage")
                now[0] += 20 / 1600
            throttle.flush()
    finally:
        plane._dropped = old
    lines = [r.getMessage() for r in caplog.records]
    assert 20 <= len(lines) <= 24, len(lines)
    assert sum(int(m.split()[3]) for m in lines if "more connections refused or dropped" in m) + \
        sum("dropped a connection from 198.51.100.7: garbage" in m for m in lines) == 1600
