"""The coordinator's bookkeeping, without MPI: matching, mismatches, stalls, fusion, join."""

import pytest

from hvps.control.negotiation import ALLGATHER, ALLREDUCE, BROADCAST, JOIN, SHUTDOWN, Coordinator, Request

pytestmark = pytest.mark.unit

MIB = 1024 * 1024


def allreduce(name, shape=(4,), dtype="float32", op="sum"):
    return Request(name, ALLREDUCE, dtype, (shape,), op)


def test_waits_for_every_rank_then_answers_in_submission_order():
    c = Coordinator(size=3, fusion_threshold=0, stall_seconds=10)
    c.submit(0, [allreduce("a"), allreduce("b")], now=0)
    c.submit(2, [allreduce("b"), allreduce("a")], now=0)
    assert c.poll(now=1) == []
    c.submit(1, [allreduce("b"), allreduce("a")], now=1)
    responses = c.poll(now=1)
    assert [r.names for r in responses] == [["a"], ["b"]]
    assert not any(r.error for r in responses)
    assert not c.busy


def test_horovod_stall_times_warn_at_the_check_time_and_fail_at_the_shutdown_time(caplog):
    c = Coordinator(size=2, fusion_threshold=0, stall_seconds=5, warn_seconds=2)
    c.submit(0, [allreduce("late")], now=100)
    assert c.next_deadline() == 102
    with caplog.at_level("WARNING", logger="hvps"):
        assert c.poll(now=102) == [] and c.poll(now=103) == []
    warned = [r.getMessage() for r in caplog.records if "stall warning" in r.getMessage()]
    assert len(warned) == 1 and "'late'" in warned[0] and "ranks [1]" in warned[0]
    assert c.next_deadline() == 105
    (response,) = c.poll(now=105)
    assert "within 5 s (HVPS_STALL_SHUTDOWN_TIME_SECONDS)" in response.error


def test_mismatched_shapes_name_the_tensor_and_ranks():
    c = Coordinator(size=3, fusion_threshold=0, stall_seconds=10)
    c.submit(0, [allreduce("w", (4, 3))], 0)
    c.submit(1, [allreduce("w", (4, 3))], 0)
    c.submit(2, [allreduce("w", (5, 3))], 0)
    (response,) = c.poll(0)
    assert "'w'" in response.error
    assert "ranks [0, 1]" in response.error and "ranks [2]" in response.error
    assert "(5, 3)" in response.error


def test_mismatched_dtype_and_op_are_errors():
    c = Coordinator(size=2, fusion_threshold=0, stall_seconds=10)
    c.submit(0, [allreduce("d", dtype="float32"), allreduce("o", op="sum")], 0)
    c.submit(1, [allreduce("d", dtype="float64"), allreduce("o", op="max")], 0)
    errors = [r.error for r in c.poll(0)]
    assert "float64" in errors[0] and "float32" in errors[0]
    assert "op=max" in errors[1]


def test_allgather_may_differ_in_first_dimension_only():
    c = Coordinator(size=2, fusion_threshold=0, stall_seconds=10)
    c.submit(0, [Request("g", ALLGATHER, "int32", ((2, 3),))], 0)
    c.submit(1, [Request("g", ALLGATHER, "int32", ((0, 3),))], 0)
    (ok,) = c.poll(0)
    assert not ok.error and ok.per_rank == [2, 0]
    c.submit(0, [Request("h", ALLGATHER, "int32", ((2, 3),))], 0)
    c.submit(1, [Request("h", ALLGATHER, "int32", ((2, 4),))], 0)
    (bad,) = c.poll(0)
    assert "'h'" in bad.error


def test_stall_names_missing_ranks_after_the_stall_time():
    c = Coordinator(size=3, fusion_threshold=0, stall_seconds=5)
    c.submit(0, [allreduce("late")], now=100)
    c.submit(1, [allreduce("late")], now=101)
    assert c.poll(now=104.9) == []
    (response,) = c.poll(now=105)
    assert "'late'" in response.error
    assert "ranks [0, 1]" in response.error and "ranks [2]" in response.error
    assert not c.busy


def test_fusion_merges_compatible_allreduces_up_to_the_threshold():
    c = Coordinator(size=2, fusion_threshold=3 * MIB, stall_seconds=10)
    reqs = [
        allreduce("a", (MIB // 4,)),  # 1 MiB
        allreduce("b", (MIB // 4,)),  # 1 MiB
        allreduce("c", (MIB // 8,), dtype="float64"),  # other dtype: new buffer
        allreduce("d", (MIB // 8,), dtype="float64"),
        allreduce("e", (MIB,), dtype="float64"),  # 8 MiB: over the threshold, alone
        Request("f", BROADCAST, "float32", ((4,),), root=1),
    ]
    for rank in range(2):
        c.submit(rank, reqs, 0)
    assert [r.names for r in c.poll(0)] == [["a", "b"], ["c", "d"], ["e"], ["f"]]


def test_fusion_threshold_zero_disables_fusion():
    c = Coordinator(size=2, fusion_threshold=0, stall_seconds=10)
    for rank in range(2):
        c.submit(rank, [allreduce("a"), allreduce("b")], 0)
    assert [r.names for r in c.poll(0)] == [["a"], ["b"]]


def test_joined_ranks_count_as_submitted_for_allreduce_and_join_reports_the_last():
    c = Coordinator(size=3, fusion_threshold=0, stall_seconds=10)
    c.submit(2, [Request("join", JOIN)], 0)
    c.submit(0, [allreduce("x")], 0)
    c.submit(1, [allreduce("x")], 0)
    (response,) = c.poll(0)
    assert response.names == ["x"] and not response.error
    c.submit(0, [Request("join", JOIN)], 1)
    c.submit(1, [Request("join", JOIN)], 2)
    (joined,) = c.poll(2)
    assert joined.kind == JOIN and joined.last_joined == 1


def test_non_allreduce_after_join_is_an_error():
    c = Coordinator(size=2, fusion_threshold=0, stall_seconds=10)
    c.submit(1, [Request("join", JOIN)], 0)
    c.submit(0, [Request("b", BROADCAST, "float32", ((2,),), root=0)], 0)
    (response,) = c.poll(0)
    assert "join" in response.error and "'b'" in response.error


def test_shutdown_needs_every_rank():
    c = Coordinator(size=2, fusion_threshold=0, stall_seconds=10)
    c.submit(0, [Request("shutdown", SHUTDOWN)], 0)
    assert c.poll(0) == []
    c.submit(1, [Request("shutdown", SHUTDOWN)], 0)
    assert [r.kind for r in c.poll(0)] == [SHUTDOWN]


def test_a_rank_late_to_shut_down_is_ended_after_the_stall_time_not_failed(caplog):
    """Horovod's test_stall.py at 3 ranks: ranks 0 and 1 shut down, rank 2 is still busy (asleep, evaluating,
    saving) past the stall time. Every rank's hvps ends then, the response naming who asked (rank 2's
    engine fails its collectives from then on, saying so); nobody waits for rank 2 forever, and the job is
    not aborted for it: each rank finalizes normally."""
    c = Coordinator(size=3, fusion_threshold=0, stall_seconds=5, warn_seconds=2)
    c.submit(0, [Request("shutdown", SHUTDOWN)], now=100)
    c.submit(1, [Request("shutdown", SHUTDOWN)], now=103)
    assert c.next_deadline() == 105  # from the first rank that asked, not the last
    assert c.poll(now=104.9) == []
    with caplog.at_level("WARNING", logger="hvps"):
        (response,) = c.poll(now=105)
    assert response.kind == SHUTDOWN and response.asked == [0, 1] and not response.error
    (line,) = [r.getMessage() for r in caplog.records]
    assert "ranks [0, 1] shut hvps down 5 s ago and ranks [2] have not (HVPS_STALL_SHUTDOWN_TIME_SECONDS)" in line
    assert not c.busy and c.next_deadline() is None
    # a shutdown every rank asked for names them all
    for rank in range(3):
        c.submit(rank, [Request("shutdown", SHUTDOWN)], now=200)
    (response,) = c.poll(now=200)
    assert response.asked == [0, 1, 2]


def test_a_collective_missing_a_rank_that_shut_down_fails_at_once():
    # rank 1 ended its script (atexit shuts hvps down) while ranks 0 and 2 wait in 'never'
    c = Coordinator(size=3, fusion_threshold=0, stall_seconds=60)
    c.submit(0, [allreduce("never")], now=0)
    c.submit(2, [allreduce("never")], now=0)
    c.submit(1, [Request("shutdown", SHUTDOWN)], now=1)
    (response,) = c.poll(now=1)
    assert response.names == ["never"] and "ranks [0, 2]" in response.error and "ranks [1] shut" in response.error
    # the others then shut down too: the job ends without waiting for any stall time
    c.submit(0, [Request("shutdown", SHUTDOWN)], now=2)
    c.submit(2, [Request("shutdown", SHUTDOWN)], now=2)
    assert [r.kind for r in c.poll(now=2)] == [SHUTDOWN]


def test_a_collective_a_shut_down_rank_is_not_in_is_left_alone():
    c = Coordinator(size=3, fusion_threshold=0, stall_seconds=60)
    c.sets[1] = (0, 2)
    c.submit(0, [Request("pair", ALLREDUCE, "float32", ((4,),), "sum", process_set=1)], now=0)
    c.submit(1, [Request("shutdown", SHUTDOWN)], now=0)
    assert c.poll(now=1) == []
    c.submit(2, [Request("pair", ALLREDUCE, "float32", ((4,),), "sum", process_set=1)], now=1)
    (response,) = c.poll(now=1)
    assert response.names == ["pair"] and not response.error


def failed(name, reason="TypeError: hvps does not support dtype uint32"):
    return Request(name, ALLREDUCE, failure=reason)


def test_a_collective_one_rank_could_not_submit_fails_on_every_rank_at_once():
    c = Coordinator(size=3, fusion_threshold=0, stall_seconds=10)
    c.submit(0, [allreduce("x")], now=0)
    c.submit(1, [failed("x")], now=0)
    (response,) = c.poll(now=0)  # long before the stall time
    assert response.names == ["x"]
    assert "ranks [1]" in response.error and "uint32" in response.error and "'x'" in response.error
    # rank 2 submits it later: the same error, at once, and then the name is forgotten
    c.submit(2, [allreduce("x")], now=1)
    (late,) = c.poll(now=1)
    assert late.names == ["x"] and late.error == response.error
    assert not c.busy
    c.submit(0, [allreduce("x")], now=2)
    assert c.poll(now=2) == []  # a new collective of that name waits as usual


def test_a_collective_every_rank_refused_answers_once_and_leaves_nothing_behind():
    c = Coordinator(size=2, fusion_threshold=0, stall_seconds=10)
    c.submit(0, [failed("y")], now=0)
    (response,) = c.poll(now=0)
    assert "ranks [0]" in response.error
    c.submit(1, [failed("y")], now=0)
    assert c.poll(now=0) == [] and not c.busy
