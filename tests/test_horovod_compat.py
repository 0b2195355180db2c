"""Outer tests for Horovod compatibility: process sets, argument errors that keep ranks in step,
the torch adapter's Horovod semantics (gradients, Adasum, SyncBatchNorm, dtypes, join), each
under mpirun at 2 and 3 ranks, on the MPI data plane and on torch.distributed (gloo), in the jobs
shared with the other small multi-rank modules (conftest.SHARED_JOBS)."""

import pytest
from conftest import SHARED_JOBS, case

NPS = [2, 3]
CASES = {
    "process-sets": ("mpi_process_sets.py", {}),
    "torch-compat": ("mpi_torch_compat.py", {}),
    "process-sets-tdist": ("mpi_process_sets.py", {"HVPS_BACKEND": "tdist"}),
    "torch-compat-tdist": ("mpi_torch_compat.py", {"HVPS_BACKEND": "tdist"}),
}


def _cases(np_, case_name):
    module, env = CASES[case_name]
    return [(np_, case(case_name, module, env=env, timeout=300))]


@pytest.mark.inner_cases(cases=_cases, share=SHARED_JOBS)
@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("np_", NPS, ids=[f"np{n}" for n in NPS])
def test_horovod_semantics(np_, case_name, inner_results):
    inner_results[case_name].assert_all_passed()
