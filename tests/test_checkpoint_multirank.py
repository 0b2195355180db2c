"""Run tests/mpi/mpi_checkpoint.py under mpirun with 2 and 3 ranks; every rank must pass
every test (nothing failed, errored or skipped)."""

import pytest
from conftest import run_mpi

NPS = [2, 3]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("np_", NPS, ids=[f"np{n}" for n in NPS])
def test_checkpoint_multirank(np_, tmp_path):
    result = run_mpi("mpi_checkpoint.py", np_, env={"HVPS_TEST_SHARED_DIR": str(tmp_path)}, timeout=400)
    result.assert_all_passed(min_passed=5)
