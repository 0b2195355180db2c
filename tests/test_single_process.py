"""Single-rank runs: hvps.init() in a plain process (no mpirun) works as
world size 1; the generic inner modules run there unchanged (trivial
reductions, every op must still return correct results)."""

import pytest
from conftest import run_mpi

CASES = {
    "lifecycle": ("mpi_lifecycle.py", {}),
    "allreduce-mpi": ("mpi_allreduce.py", {"HVPS_ALLREDUCE_ALGORITHM": "mpi"}),
    "allreduce-ring": ("mpi_allreduce.py", {"HVPS_ALLREDUCE_ALGORITHM": "ring"}),
    "collectives": ("mpi_collectives.py", {}),
    "async": ("mpi_async.py", {}),
    "torch": ("mpi_torch.py", {}),
    "torch-train": ("mpi_torch_train.py", {}),
    "collectives-tdist": ("mpi_collectives.py", {"HVPS_BACKEND": "tdist"}),
    "torch-tdist": ("mpi_torch.py", {"HVPS_BACKEND": "tdist"}),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", list(CASES))
def test_single_process(case, tmp_path):
    module, env = CASES[case]
    env = dict(env, HVPS_TEST_SHARED_DIR=str(tmp_path))
    result = run_mpi(module, 1, env=env, timeout=300, use_mpirun=False)
    result.assert_all_passed()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_lifecycle_multirank(np_, tmp_path):
    result = run_mpi("mpi_lifecycle.py", np_, env={"HVPS_TEST_SHARED_DIR": str(tmp_path)},
                     timeout=150)
    result.assert_all_passed()
