"""Inner test (2 and 3 ranks): a rank late to shut down, as in Horovod's test_stall.py at 3 ranks.

Every rank but the last shuts hvps down; the last is still busy past the stall time. Rank 0 then ends hvps on
every rank (Horovod's rule): the late rank's next collective fails at once, naming the ranks that shut down,
its own shutdown is clean (no abort: the job's exit code stays the script's), and hvps starts again after it.
"""

import time

import numpy as np
import pytest

import hvps
from hvps.runtime import state

pytestmark = pytest.mark.timeout(120)

STALL = "2"


def test_a_rank_late_to_shut_down_is_ended_cleanly_and_told_why(monkeypatch):
    monkeypatch.setenv("HVPS_STALL_CHECK_TIME_SECONDS", STALL)
    hvps.init()
    rank, size = hvps.rank(), hvps.size()
    late = size - 1
    np.testing.assert_array_equal(hvps.allreduce(np.ones(3, np.float32), op=hvps.Sum), np.full(3, size, np.float32))
    if rank != late:
        hvps.shutdown()  # waits, at most the stall time, for the late rank, then ends hvps everywhere
    else:
        engine = state._state.engine
        deadline = time.monotonic() + 100  # busy past the stall time: until rank 0 has ended this rank's hvps
        while engine._ended is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(hvps.HvpsError) as raised:
            hvps.allreduce(np.ones(3, np.float32), name="after.the.others.left")
        shut = list(range(size - 1))
        assert f"hvps was shut down: ranks {shut} called hvps.shutdown()" in str(raised.value)
        assert f"rank {late} did not follow within the stall time" in str(raised.value)
        hvps.shutdown()  # clean: nothing left to agree on
    assert not hvps.is_initialized()
    monkeypatch.delenv("HVPS_STALL_CHECK_TIME_SECONDS")
    hvps.init()  # every rank starts again, in step
    np.testing.assert_array_equal(hvps.allreduce(np.ones(2, np.float32), op=hvps.Sum), np.full(2, size, np.float32))
    hvps.shutdown()
