"""Outer tests for PowerSGD (issue 28): run ``tests/mpi/mpi_powersgd.py`` under mpirun with 2 and
3 ranks, in the jobs shared with the other small multi-rank modules (conftest.SHARED_JOBS), and once
more at 2 ranks on the torch.distributed (gloo) backend; require a clean result on every rank."""

import pytest
from conftest import SHARED_JOBS, case

NPS = [2, 3]


@pytest.mark.inner_cases(cases=lambda np_: [(np_, case("powersgd", "mpi_powersgd.py", timeout=180))],
                         share=SHARED_JOBS)
@pytest.mark.parametrize("np_", NPS, ids=[f"np{n}" for n in NPS])
def test_powersgd_reference_optimizer_checkpoint_and_bad_input(np_, inner_results):
    inner_results["powersgd"].assert_all_passed(min_passed=5)


@pytest.mark.inner_cases(cases=lambda: [(2, case("powersgd-tdist", "mpi_powersgd.py", env={"HVPS_BACKEND": "tdist"},
                                                 timeout=180))])
def test_powersgd_on_the_tdist_backend_np2(inner_results):
    inner_results["powersgd-tdist"].assert_all_passed(min_passed=5)
