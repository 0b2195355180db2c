"""Inner multi-rank tests: process sets, and argument errors that leave every rank in step."""

import copy
import os
import re

import numpy as np
import pytest

os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"  # before hvps reads it, as Horovod's own tests do

from hvps_testutil import all_inputs, assert_exact, check_allreduce_result, random_array  # noqa: E402

import hvps  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvps.init()
    yield


@pytest.fixture
def halves():
    """Two sets registered on every rank: the even ranks and the odd ranks (this rank's first)."""
    size, rank = hvps.size(), hvps.rank()
    even = hvps.add_process_set([r for r in range(size) if r % 2 == 0])
    odd = hvps.add_process_set([r for r in range(size) if r % 2 == 1])
    mine, other = (even, odd) if rank % 2 == 0 else (odd, even)
    yield mine, other
    assert hvps.remove_process_set(odd)
    assert hvps.remove_process_set(even)


def test_set_queries(halves):
    mine, other = halves
    assert mine.included() and not other.included()
    assert mine.ranks[mine.rank()] == hvps.rank()
    assert other.rank() == -1
    assert mine.size() == len(mine.ranks)
    assert mine != other
    twin = copy.copy(mine)  # another object for the same registered set: equal by id, same hash
    assert twin is not mine and twin == mine and hash(twin) == hash(mine) and {mine: 1}[twin] == 1
    assert hvps.ProcessSet(list(mine.ranks)) != mine, "an unregistered set equals only itself"
    assert hvps.global_process_set.size() == hvps.size()


@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "int16", "int32", "float16"])
@pytest.mark.parametrize("op", ["Sum", "Average", "Max"])
def test_allreduce_on_set(halves, dtype, op, request):
    mine, _ = halves
    key = request.node.name
    inputs = all_inputs(dtype, (5, 3), key, hvps.size(), op) if dtype not in ("int8", "int16") else \
        [(random_array(np.int32, (5, 3), key, r) // 64).astype(dtype) for r in range(hvps.size())]
    result = hvps.allreduce(inputs[hvps.rank()].copy(), op=getattr(hvps, op), process_set=mine)
    check_allreduce_result(result, [inputs[r] for r in mine.ranks], op, mine.size())


def test_allgather_broadcast_alltoall_reducescatter_on_set(halves, request):
    mine, _ = halves
    key, me, members = request.node.name, hvps.rank(), mine.ranks
    rows = {r: r + 1 for r in members}
    gathered = [random_array(np.float64, (rows[r], 2), key + "g", r) for r in members]
    assert_exact(hvps.allgather(gathered[mine.rank()], process_set=mine), np.concatenate(gathered))
    for root in members:
        data = random_array(np.float32, (4,), key + f"b{root}", root)
        mine_in = data if me == root else np.zeros(4, np.float32)
        assert_exact(hvps.broadcast(mine_in, root, process_set=mine), data)
    splits = {r: [1 + (r + i) % 2 for i in range(len(members))] for r in members}
    sent = {r: random_array(np.int64, (sum(splits[r]), 3), key + "a", r) for r in members}
    out, received = hvps.alltoall(sent[me], splits=splits[me], process_set=mine)
    i = mine.rank()
    expect = [sent[r][sum(splits[r][:i]): sum(splits[r][:i + 1])] for r in members]
    assert_exact(out, np.concatenate(expect))
    assert list(received) == [splits[r][i] for r in members]
    blocks = [random_array(np.float64, (2 * len(members), 3), key + "r", r) for r in members]
    total = np.sum(blocks, axis=0)
    np.testing.assert_allclose(hvps.reducescatter(blocks[i], op=hvps.Sum, process_set=mine),
                               total[2 * i: 2 * i + 2], rtol=1e-12)


def test_sets_run_side_by_side_with_global_ops(halves, request):
    """Interleaved collectives on both sets and the global set, asynchronous, all correct."""
    mine, _ = halves
    key, size, me = request.node.name, hvps.size(), hvps.rank()
    xs = all_inputs(np.float64, (64,), key, size)
    handles = [(hvps.allreduce_async(xs[me].copy(), op=hvps.Sum, process_set=mine), mine.ranks),
               (hvps.allreduce_async(xs[me].copy(), op=hvps.Sum), list(range(size))),
               (hvps.allreduce_async(2 * xs[me], op=hvps.Sum, process_set=mine), mine.ranks)]
    for number, (handle, ranks) in enumerate(handles):
        factor = 2 if number == 2 else 1
        check_allreduce_result(handle.wait(), [factor * xs[r] for r in ranks], "Sum", len(ranks))
    hvps.barrier(process_set=mine)
    hvps.barrier()


def test_outside_rank_gets_value_error_and_stays_in_step(halves, request):
    _, other = halves
    with pytest.raises(ValueError):
        hvps.allreduce(np.ones(3), process_set=other)
    with pytest.raises(ValueError):
        hvps.barrier(process_set=other)
    # nothing was submitted: the next unnamed global collective matches on every rank
    xs = all_inputs(np.float32, (7,), request.node.name, hvps.size())
    check_allreduce_result(hvps.allreduce(xs[hvps.rank()], op=hvps.Sum), xs, "Sum", hvps.size())


def test_broadcast_root_outside_set_is_refused(halves):
    mine, other = halves
    with pytest.raises(ValueError):
        hvps.broadcast(np.ones(2), other.ranks[0] if other.ranks else hvps.size(), process_set=mine)


def test_objects_on_set(halves):
    mine, _ = halves
    root = mine.ranks[-1]
    got = hvps.broadcast_object({"root": hvps.rank()} if hvps.rank() == root else None, root, process_set=mine)
    assert got == {"root": root}
    assert hvps.allgather_object(hvps.rank(), process_set=mine) == mine.ranks


def test_removed_set_is_refused():
    ps = hvps.add_process_set([hvps.size() - 1])
    assert hvps.remove_process_set(ps)
    assert not hvps.remove_process_set(ps)
    with pytest.raises(ValueError):
        hvps.allreduce(np.ones(2), process_set=ps)


def test_dynamic_sets_as_horovod_numbers_them():
    """Duplicates (of the global set, of a registered set, in any order) are ValueErrors; removed ids are
    reused oldest first; the table is what Horovod's ``_get_process_set_ids_and_ranks`` reports."""
    from hvps.runtime.basics import _get_process_set_ids_and_ranks as table

    size = hvps.size()
    everyone = list(range(size))
    assert table() == {0: everyone}
    first, rest = hvps.add_process_set([0]), hvps.add_process_set(range(size - 1, 0, -1))
    assert rest.ranks == everyone[1:]
    assert table() == {0: everyone, first.process_set_id: [0], rest.process_set_id: everyone[1:]}
    assert str(first) == f"ProcessSet(process_set_id={first.process_set_id}, ranks=[0], mpi_comm=None)"
    assert str(hvps.global_process_set) == f"ProcessSet(process_set_id=0, ranks={everyone}, mpi_comm=None)"
    for duplicate in (everyone, list(reversed(everyone[1:]))):
        with pytest.raises(ValueError, match="duplicates"):
            hvps.add_process_set(duplicate)
    freed = first.process_set_id
    assert hvps.remove_process_set(first) and first.process_set_id is None
    again = hvps.add_process_set([0, size - 1] if size > 2 else [0])
    assert again.process_set_id == freed
    assert not hvps.remove_process_set(hvps.global_process_set)
    assert hvps.remove_process_set(again) and hvps.remove_process_set(rest)
    assert table() == {0: everyone}


@pytest.mark.parametrize("ranks", [[], [0, 99], [-1]], ids=["empty", "past-the-end", "negative"])
def test_dynamic_set_with_ranks_outside_the_job_is_refused_everywhere(ranks, request):
    with pytest.raises(ValueError, match="outside the job|at least one rank"):
        hvps.add_process_set(ranks)
    xs = all_inputs(np.float32, (2,), request.node.name, hvps.size())  # nothing was submitted
    check_allreduce_result(hvps.allreduce(xs[hvps.rank()], op=hvps.Sum), xs, "Sum", hvps.size())


def test_dynamic_set_that_differs_across_ranks_is_a_value_error_on_every_rank(request):
    size, me = hvps.size(), hvps.rank()
    with pytest.raises(ValueError, match=r"ranks \[0\]: add_process_set"):
        hvps.add_process_set([0] if me == 0 else [size - 1])
    # the ranks stay in step: the next set gets the same id everywhere, and works
    ps = hvps.add_process_set([size - 1])
    assert hvps.allgather_object(ps.process_set_id) == [ps.process_set_id] * size
    assert hvps.remove_process_set(ps)
    xs = all_inputs(np.float32, (2,), request.node.name, size)
    check_allreduce_result(hvps.allreduce(xs[me], op=hvps.Sum), xs, "Sum", size)


def test_argument_errors_leave_every_rank_in_step(request):
    """Each refused call raises on every rank before submitting; unnamed names stay aligned."""
    size, me = hvps.size(), hvps.rank()
    with pytest.raises(ValueError):
        hvps.alltoall(np.ones(size + 1))  # dim 0 not divisible
    with pytest.raises(ValueError):
        hvps.alltoall(np.ones(size), splits=np.ones(size, dtype=np.float32))  # float splits
    with pytest.raises(ValueError):
        hvps.reducescatter(np.float32(1.0))  # scalar
    with pytest.raises(NotImplementedError):
        hvps.reducescatter(np.ones(4), op=hvps.Adasum)
    with pytest.raises(TypeError):
        hvps.grouped_allreduce([np.ones(2), np.ones(2, dtype=np.uint32)])  # the second is refused: none sent
    xs = all_inputs(np.float64, (3,), request.node.name, size)
    check_allreduce_result(hvps.grouped_allreduce([xs[me]], op=hvps.Sum)[0], xs, "Sum", size)


def test_duplicate_name_is_a_value_error_and_submits_nothing():
    size, rank = hvps.size(), hvps.rank()
    if rank == 0:  # the others submit after the barrier: rank 0's collectives are surely in flight
        first = hvps.allreduce_async(np.ones(4), name="dup", op=hvps.Sum)
        with pytest.raises(ValueError):
            hvps.allreduce_async(np.ones(4), name="dup")
        # a grouped call that collides in its second part submits none of its parts
        other = hvps.allgather_async(np.ones(1), name="grp.1")
        with pytest.raises(ValueError):
            hvps.grouped_allgather([np.ones(1), np.ones(1)], name="grp")
    hvps.barrier()
    if rank != 0:
        first = hvps.allreduce_async(np.ones(4), name="dup", op=hvps.Sum)
        other = hvps.allgather_async(np.ones(1), name="grp.1")
    assert_exact(first.wait(), np.full(4, float(size)))
    other.wait()
    assert_exact(hvps.grouped_allgather([np.ones(1), np.zeros(1)], name="grp")[1], np.zeros(size))


def _mpi_launched() -> bool:
    """Whether this job runs on MPI (mpirun) rather than hvpsrun --gloo's rendezvous."""
    return not os.environ.get("HVPS_RENDEZVOUS_ADDR")


def _first_init_refuses(process_sets, match):
    """A job's first init with ``process_sets`` raises ValueError matching ``match``, and leaves hvps down."""
    with pytest.raises(ValueError, match=match):
        hvps.init(process_sets=process_sets)
    assert not hvps.is_initialized()


def test_unnamed_collectives_are_numbered_afresh_after_a_restart(request):
    """Automatic names are numbered per job life: after shutdown and init (as in an elastic reset, where new ranks
    start from nothing) every rank numbers from 0 again, whatever it ran before, and a set id that the restarted
    engine gives to other ranks does not inherit the old set's numbers (which its new members never had)."""
    size, me = hvps.size(), hvps.rank()
    alone = hvps.add_process_set([0])
    if me == 0:
        for _ in range(3):
            hvps.allreduce(np.ones(2), process_set=alone)
    hvps.allreduce(np.ones(2))
    assert hvps.remove_process_set(alone)
    hvps.shutdown()
    hvps.init()
    xs = all_inputs(np.float64, (5,), request.node.name, size)
    handle = hvps.allreduce_async(xs[me], op=hvps.Sum)
    assert handle.name == "allreduce.noname.0"
    check_allreduce_result(handle.wait(), xs, "Sum", size)
    if size > 2:  # the restarted engine's first set again, now with rank 1 in it (at 2 ranks: the global set)
        pair = hvps.add_process_set([0, 1])
        if me < 2:
            assert_exact(hvps.allreduce(xs[me], op=hvps.Sum, process_set=pair), xs[0] + xs[1])
        assert hvps.remove_process_set(pair)


def test_static_sets_given_to_init(request):
    """Last in this module: re-initialises hvps with sets registered at init (and refused ones)."""
    from hvps.runtime.basics import _get_process_set_ids_and_ranks as table

    size, me = hvps.size(), hvps.rank()
    everyone = list(range(size))
    hvps.shutdown()
    try:
        # bad input: the same ValueError on every rank, naming the ranks, before anything starts
        _first_init_refuses([hvps.ProcessSet([0, size])], re.escape(f"(given by ranks {everyone}; ranks [{size}] "
                                                                    "are outside the job)"))
        _first_init_refuses([hvps.ProcessSet([])], re.escape(f"an empty set (given by ranks {everyone})"))
        _first_init_refuses([hvps.ProcessSet([0] if me == 0 else [size - 1])],
                            re.escape(f"differs across ranks: ranks [0] passed [[0]]; ranks {everyone[1:]} passed "
                                      f"[[{size - 1}]]"))
        _first_init_refuses([[0]] if me == 0 else [["zero"]], r"rank [1-9]\d*: process set ranks must be integers")
        # duplicates: registered once, then a ValueError; hvps runs with the other sets
        first, dup_all, dup_first = hvps.ProcessSet([0]), hvps.ProcessSet(reversed(everyone)), hvps.ProcessSet([0])
        with pytest.raises(ValueError, match="entry 1 .* duplicates the global process set; entry 2 .* duplicates "
                                             "entry 0"):
            hvps.init(process_sets=[first, dup_all, dup_first])
        assert hvps.is_initialized()
        assert first.process_set_id == 1 and dup_all.process_set_id is None and dup_first.process_set_id is None
        assert table() == {0: everyone, 1: [0]}
        # a later init registers nothing: it gives the sets it is passed their ids
        again = hvps.ProcessSet([0])
        hvps.init(process_sets=[again])
        assert again.process_set_id == 1 and again.included() == (me == 0)
        with pytest.raises(ValueError, match="not registered"):
            hvps.init(process_sets=[hvps.ProcessSet([size - 1])])
        xs = all_inputs(np.float64, (3,), request.node.name, size)
        if me == 0:
            assert_exact(hvps.allreduce(xs[0], op=hvps.Sum, process_set=again), xs[0])
        check_allreduce_result(hvps.allreduce(xs[me], op=hvps.Sum), xs, "Sum", size)
        hvps.shutdown()
        if _mpi_launched():
            _sets_from_communicators(size, me, everyone)
    finally:
        hvps.shutdown()
        hvps.init()


def _sets_from_communicators(size, me, everyone):
    """Sets built from mpi4py communicators stand for every group they have on the ranks (Horovod's order:
    the communicators' groups first, sorted, then the lists of ranks)."""
    from hvps.runtime.basics import _get_process_set_ids_and_ranks as table
    from mpi4py import MPI

    halves = MPI.COMM_WORLD.Split(color=me % 2, key=me)
    try:
        mine = hvps.ProcessSet(halves)
        assert mine.ranks is None and mine.included() is None  # known once registered
        extra = [hvps.ProcessSet([0])] if size > 2 else []  # at 2 ranks, [0] is the even half
        hvps.init(comm=MPI.COMM_WORLD, process_sets=[*extra, mine])
        evens, odds = everyone[0::2], everyone[1::2]
        assert table() == {0: everyone, 1: evens, 2: odds, **({3: [0]} if extra else {})}
        assert mine.process_set_id == (1 if me % 2 == 0 else 2) and mine.ranks == (evens if me % 2 == 0 else odds)
        assert hvps.global_process_set.mpi_comm is MPI.COMM_WORLD
        assert hvps.allgather_object(me, process_set=mine) == mine.ranks
        hvps.shutdown()
        assert hvps.global_process_set.mpi_comm is None
    finally:
        halves.Free()
