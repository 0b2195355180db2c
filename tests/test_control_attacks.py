"""Outer test: a real 2- and 3-rank job starts and runs while strangers attack its
control port (garbage, deep JSON, slow-loris, an oversized header, an out-of-range
rank, a replayed handshake, a wrong key): see tests/mpi/mpi_control_attacks.py."""

import pytest
from conftest import run_mpi


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_job_survives_control_plane_attacks(np_):
    run_mpi("mpi_control_attacks.py", np_, timeout=150).assert_all_passed()
