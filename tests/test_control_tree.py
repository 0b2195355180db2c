"""The control-plane tree without processes: its shape, a relay's merge, and rank 0's matching of the
ranges of ranks that relays report (the multi-rank side: ``tests/mpi`` under HVPS_CONTROL_FANOUT=1, and
``test_dead_ranks.py``'s ``-tree`` cases)."""

import random

import pytest

from hvps.control.negotiation import ALLGATHER, ALLREDUCE, JOIN, Coordinator, Request
from hvps.control.relay import RelayBuffer
from hvps.control.tree import position
from hvps.core.errors import HvpsError

pytestmark = pytest.mark.unit


def allreduce(name, shape=(4,)):
    return Request(name, ALLREDUCE, "float32", (shape,), "sum")


@pytest.mark.parametrize("size,fanout", [(1, 1), (2, 1), (3, 1), (7, 2), (33, 32), (34, 32), (100, 3), (1024, 32),
                                         (4096, 16)])
def test_every_rank_has_one_parent_and_every_subtree_is_a_block(size, fanout):
    tree = [position(rank, size, fanout) for rank in range(size)]
    assert tree[0].parent is None and tree[0].subtree == range(size)
    for here in tree:
        assert len(here.blocks) <= fanout
        assert here.subtree.start == here.rank
        # the children's blocks cut the rest of the subtree into consecutive pieces, sizes within one
        below = [rank for block in here.blocks for rank in block]
        assert below == list(range(here.rank + 1, here.subtree.stop))
        assert max(map(len, here.blocks), default=0) - min(map(len, here.blocks), default=0) <= 1
        for block in here.blocks:
            assert tree[block.start].parent == here.rank and tree[block.start].subtree == block
    if size - 1 <= fanout:
        assert all(here.parent in (None, 0) for here in tree), "a job within the fan-out is a star"


def test_depth_grows_with_the_log_of_the_job():
    def hops(rank, size, fanout):
        count, here = 0, position(rank, size, fanout)
        while here.parent is not None:
            count, here = count + 1, position(here.parent, size, fanout)
        return count

    assert max(hops(r, 1024, 32) for r in range(1024)) == 2
    assert max(hops(r, 64, 8) for r in range(64)) == 2


def test_a_fanout_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        position(0, 4, 0)


def test_a_relay_holds_a_bit_until_its_whole_block_announced_it_then_sends_one_span():
    # rank 4; children 5 (ranks 5-7) and 8 (ranks 8, 9)
    relay = RelayBuffer(range(4, 10), blocks=(range(5, 8), range(8, 10)), hold_s=0.010)
    relay.add(4, {"requests": [3, 7], "epoch": 12}, now=0.0)
    relay.add(8, {"whole": [3], "batch": [[7, [[9, 10]]]], "epoch": 11}, now=0.0)
    assert relay.take(0.001, epoch_now=12) is None, "ranks 5-7 have not announced yet"
    relay.add(5, {"batch": [[3, [[6, 8]]], [3, [[5, 6]]]], "epoch": 12}, now=0.002)
    assert relay.take(0.002, epoch_now=12) == {"whole": [3], "epoch": 11}, \
        "bit 3 is complete: one integer for the whole block; bit 7 stays (and bounds the epoch)"
    assert relay.deadline() == pytest.approx(0.010)
    assert relay.take(0.009, epoch_now=13) is None
    assert relay.take(0.011, epoch_now=13) == {"batch": [[7, [[4, 5], [9, 10]]]], "epoch": 11}, \
        "after the hold, bit 7 goes up as it is, so that rank 0 can name ranks 5-8"
    assert not relay and relay.deadline() is None


def test_a_relay_waits_only_for_the_members_of_a_bits_process_set():
    relay = RelayBuffer(range(1, 4), blocks=(range(2, 3), range(3, 4)), hold_s=10.0,
                        expected=lambda bit: 2 if bit == 5 else 3)
    relay.add(1, {"requests": [5], "epoch": 0}, now=0.0)
    relay.add(3, {"requests": [5], "epoch": 0}, now=0.0)
    assert relay.take(0.0, epoch_now=0)["batch"] == [[5, [[1, 2], [3, 4]]]]


def test_a_relay_passes_full_requests_up_at_once_one_per_rank():
    relay = RelayBuffer(range(1, 3), blocks=(range(2, 3),), hold_s=10.0)
    full = {"name": "x", "kind": "allreduce"}
    relay.add(1, {"requests": [full], "epoch": 0}, now=5.0)
    assert relay.deadline() == 0.0
    assert relay.take(5.0, epoch_now=0)["batch"] == [[full, [[1, 2]]]]
    relay.add(2, {"requests": [dict(full)], "epoch": 0}, now=5.0)
    assert relay.take(5.0, epoch_now=0)["batch"] == [[full, [[2, 3]]]], \
        "uncached requests go up one per rank, so that rank 0 still compares them"


def test_a_relay_reports_the_lowest_epoch_of_its_subtree():
    relay = RelayBuffer(range(1, 4), blocks=(range(2, 3), range(3, 4)), hold_s=0.0)
    relay.add(2, {"requests": [0], "epoch": 9}, now=0.0)
    assert relay.take(0.0, epoch_now=10)["epoch"] == 0, "rank 3 has reported nothing yet"
    relay.add(3, {"requests": [0], "epoch": 8}, now=0.0)
    assert relay.take(0.0, epoch_now=10)["epoch"] == 8
    relay.add(1, {"requests": [0], "epoch": 7}, now=0.0)  # its own, announced before responses arrived
    assert relay.take(0.0, epoch_now=10)["epoch"] == 7


@pytest.mark.parametrize("source,message", [(2, {"batch": [[0, [[1]]]]}), (2, {"batch": [[0, "x"]]}),
                                            (2, {"requests": [None]}), (2, {"requests": ["0"]}), (5, {"whole": [0]})])
def test_a_malformed_message_is_an_error_naming_its_sender(source, message):
    with pytest.raises(HvpsError, match=f"rank {source} sent the control-plane relay a malformed announcement"):
        RelayBuffer(range(1, 3), blocks=(range(2, 3),), hold_s=0.0).add(source, message, now=0.0)


def test_ranges_complete_a_collective_without_being_spelled_out():
    c = Coordinator(size=1000, fusion_threshold=0, stall_seconds=10)
    grad = allreduce("g")
    c.submit(0, [grad], 0)
    c.submit(range(1, 500), [grad], 0)
    assert c.poll(0) == []
    c.submit(range(500, 1000), [grad], 0)
    (response,) = c.poll(0)
    assert response.names == ["g"] and not response.error and not c.busy


def test_a_stall_inside_a_range_names_the_missing_ranks():
    c = Coordinator(size=6, fusion_threshold=0, stall_seconds=10)
    grad = allreduce("g")
    c.submit(0, [grad], 0)
    c.submit(range(1, 3), [grad], 0)
    c.submit(4, [grad], 0)
    (response,) = c.poll(11)
    assert "ranks [0, 1, 2, 4]" in response.error and "ranks [3, 5]" in response.error


def test_a_mismatch_between_a_range_and_a_rank_names_both():
    c = Coordinator(size=4, fusion_threshold=0, stall_seconds=10)
    c.submit(range(0, 3), [allreduce("w", (4, 3))], 0)
    c.submit(3, [allreduce("w", (5, 3))], 0)
    (response,) = c.poll(0)
    assert "ranks [0, 1, 2]" in response.error and "ranks [3]" in response.error


def test_allgather_sizes_come_from_every_rank_of_a_range():
    c = Coordinator(size=4, fusion_threshold=0, stall_seconds=10)
    two = Request("g", ALLGATHER, "float32", ((2, 3),))
    c.submit(range(0, 3), [two], 0)
    c.submit(3, [Request("g", ALLGATHER, "float32", ((5, 3),))], 0)
    (response,) = c.poll(0)
    assert not response.error and response.per_rank == [2, 2, 2, 5]


def test_a_join_in_a_range_counts_each_rank():
    c = Coordinator(size=3, fusion_threshold=0, stall_seconds=10)
    c.submit(range(0, 2), [Request("join", JOIN)], 0)
    c.submit(2, [allreduce("g")], 0)
    (response,) = c.poll(0)
    assert response.names == ["g"] and not response.error, "ranks 0 and 1 joined: the allreduce goes on"


def test_ranges_and_single_ranks_agree_with_the_star():
    """Random partitions of every rank into ranges: the same responses as each rank on its own."""
    rnd = random.Random(7)
    for trial in range(50):
        size = rnd.randint(2, 40)
        names = [f"t{i}" for i in range(rnd.randint(1, 6))]
        star, tree = (Coordinator(size, fusion_threshold=64, stall_seconds=10) for _ in range(2))
        for name in names:
            for rank in range(size):
                star.submit(rank, [allreduce(name)], 0)
            cuts = sorted(rnd.sample(range(1, size), rnd.randint(0, size - 1)))
            for low, high in zip([0, *cuts], [*cuts, size]):
                tree.submit(range(low, high) if high - low > 1 else low, [allreduce(name)], 0)
        assert [(r.names, r.error) for r in tree.poll(1)] == [(r.names, r.error) for r in star.poll(1)], trial
