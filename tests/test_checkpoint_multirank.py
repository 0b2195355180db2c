"""Run tests/mpi/mpi_checkpoint.py under mpirun with 2 and 3 ranks; every rank must pass
every test (nothing failed, errored or skipped), in the jobs shared with the other small multi-rank
modules (conftest.SHARED_JOBS)."""

import pytest
from conftest import SHARED_JOBS, case

NPS = [2, 3]


@pytest.mark.inner_cases(cases=lambda np_: [(np_, case("checkpoint", "mpi_checkpoint.py", timeout=400))],
                         share=SHARED_JOBS)
@pytest.mark.parametrize("np_", NPS, ids=[f"np{n}" for n in NPS])
def test_checkpoint_multirank(np_, inner_results):
    inner_results["checkpoint"].assert_all_passed(min_passed=5)
