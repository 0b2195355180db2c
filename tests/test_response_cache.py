"""The response cache on its own: rank 0's and the workers' caches kept alike by recording the
same responses, bits that round-trip through announce/resolve and encode/decode, eviction, the
lag a worker may have behind rank 0, and disagreement reported as an error."""

import random

import pytest

from hvps.control.negotiation import ALLGATHER, ALLREDUCE, ALLTOALL, JOIN, Request, Response, to_wire
from hvps.control.response_cache import ResponseCache
from hvps.core.errors import HvpsError

pytestmark = pytest.mark.unit


def _request(i: int, shape=(4,)) -> Request:
    return Request(f"grad.{i}", ALLREDUCE, "float32", (shape,), "sum")


def _pair(capacity: int, size: int = 2):
    """Rank 0's cache and rank 1's."""
    return ResponseCache(capacity, size, rank=0), ResponseCache(capacity, size, rank=1)


def test_a_request_is_announced_in_full_then_by_its_bit():
    root, worker = _pair(8)
    req = _request(0)
    first = worker.announce([req])
    assert first["requests"] == [to_wire(req)]
    assert root.resolve(1, first) == [(1, req)]
    wire = root.encode_responses([Response(ALLREDUCE, [req.name], requests=[req])])
    assert "requests" in wire[0]  # not cached yet when encoded: sent in full
    assert worker.decode_responses(wire)[0].requests == [req]
    second = worker.announce([req])
    assert second["requests"] == [0] and second["epoch"] == 1
    assert root.resolve(1, second)[0][1] is root._requests[0]
    wire = root.encode_responses([Response(ALLREDUCE, [req.name], requests=[req])])
    assert wire == [{"kind": ALLREDUCE, "bits": [0]}]
    decoded = worker.decode_responses(wire)[0]
    assert decoded.names == [req.name] and decoded.requests == [req] and not decoded.error


def test_a_changed_request_is_not_its_old_bit():
    root, worker = _pair(8)
    root.encode_responses([Response(ALLREDUCE, ["grad.0"], requests=[_request(0)])])
    worker.record(Response(ALLREDUCE, ["grad.0"], requests=[_request(0)]))
    changed = _request(0, shape=(5,))
    assert worker.announce([changed])["requests"] == [to_wire(changed)]


def test_fused_responses_and_allgather_sizes_travel_as_bits():
    root, worker = _pair(8, size=3)
    reqs = [_request(i) for i in range(3)]
    gather = Request("g", ALLGATHER, "float32", ((2, 3),))
    for _ in range(2):
        wire = root.encode_responses([Response(ALLREDUCE, [r.name for r in reqs], requests=list(reqs)),
                                      Response(ALLGATHER, ["g"], requests=[gather], per_rank=[2, 1, 4])])
        decoded = worker.decode_responses(wire)
    assert wire == [{"kind": ALLREDUCE, "bits": [0, 1, 2]}, {"kind": ALLGATHER, "bits": [3], "per_rank": [2, 1, 4]}]
    assert [r.name for r in decoded[0].requests] == ["grad.0", "grad.1", "grad.2"]
    assert decoded[1].per_rank == [2, 1, 4]


def test_an_allgather_or_alltoall_form_has_a_bit_whatever_the_rows():
    root, worker = _pair(2, size=2)
    gather = Request("g", ALLGATHER, "float32", ((2, 3),), splits=(5,))
    swap = Request("t", ALLTOALL, "int64", ((4,),), splits=(1, 3))
    for cache in (root, worker):
        assert cache.form_bit_of(gather) is None
        cache.record(Response(ALLGATHER, ["g"], requests=[gather], per_rank=[2, 3]))
        cache.record(Response(ALLTOALL, ["t"], requests=[swap], per_rank=[[1, 3], [2, 2]]))
    bits = {root.form_bit_of(gather), root.form_bit_of(swap)}
    assert None not in bits and len(bits) == 2 and not bits & set(root._requests), "a form's bit is its own"
    for cache in (root, worker):  # other rows, no out: the same form, on every rank the same bit
        assert cache.form_bit_of(Request("g", ALLGATHER, "float32", ((7, 3),))) == root.form_bit_of(gather)
        assert cache.form_bit_of(Request("t", ALLTOALL, "int64", ((9,),), splits=(9, 0))) == root.form_bit_of(swap)
        assert cache.request_of_form(root.form_bit_of(gather)) == gather
        for other in (Request("g", ALLGATHER, "float32", ((2, 4),)), Request("g", ALLGATHER, "float64", ((2, 3),)),
                      Request("g", ALLGATHER, "float32", ((2, 3, 1),)), Request("g2", ALLGATHER, "float32", ((2, 3),))):
            assert cache.form_bit_of(other) is None, other
    for cache in (root, worker):  # capacity 2: a third form evicts the least recently used, alike on every rank
        cache.record(Response(ALLGATHER, ["h"], requests=[Request("h", ALLGATHER, "float32", ((1,),))], per_rank=[1, 1]))
        assert cache.form_bit_of(gather) is None and cache.form_bit_of(swap) is not None
    assert worker.form_bit_of(swap) == root.form_bit_of(swap)


def test_errors_and_control_responses_are_never_cached():
    cache = ResponseCache(8, 2)
    cache.record(Response(ALLREDUCE, ["x"], error="mismatch", requests=[_request(0)]))
    cache.record(Response(JOIN, ["join"], last_joined=1))
    assert len(cache) == 0 and cache.epoch == 2


def test_capacity_zero_turns_the_cache_off():
    root, worker = _pair(0)
    for _ in range(3):
        wire = root.encode_responses([Response(ALLREDUCE, ["grad.0"], requests=[_request(0)])])
        worker.decode_responses(wire)
        assert "requests" in wire[0]
        assert worker.announce([_request(0)])["requests"] == [to_wire(_request(0))]


def test_eviction_is_least_recently_used_and_bits_are_never_reused():
    cache = ResponseCache(2, 2)
    for i in (0, 1, 0, 2):  # 0 used again before 2 arrives: 1 is the least recently used
        cache.record(Response(ALLREDUCE, [f"grad.{i}"], requests=[_request(i)]))
    assert set(cache._bits) == {_request(0), _request(2)}
    assert cache._bits[_request(2)] == 2  # 1's bit is not handed out again


def test_only_rank_0_with_workers_keeps_evicted_requests():
    """Workers never resolve another rank's bits, and a rank alone has no workers to wait for:
    neither may accumulate evicted requests (names that change every step would grow it forever)."""
    for cache in (ResponseCache(1, 2, rank=1), ResponseCache(1, 1, rank=0)):
        for i in range(50):
            cache.record(Response(ALLREDUCE, [f"grad.{i}"], requests=[_request(i)]))
        assert len(cache) == 1 and not cache._retired


def test_a_lagging_worker_may_name_a_bit_rank_0_has_evicted():
    root, worker = _pair(1)
    root.encode_responses([Response(ALLREDUCE, ["grad.0"], requests=[_request(0)])])
    worker.decode_responses([to_wire(Response(ALLREDUCE, ["grad.0"], requests=[_request(0)]))])
    stale = worker.announce([_request(0)])  # bit 0, from before the eviction below
    root.encode_responses([Response(ALLREDUCE, ["grad.1"], requests=[_request(1)])])  # evicts bit 0
    assert root.resolve(1, stale) == [(1, _request(0))]
    # once the worker reports an epoch past the eviction, rank 0 forgets the evicted request
    worker.record(Response(ALLREDUCE, ["grad.1"], requests=[_request(1)]))
    root.resolve(1, worker.announce([]))
    with pytest.raises(HvpsError, match=r"rank 1 named response-cache bit 0"):
        root.resolve(1, stale)


def test_retired_requests_wait_for_every_worker():
    root = ResponseCache(1, 3)
    for i in range(3):
        root.encode_responses([Response(ALLREDUCE, [f"grad.{i}"], requests=[_request(i)])])
    root.resolve(1, {"requests": [], "epoch": 3})  # rank 2 has said nothing yet: keep them
    assert root.resolve(2, {"requests": [0], "epoch": 1}) == [(2, _request(0))]


@pytest.mark.parametrize("message", [{"requests": [99], "epoch": 0}, {"requests": ["0"], "epoch": 0},
                                     {"requests": [True], "epoch": 0}, {"requests": [], "epoch": 5},
                                     {"requests": [], "epoch": "1"}])
def test_disagreement_is_an_error_naming_the_rank(message):
    with pytest.raises(HvpsError, match=r"rank 1 .*caches disagree"):
        ResponseCache(8, 2).resolve(1, message)


def test_random_steps_with_lagging_workers_round_trip():
    """Random workloads, capacity and worker lag: whatever a worker announces, rank 0 resolves
    to exactly that request, and decoded responses equal the ones rank 0 sent."""
    rng = random.Random(1234)
    for trial in range(30):
        capacity, size = rng.choice([1, 2, 3, 8]), rng.choice([2, 3])
        root = ResponseCache(capacity, size)
        workers = {rank: ResponseCache(capacity, size, rank) for rank in range(1, size)}
        sent: list = []  # wire messages from rank 0, in order
        seen = {rank: 0 for rank in workers}
        for _step in range(40):
            for rank, cache in workers.items():  # a worker catches up on some of what was sent
                upto = rng.randint(seen[rank], len(sent))
                for wire in sent[seen[rank]:upto]:
                    cache.decode_responses(wire)
                seen[rank] = upto
                reqs = [_request(rng.randrange(5), shape=(rng.choice([2, 3]),)) for _ in range(rng.randint(0, 3))]
                assert root.resolve(rank, cache.announce(reqs)) == [(rank, r) for r in reqs], f"trial {trial}"
            batch = [Response(ALLREDUCE, [r.name], requests=[r])
                     for r in (_request(rng.randrange(5), shape=(rng.choice([2, 3]),)) for _ in range(rng.randint(0, 3)))]
            sent.append(root.encode_responses(batch))
        for rank, cache in workers.items():  # the same sequence leaves the same cache
            for wire in sent[seen[rank]:]:
                cache.decode_responses(wire)
            assert cache._bits == root._bits and cache.epoch == root.epoch


def test_a_relay_speaks_for_its_subtree_by_spans_and_only_for_it():
    """In a control-plane tree, rank 0 hears from its children; a child's batch names ranges of the ranks
    below it that announced the same bit, and the lowest epoch among them bounds the pruning."""
    root = ResponseCache(8, 5, rank=0, children={1: range(1, 3), 3: range(3, 5)})
    req = _request(0)
    root.encode_responses([Response(ALLREDUCE, [req.name], requests=[req])])
    batch = {"batch": [[0, [[1, 3]]], [to_wire(_request(1)), [[2, 3]]]], "epoch": 1}
    assert root.resolve(1, batch) == [(range(1, 3), req), (2, _request(1))]
    assert root.resolve(3, {"whole": [0], "epoch": 1}) == [(range(3, 5), req)], "every rank of its subtree"
    with pytest.raises(HvpsError, match=r"rank 3 relayed announcements of ranks \[2, 4\], outside its subtree 3..4"):
        root.resolve(3, {"batch": [[0, [[2, 4]]]], "epoch": 1})


def test_a_repeated_allreduce_reuses_its_request_object_and_the_cache_finds_it_by_identity():
    from hvps.api import collectives

    fields = ("allreduce.reused", "float32", ((4,),), "sum", 1.0, 0.5, "cpu", 0)
    first = collectives._allreduce_request(*fields)
    assert collectives._allreduce_request(*fields) is first
    assert first == Request("allreduce.reused", ALLREDUCE, "float32", ((4,),), "sum", postscale=0.5)
    other = collectives._allreduce_request("allreduce.reused", "float32", ((5,),), "sum", 1.0, 0.5, "cpu", 0)
    assert other is not first and other.shapes == ((5,),)
    negative_zero = collectives._allreduce_request("allreduce.zero", "float32", ((4,),), "sum", 1.0, -0.0, "cpu", 0)
    zero = collectives._allreduce_request("allreduce.zero", "float32", ((4,),), "sum", 1.0, 0.0, "cpu", 0)
    assert str(negative_zero.postscale) == "-0.0" and str(zero.postscale) == "0.0", "the zeros' signs are kept"
    cache = ResponseCache(8, 2)
    cache.encode_responses([Response(ALLREDUCE, [first.name], requests=[first])])
    assert cache.announce([collectives._allreduce_request(*fields)])["requests"] == [0]
