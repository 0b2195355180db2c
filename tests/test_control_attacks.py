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
