"""Outer tests for Horovod compatibility: process sets, argument errors that keep ranks in step,
the torch adapter's Horovod semantics (gradients, Adasum, SyncBatchNorm, dtypes, join), each
under mpirun at 2 and 3 ranks, on the MPI data plane and on torch.distributed (gloo)."""

import pytest
from conftest import run_mpi

NPS = [2, 3]
CASES = {
    "process-sets": ("mpi_process_sets.py", {}),
    "torch-compat": ("mpi_torch_compat.py", {}),
    "process-sets-tdist": ("mpi_process_sets.py", {"HVPS_BACKEND": "tdist"}),
    "torch-compat-tdist": ("mpi_torch_compat.py", {"HVPS_BACKEND": "tdist"}),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("np_", NPS, ids=[f"np{n}" for n in NPS])
def test_horovod_semantics(np_, case, tmp_path):
    module, env = CASES[case]
    result = run_mpi(module, np_, env=dict(env, HVPS_TEST_SHARED_DIR=str(tmp_path)), timeout=300)
    result.assert_all_passed()
