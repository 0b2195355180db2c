"""Inner test: init / ops / shutdown lifecycle in one process (world size 1
in a plain process, or N under mpirun)."""

import numpy as np
import pytest
from hvps_testutil import all_inputs, check_allreduce_result, world_size_env

import hvps

pytestmark = pytest.mark.timeout(120)

MSG = "hvps is not initialized: call hvps.init()"


def test_lifecycle(request):
    assert not hvps.is_initialized()
    with pytest.raises(hvps.HvpsError) as ei:
        hvps.allreduce(np.ones(2, np.float32))
    assert str(ei.value) == MSG
    hvps.init()
    assert hvps.is_initialized()
    size, rank = hvps.size(), hvps.rank()
    assert size == world_size_env()
    xs = all_inputs(np.float32, (1013,), request.node.name, size)
    check_allreduce_result(hvps.allreduce(xs[rank].copy(), op=hvps.Sum), xs, "Sum", size)
    check_allreduce_result(hvps.allreduce_async(xs[rank].copy(), op=hvps.Max).wait(),
                           xs, "Max", size)
    hvps.barrier()
    hvps.shutdown()
    assert not hvps.is_initialized()
    with pytest.raises(hvps.HvpsError) as ei:
        hvps.allreduce(xs[rank].copy(), op=hvps.Sum)
    assert str(ei.value) == MSG
    with pytest.raises(hvps.HvpsError) as ei:
        hvps.rank()
    assert str(ei.value) == MSG
