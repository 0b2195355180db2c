"""Single-rank runs: hvps.init() in a plain process (no mpirun) works as
world size 1; the generic inner modules run there unchanged (trivial
reductions, every op must still return correct results). The single-process cases share one
process, the multi-rank lifecycle cases one job per rank count."""

import pytest
from conftest import case

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


def _single_cases(case_name):
    module, env = CASES[case_name]
    return [(1, case(case_name, module, env=env, timeout=300))]


@pytest.mark.inner_cases(cases=_single_cases, use_mpirun=False)
@pytest.mark.parametrize("case_name", list(CASES))
def test_single_process(case_name, inner_results):
    inner_results[case_name].assert_all_passed()


def _lifecycle_cases(np_):
    # mpi-init first: it needs a process in which MPI is not initialised yet
    return [(np_, case("mpi-init", "mpi_init_by_hvps.py", timeout=120)),
            (np_, case("lifecycle", "mpi_lifecycle.py", timeout=150)),
            (np_, case("late-shutdown", "mpi_late_shutdown.py", timeout=150))]


@pytest.mark.inner_cases(cases=_lifecycle_cases)
@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_lifecycle_multirank(np_, inner_results):
    inner_results["lifecycle"].assert_all_passed()


@pytest.mark.inner_cases(cases=_lifecycle_cases)
@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_mpi_initialised_by_hvps(np_, inner_results):
    """mpi4py.rc.initialize = False: hvps.init() initialises MPI (threads) and finalizes it at exit."""
    inner_results["mpi-init"].assert_all_passed()


@pytest.mark.inner_cases(cases=_lifecycle_cases)
@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_a_rank_late_to_shut_down(np_, inner_results):
    """Horovod's test_stall.py at 3 ranks: the others shut down, the last rank is busy past the stall time; hvps
    ends on every rank, the late rank's next collective says why, and nobody aborts the job."""
    inner_results["late-shutdown"].assert_all_passed()
