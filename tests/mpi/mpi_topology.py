"""Inner check that the job runs the data plane and topology the outer test asked for.

The outer test sets HVPS_TEST_EXPECT_BACKEND (the backend's name) and, for
emulated nodes, HVPS_TEST_EXPECT_LOCAL_SIZE.
"""

import os

import numpy as np
import pytest

import hvps

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvps.init()
    yield


def test_backend_is_the_one_asked_for():
    assert hvps.runtime.state.engine().backend.name == os.environ["HVPS_TEST_EXPECT_BACKEND"]


def test_emulated_nodes():
    local_size = int(os.environ.get("HVPS_TEST_EXPECT_LOCAL_SIZE", hvps.size()))
    rank = hvps.rank()
    assert hvps.local_size() == local_size
    assert hvps.local_rank() == rank % local_size
    assert hvps.cross_rank() == rank // local_size
    assert hvps.cross_size() == hvps.size() // local_size


def test_hierarchical_sum_of_ranks_is_exact():
    # Every element's sum over ranks is known exactly; odd length so segments differ by one.
    n = 10_007
    values = np.arange(n, dtype=np.int64) * (hvps.rank() + 1)
    total = hvps.allreduce(values, op=hvps.Sum, name="topology.exact")
    size = hvps.size()
    np.testing.assert_array_equal(total, np.arange(n, dtype=np.int64) * (size * (size + 1) // 2))
