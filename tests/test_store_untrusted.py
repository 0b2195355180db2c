"""The sharded store's checkpoints as untrusted input, at 2 and 3 ranks, with and without
HVPS_CHECKPOINT_KEY (tests/mpi/mpi_store_untrusted.py): FIFOs, external storage, paths out of the
folder, absurd shapes, broken manifests and edited optimizer state each end in a CheckpointError on
every rank and a fallback that changes no row; stray folders are ignored and temporaries removed."""

import pytest
from conftest import SHARED_JOBS, case

DEADLINE = 2  # HVPS_CHECKPOINT_INSPECT_TIMEOUT: the hanging-heap case waits this long


def _cases(np_):
    env = {"HVPS_CHECKPOINT_INSPECT_TIMEOUT": DEADLINE}
    return [(np_, case("store-untrusted", "mpi_store_untrusted.py", env=env, timeout=240))]


@pytest.mark.inner_cases(cases=_cases, share=SHARED_JOBS)
@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_store_checkpoints_are_untrusted_input(np_, inner_results):
    inner_results["store-untrusted"].assert_all_passed(min_passed=22)
