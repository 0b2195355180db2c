"""Inner test: collectives from many user threads at once.

Unnamed ones from a second thread are refused (their automatic names would
pair them wrongly across ranks); named ones from 8 threads x 100 ops each
all come back right.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import hvps

pytestmark = pytest.mark.timeout(120)

THREADS, OPS = 8, 100


@pytest.fixture(scope="module", autouse=True)
def job():
    hvps.init()
    yield
    hvps.shutdown()


def test_unnamed_from_a_second_thread_is_refused():
    # 64 MiB: still in flight long after the other thread has tried its own
    in_flight = hvps.allreduce_async(np.ones(16 << 20, np.float32))
    errors = []

    def other():
        try:
            hvps.allreduce(np.ones(4, np.float32))
        except hvps.HvpsError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=other, name="worker-2")
    thread.start()
    thread.join()
    assert len(errors) == 1 and "pass name=" in errors[0] and "worker-2" in errors[0]
    assert in_flight.wait()[0] == 1.0  # the average
    thread = threading.Thread(target=lambda: hvps.barrier(), name="worker-3")
    thread.start()  # handing over in turn (nothing unnamed in flight) stays allowed
    thread.join()
    hvps.barrier()


def test_named_from_many_threads_stay_correct():
    rank, size = hvps.rank(), hvps.size()

    def work(t):
        wrong = 0
        for i in range(OPS):
            x = np.full(16, 1000 * t + i + rank, np.float64)
            got = hvps.allreduce(x, op=hvps.Sum, name=f"t{t}.op{i}")
            wrong += not np.array_equal(got, np.full(16, size * (1000 * t + i) + sum(range(size))))
        return wrong

    with ThreadPoolExecutor(THREADS) as pool:
        assert sum(pool.map(work, range(THREADS))) == 0
