"""The allreduce schedule shared by the MPI ring, the shared-memory and the sealed data planes
(``hvps/dataplane/schedule.py``), alone: a numpy simulation of n ranks that moves only what the
schedule says, message by message, must give every rank the rank-ordered fold, bit for bit."""

import functools

import numpy as np
import pytest

from hvps.dataplane import schedule
from hvps.dataplane.schedule import Schedule, bounds_of_counts, fold_in_rank_order, segments

SIZES = [1, 2, 3, 4, 5]
COUNTS = [0, 1, 2, 3, 7, 10, 31]
WIDTHS = [1, 2, 3, 1000]


def _contributions(size: int, count: int) -> list:
    """Each rank's float32 buffer, magnitudes mixed so that the folding order changes the bits."""
    rng = np.random.default_rng(size * 1000 + count)
    return [(rng.standard_normal(count) * 10.0 ** rng.integers(-6, 7, count)).astype(np.float32)
            for _ in range(size)]


def _rank_ordered(ufunc, buffers: list) -> np.ndarray:
    return functools.reduce(lambda a, b: ufunc(a, b), buffers)


def _simulate(size: int, bounds: list, width: int, buffers: list, ufunc) -> list:
    """Run the allreduce as every plane does, only through the schedule; return each rank's result."""
    plans = [Schedule(rank, size, bounds, width) for rank in range(size)]
    assert len({(p.rounds, p.width) for p in plans}) == 1, "every rank must run the same rounds"
    results = [np.full_like(buffers[0], np.nan) for _ in range(size)]
    for r in range(plans[0].rounds):  # reduce-scatter: pairwise exchange, then the owner's fold
        wire = {}
        for sender, plan in enumerate(plans):
            for exchange in plan.exchanges():
                wire[(sender, exchange.to, exchange.step)] = buffers[sender][plan.window(exchange.to, r)]
        for owner, plan in enumerate(plans):
            own = plan.window(owner, r)
            terms = [buffers[owner][own]] * size
            for exchange in plan.exchanges():
                piece = wire.pop((exchange.source, owner, exchange.step))  # sent by the source at the same step
                assert piece.size == own.stop - own.start  # a receive sized by one's own window fits it exactly
                terms[exchange.source] = piece
            if own.stop > own.start:
                fold_in_rank_order(ufunc, terms, results[owner][own])
        assert not wire, f"messages nobody received: {sorted(wire)}"
    holds = [{rank} for rank in range(size)]  # the reduced blocks each rank holds
    for step in range(size - 1):  # ring allgather, all ranks at once
        moves = []
        for sender, plan in enumerate(plans):
            move = plan.gather_steps()[step]
            assert move.step == step and move.send_block in holds[sender], "forwarding a block not yet held"
            receiver = plans[plan.right]
            assert receiver.left == sender and receiver.gather_steps()[step].recv_block == move.send_block
            moves.append((plan.right, move.send_block))
        for receiver, block in moves:
            holds[receiver].add(block)
            for r in range(plans[0].rounds):
                win = plans[receiver].window(block, r)
                results[receiver][win] = results[(receiver - 1) % size][win]
    assert all(held == set(range(size)) for held in holds)
    return results


@pytest.mark.parametrize("size", SIZES)
def test_every_rank_gets_the_rank_ordered_fold_bit_for_bit_on_even_segments(size):
    for count in COUNTS:
        buffers = _contributions(size, count)
        for ufunc in (np.add, np.subtract):  # subtraction: any other order gives another answer
            expected = _rank_ordered(ufunc, buffers)
            for width in WIDTHS:
                for result in _simulate(size, segments(count, size), width, buffers, ufunc):
                    assert np.array_equal(result, expected), (size, count, width, ufunc)


@pytest.mark.parametrize("size", SIZES[1:])
def test_uneven_and_empty_blocks_from_counts(size):
    rng = np.random.default_rng(size)
    for _ in range(6):
        counts = [int(c) for c in rng.integers(0, 6, size)]
        counts[rng.integers(size)] = 0  # at least one rank owns nothing
        bounds = bounds_of_counts(counts)
        buffers = _contributions(size, sum(counts))
        expected = _rank_ordered(np.add, buffers)
        for width in (1, 2, 4):
            for result in _simulate(size, bounds, width, buffers, np.add):
                assert np.array_equal(result, expected), (counts, width)


@pytest.mark.parametrize("size", SIZES)
def test_windows_tile_each_block_in_the_rounds_of_the_longest(size):
    for count in COUNTS:
        for width in WIDTHS:
            plan = Schedule(0, size, segments(count, size), width)
            longest = max(hi - lo for lo, hi in plan.bounds)
            assert plan.rounds == -(-longest // plan.width) and 1 <= plan.width <= max(1, min(width, longest))
            for block, (lo, hi) in enumerate(plan.bounds):
                covered = [i for r in range(plan.rounds) for i in range(count)[plan.window(block, r)]]
                assert covered == list(range(lo, hi))


def test_partitions():
    assert segments(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert segments(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert bounds_of_counts([2, 0, np.int64(3)]) == [(0, 2), (2, 2), (2, 5)]
    assert bounds_of_counts([]) == []
    assert schedule.window((4, 9), 3, 4) == slice(7, 9) and schedule.window((4, 9), 8, 4) == slice(9, 9)


def test_steps_of_one_rank_and_of_three():
    assert schedule.pairwise_exchanges(0, 1) == [] and schedule.ring_gather_steps(0, 1) == []
    assert [(e.step, e.to, e.source) for e in schedule.pairwise_exchanges(1, 3)] == [(1, 2, 0), (2, 0, 2)]
    assert [(g.step, g.send_block, g.recv_block) for g in schedule.ring_gather_steps(0, 3)] == [(0, 0, 2), (1, 2, 1)]
    assert schedule.ring_neighbours(0, 3) == (1, 2)


def test_fold_may_write_over_the_first_two_terms_and_copies_a_lone_term():
    a, b, c = (np.array([1.0, 2.0]), np.array([10.0, 20.0]), np.array([100.0, 200.0]))
    fold_in_rank_order(np.subtract, [a, b, c], a)
    assert a.tolist() == [-109.0, -218.0]
    a = np.array([1.0, 2.0])
    fold_in_rank_order(np.subtract, [a, b, c], b)
    assert b.tolist() == [-109.0, -218.0]
    out = np.zeros(2)
    fold_in_rank_order(np.add, [c], out)
    assert out.tolist() == [100.0, 200.0]
