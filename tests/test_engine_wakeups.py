"""When the engine thread wakes: cycles that last one cycle, and waiters that do not wait for one."""

import math
import random

import pytest

from hvps.core.handle import Handle
from hvps.runtime.engine import poll_timeout

pytestmark = pytest.mark.unit


def test_a_cycle_deadline_gives_select_one_cycle_not_two():
    rng = random.Random(7)
    for _ in range(10_000):
        now = rng.uniform(0, 1e6)
        for cycle in (0.001, 0.002, 0.0005):
            timeout = poll_timeout(now + cycle, now)
            assert timeout <= cycle
            assert math.ceil(timeout * 1e3) == math.ceil(cycle * 1e3 - 1e-9)  # select's millisecond rounding
    assert poll_timeout(5.0, 6.0) == 0.0


def test_a_blocking_wait_expedites_its_collective_once():
    calls = []
    handle = Handle("x", expedite=lambda h: (calls.append("x"), h.set_result(7)))
    assert handle.wait() == 7
    assert handle.wait() == 7
    assert calls == ["x"]


def test_a_finished_collective_is_not_expedited():
    calls = []
    handle = Handle("y", expedite=lambda h: calls.append("y"))
    handle.set_result(1)
    assert handle.wait() == 1
    assert calls == []
