"""Outer test: collectives from 8 user threads at 2 and 3 ranks (tests/mpi/mpi_threads.py)."""

import pytest
from conftest import run_mpi


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_threads(np_):
    run_mpi("mpi_threads.py", np_, timeout=150).assert_all_passed()
