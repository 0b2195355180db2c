"""The coordinator's bookkeeping for process sets, without MPI: membership, stalls, set changes."""

import pytest

from hvps.control.negotiation import ADD_SET, ALLGATHER, ALLREDUCE, REMOVE_SET, Coordinator, Request

pytestmark = pytest.mark.unit


def on_set(name, set_id, kind=ALLREDUCE, rows=4):
    return Request(name, kind, "float32", ((rows, 2),), "sum" if kind == ALLREDUCE else "", process_set=set_id)


def add(set_id, ranks):
    return Request(f"{ADD_SET}.{set_id}", ADD_SET, root=set_id, splits=tuple(ranks))


def registered(coordinator, set_id, ranks, size):
    for rank in range(size):
        coordinator.submit(rank, [add(set_id, ranks)], 0)
    (response,) = coordinator.poll(0)
    assert response.kind == ADD_SET and not response.error
    assert coordinator.sets[set_id] == tuple(ranks)


def test_a_set_collective_waits_for_its_members_only():
    c = Coordinator(size=3, fusion_threshold=0, stall_seconds=10)
    registered(c, 1, [0, 2], 3)
    c.submit(0, [on_set("x", 1)], 1)
    assert c.poll(1) == []
    c.submit(2, [on_set("x", 1)], 1)
    (response,) = c.poll(1)
    assert response.names == ["x"] and not response.error


def test_allgather_rows_are_in_set_order():
    c = Coordinator(size=4, fusion_threshold=0, stall_seconds=10)
    registered(c, 5, [1, 3], 4)
    c.submit(3, [on_set("g", 5, ALLGATHER, rows=7)], 0)
    c.submit(1, [on_set("g", 5, ALLGATHER, rows=2)], 0)
    (response,) = c.poll(0)
    assert response.per_rank == [2, 7]


def test_stall_names_the_missing_members_only():
    c = Coordinator(size=4, fusion_threshold=0, stall_seconds=5)
    registered(c, 1, [1, 2, 3], 4)
    c.submit(1, [on_set("late", 1)], 0)
    (response,) = c.poll(6)
    assert "ranks [2, 3]" in response.error and "[0" not in response.error.split("but")[1]


def test_sets_do_not_fuse_with_each_other():
    c = Coordinator(size=2, fusion_threshold=1 << 20, stall_seconds=10)
    registered(c, 1, [0, 1], 2)
    for rank in range(2):
        c.submit(rank, [on_set("a", 0), on_set("b", 1)], 0)
    assert [r.names for r in c.poll(0)] == [["a"], ["b"]]


def test_removed_or_unknown_set_is_an_error():
    c = Coordinator(size=2, fusion_threshold=0, stall_seconds=10)
    registered(c, 1, [0, 1], 2)
    for rank in range(2):
        c.submit(rank, [Request(f"{REMOVE_SET}.1", REMOVE_SET, root=1, splits=(0, 1))], 0)
    assert not c.poll(0)[0].error and 1 not in c.sets
    c.submit(0, [on_set("gone", 1)], 0)
    (response,) = c.poll(0)
    assert "not registered" in response.error


def test_ranks_must_agree_on_a_new_set():
    c = Coordinator(size=2, fusion_threshold=0, stall_seconds=10)
    c.submit(0, [add(1, [0])], 0)
    c.submit(1, [add(1, [1])], 0)
    (response,) = c.poll(0)
    assert "mismatch" in response.error and 1 not in c.sets


def test_a_stall_restarts_the_clock_of_collectives_waiting_for_the_ranks_it_held():
    """Rank 1 waits in 'a' (which stalls); 'b', submitted by the others, waits for rank 1 and must
    get a full window once rank 1 is released instead of stalling just before it arrives."""
    c = Coordinator(size=3, fusion_threshold=0, stall_seconds=10)
    c.submit(1, [on_set("a", 0)], 0)
    c.submit(0, [on_set("b", 0)], 1)
    c.submit(2, [on_set("b", 0)], 1)
    (stalled,) = c.poll(10)
    assert stalled.names == ["a"] and stalled.error
    assert c.poll(10.5) == [] and c.poll(19.5) == []  # b's clock restarted at 10
    c.submit(1, [on_set("b", 0)], 19.6)
    (response,) = c.poll(19.6)
    assert response.names == ["b"] and not response.error


def test_collectives_not_waiting_for_released_ranks_still_stall_on_time():
    c = Coordinator(size=2, fusion_threshold=0, stall_seconds=10)
    c.submit(0, [on_set("a", 0)], 0)
    c.submit(0, [on_set("b", 0)], 1)
    assert [r.names for r in c.poll(10)] == [["a"]]
    assert [r.names for r in c.poll(11)] == [["b"]]  # rank 1 was never held by 'a'
