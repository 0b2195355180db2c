"""Outer test: collectives from 8 user threads at 2 and 3 ranks (tests/mpi/mpi_threads.py), in the jobs
shared with the other small multi-rank modules (conftest.SHARED_JOBS)."""

import pytest
from conftest import SHARED_JOBS, case


@pytest.mark.inner_cases(cases=lambda np_: [(np_, case("threads", "mpi_threads.py", timeout=150))], share=SHARED_JOBS)
@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_threads(np_, inner_results):
    inner_results["threads"].assert_all_passed()
