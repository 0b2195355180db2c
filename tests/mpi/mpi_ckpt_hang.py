"""Inner 2-rank test (run by tests/test_checkpoint_hang.py): a newest version that makes
libhdf5 hang is skipped on every rank, and the older one loads."""

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import hvps
from hvps.checkpoint.manager import CheckpointManager, file_name


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvps.init()
    yield


def test_latest_skips_a_hanging_version_on_all_ranks(shared_dir):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from ckpt_forge import corrupt_global_heap

    d = shared_dir / "hang"
    mgr = CheckpointManager(d, keep_last=5)
    for e in range(2):
        mgr.save(e, model={"w": np.full(1000, e, np.float32)})
    if hvps.rank() == 0:
        corrupt_global_heap(d / file_name(1))
    hvps.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mgr.load() == 1
    assert mgr.loaded.epoch == 0 and (mgr.loaded.model["w"] == 0).all()
    assert any("took over" in str(w.message) for w in caught), [str(w.message) for w in caught]
