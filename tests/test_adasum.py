"""Adasum's recursive vector halving, checked in one process: ranks are threads exchanging
through queues, and the result is compared with a numpy evaluation of the paper's formula."""

import queue
import threading

import numpy as np
import pytest

from hvps.dataplane.adasum import adasum_allreduce, is_power_of_two

pytestmark = pytest.mark.unit


class ThreadedPlane:
    """``sendrecv`` between threads standing for ranks (the only primitive Adasum needs)."""

    def __init__(self, size: int) -> None:
        self.boxes = {(src, dst): queue.Queue() for src in range(size) for dst in range(size)}

    def endpoint(self, rank: int):
        plane = self

        class Endpoint:
            def sendrecv(self, sendbuf, dest, recvbuf, source):
                plane.boxes[(rank, dest)].put(np.array(sendbuf, copy=True))
                recvbuf[...] = plane.boxes[(source, rank)].get(timeout=10)

        return Endpoint()


def formula(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(1 - a·b / 2‖a‖²) a + (1 - a·b / 2‖b‖²) b, with a zero vector's coefficient taken as 1."""
    dot = float(a @ b)
    return (1 - dot / (2 * (a @ a)) if a @ a else 1.0) * a + (1 - dot / (2 * (b @ b)) if b @ b else 1.0) * b


def tree(vectors: list) -> np.ndarray:
    """Ranks combine pairwise, neighbours first: ((x0 x1)(x2 x3))..."""
    while len(vectors) > 1:
        vectors = [formula(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]


def run(vectors: list) -> list:
    size = len(vectors)
    plane = ThreadedPlane(size)
    buffers = [v.copy() for v in vectors]
    errors = []

    def rank_main(rank):
        try:
            adasum_allreduce(plane.endpoint(rank), buffers[rank], rank, size)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    return buffers


@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("length", [1, 2, 5, 33, 1000])
def test_matches_the_formula(size, length):
    rng = np.random.default_rng(size * 1000 + length)
    vectors = [rng.standard_normal(length) for _ in range(size)]
    expect = tree([v.copy() for v in vectors])
    for result in run(vectors):
        np.testing.assert_allclose(result, expect, rtol=1e-12, atol=1e-12)


def test_identical_vectors_average_and_orthogonal_ones_add():
    same = run([np.full(6, 2.5) for _ in range(4)])
    np.testing.assert_allclose(same[0], np.full(6, 2.5))
    basis = [np.eye(4)[r] * (r + 1) for r in range(4)]
    np.testing.assert_allclose(run(basis)[3], np.arange(1.0, 5.0))


def test_zero_vectors_and_float32():
    vectors = [np.zeros(5, np.float32), np.arange(5, dtype=np.float32)]
    for result in run(vectors):
        assert result.dtype == np.float32
        np.testing.assert_allclose(result, np.arange(5, dtype=np.float32))


def test_every_rank_gets_bitwise_the_same_result():
    rng = np.random.default_rng(7)
    results = run([rng.standard_normal(257) for _ in range(8)])
    for result in results[1:]:
        assert np.array_equal(result, results[0])


def test_non_power_of_two_is_refused():
    assert not is_power_of_two(3) and is_power_of_two(1) and is_power_of_two(16)
    with pytest.raises(ValueError):
        adasum_allreduce(None, np.ones(2), 0, 3)
