"""The sharded store's checkpoints as untrusted input, at 2 and 3 ranks, with and without
HVPS_CHECKPOINT_KEY (tests/mpi/mpi_store_untrusted.py): FIFOs, external storage, paths out of the
folder, absurd shapes, broken manifests and edited optimizer state each end in a CheckpointError on
every rank and a fallback that changes no row; stray folders are ignored and temporaries removed."""

import pytest
from conftest import SHARED_JOBS, case

DEADLINE = 2  # HVPS_CHECKPOINT_INSPECT_TIMEOUT: the hanging-heap case waits this long
KEY = "store-untrusted-test-key-0123456789"


def _cases(np_, keyed):
    env = {"HVPS_CHECKPOINT_INSPECT_TIMEOUT": DEADLINE}
    name = "store-untrusted"
    args = ["mpi_store_untrusted.py"]
    if keyed:  # the defects whose refusal does not hang on the signature (plus the forged chains)
        env["HVPS_CHECKPOINT_KEY"] = KEY
        name += "-key"
        args += ["-k", "fifo or heap or steps or escapes or symlink or external"]
    return [(np_, case(name, *args, env=env, timeout=240))]


@pytest.mark.inner_cases(cases=_cases, share=SHARED_JOBS)
@pytest.mark.parametrize("keyed", [False, True], ids=["nokey", "key"])
@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_store_checkpoints_are_untrusted_input(np_, keyed, inner_results):
    result = inner_results["store-untrusted" + ("-key" if keyed else "")]
    result.assert_all_passed(min_passed=10 if keyed else 16)
