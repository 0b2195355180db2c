"""Inner multi-rank tests: coordination errors (mismatched shape / dtype, a
rank that never submits) and recovery afterwards.  Needs >= 2 ranks and
HVPS_STALL_CHECK_TIME_SECONDS (3 s in the outer test)."""

import os
import re
import time

import numpy as np
import pytest
from hvps_testutil import all_inputs, check_allreduce_result, random_array

import hvps

pytestmark = pytest.mark.timeout(120)

STALL = float(os.environ.get("HVPS_STALL_CHECK_TIME_SECONDS", "60"))


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvps.init()
    assert hvps.size() >= 2, "mpi_errors.py needs at least 2 ranks"
    yield


def _assert_names(msg, name, ranks):
    assert name in msg, f"tensor name {name!r} missing from error: {msg!r}"
    assert re.search(r"rank", msg, re.I), f"no mention of ranks in error: {msg!r}"
    for r in ranks:
        assert re.search(rf"(?<![\w.]){r}(?![\w.])", msg), \
            f"rank {r} not named in error: {msg!r}"


def _signal_and_wait(shared_dir, tag, waiters, me):
    """Ranks in `waiters` wait until every other rank has written its marker."""
    size = hvps.size()
    (shared_dir / f"{tag}.{me}").write_text("done")
    if me in waiters:
        deadline = time.monotonic() + 60
        others = [r for r in range(size) if r not in waiters]
        while not all((shared_dir / f"{tag}.{r}").exists() for r in others):
            assert time.monotonic() < deadline, f"peers never finished {tag}"
            time.sleep(0.05)


def _healthy(key):
    """A normal round of ops must still work."""
    size, rank = hvps.size(), hvps.rank()
    xs = all_inputs(np.float32, (1013,), key, size)
    check_allreduce_result(hvps.allreduce(xs[rank].copy(), op=hvps.Sum), xs, "Sum", size,
                           what=key)
    ys = all_inputs(np.int64, (4, 3), key + "h", size)
    h = hvps.allreduce_async(ys[rank].copy(), op=hvps.Max)
    check_allreduce_result(np.asarray(h.wait()), ys, "Max", size, what=key + " async")
    g = hvps.allgather(np.full((rank + 1,), rank, dtype=np.int32))
    assert g.tolist() == [r for r in range(size) for _ in range(r + 1)]


def test_mismatched_shape():
    size, rank = hvps.size(), hvps.rank()
    bad = size - 1
    x = random_array(np.float32, (5,) if rank == bad else (4,), "mm-shape", rank)
    t0 = time.monotonic()
    with pytest.raises(hvps.HvpsError) as ei:
        hvps.allreduce(x, op=hvps.Sum, name="err.shape_mismatch")
    assert time.monotonic() - t0 < 3 * STALL
    _assert_names(str(ei.value), "err.shape_mismatch", [bad])
    _healthy("after-shape")


def test_mismatch_after_the_request_is_cached(request):
    """Once a request is in the response cache, ranks name it by a bit; a rank whose shape then
    changes announces the new request in full, and the mismatch is still caught and named."""
    size, rank = hvps.size(), hvps.rank()
    bad, name = size - 1, "err.cached_then_changed"
    for step in range(3):  # steady state: from the second step on, every rank sends a bit
        xs = all_inputs(np.float32, (4,), f"{request.node.name}/{step}", size)
        check_allreduce_result(np.asarray(hvps.allreduce(xs[rank], op=hvps.Sum, name=name)), xs, "Sum", size,
                               what=f"step {step}")
    x = random_array(np.float32, (5,) if rank == bad else (4,), "cached-mm", rank)
    with pytest.raises(hvps.HvpsError) as ei:
        hvps.allreduce(x, op=hvps.Sum, name=name)
    _assert_names(str(ei.value), name, [bad])
    _healthy("after-cached-mismatch")


def test_mismatched_dtype_async():
    size, rank = hvps.size(), hvps.rank()
    bad = size - 1
    x = random_array(np.float64 if rank == bad else np.float32, (6,), "mm-dtype", rank)
    t0 = time.monotonic()
    h = hvps.allreduce_async(x, op=hvps.Sum, name="err.dtype_mismatch")
    with pytest.raises(hvps.HvpsError) as ei:
        h.wait()
    assert time.monotonic() - t0 < 3 * STALL
    _assert_names(str(ei.value), "err.dtype_mismatch", [bad])
    _healthy("after-dtype")


def test_mismatched_allgather_trailing_shape():
    size, rank = hvps.size(), hvps.rank()
    bad = size - 1
    x = random_array(np.int32, (rank + 1, 3 if rank == bad else 2), "mm-ag", rank)
    with pytest.raises(hvps.HvpsError) as ei:
        hvps.allgather(x, name="err.allgather_shape")
    _assert_names(str(ei.value), "err.allgather_shape", [bad])
    _healthy("after-allgather-shape")


def test_mismatch_inside_async_batch_does_not_poison_others(request):
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    good = [all_inputs(np.float32, (50 + i,), f"{key}/{i}", size) for i in range(4)]
    hs = [hvps.allreduce_async(g[rank].copy(), op=hvps.Sum, name=f"batch.good.{i}")
          for i, g in enumerate(good[:2])]
    bad_x = np.zeros((3,) if rank == 0 else (2,), dtype=np.float32)
    hb = hvps.allreduce_async(bad_x, op=hvps.Sum, name="batch.bad")
    hs += [hvps.allreduce_async(g[rank].copy(), op=hvps.Sum, name=f"batch.good.{i + 2}")
           for i, g in enumerate(good[2:])]
    with pytest.raises(hvps.HvpsError) as ei:
        hb.wait()
    _assert_names(str(ei.value), "batch.bad", [0])
    for i, (h, g) in enumerate(zip(hs, good)):
        check_allreduce_result(np.asarray(h.wait()), g, "Sum", size, what=f"good {i}")


def test_missing_rank_stall(shared_dir):
    size, rank = hvps.size(), hvps.rank()
    missing = size - 1
    hvps.barrier()
    if rank != missing:
        x = random_array(np.float32, (8,), "stall", rank)
        t0 = time.monotonic()
        with pytest.raises(hvps.HvpsError) as ei:
            hvps.allreduce(x, op=hvps.Sum, name="err.never_submitted")
        elapsed = time.monotonic() - t0
        assert elapsed < 3 * STALL, f"stall error after {elapsed:.1f}s (stall time {STALL}s)"
        assert elapsed >= 0.5 * STALL, f"stall error already after {elapsed:.2f}s"
        _assert_names(str(ei.value), "err.never_submitted", [missing])
    _signal_and_wait(shared_dir, "stall1", waiters=[missing], me=rank)
    _healthy("after-stall")


def test_missing_many_ranks_stall_async(shared_dir):
    """Only rank 0 submits; the error must name every missing rank."""
    size, rank = hvps.size(), hvps.rank()
    hvps.barrier()
    if rank == 0:
        t0 = time.monotonic()
        h = hvps.allreduce_async(np.arange(4, dtype=np.float64), op=hvps.Sum,
                                 name="err.only_rank0")
        with pytest.raises(hvps.HvpsError) as ei:
            h.wait()
        assert time.monotonic() - t0 < 3 * STALL
        _assert_names(str(ei.value), "err.only_rank0", list(range(1, size)))
    _signal_and_wait(shared_dir, "stall2", waiters=list(range(1, size)), me=rank)
    _healthy("after-stall-many")


def test_missing_rank_other_collective(shared_dir):
    """Stall detection is not allreduce specific."""
    rank = hvps.rank()
    missing = 0
    hvps.barrier()
    if rank != missing:
        t0 = time.monotonic()
        with pytest.raises(hvps.HvpsError) as ei:
            hvps.broadcast(np.zeros(3, np.int32), root_rank=1, name="err.bcast_missing")
        assert time.monotonic() - t0 < 3 * STALL
        _assert_names(str(ei.value), "err.bcast_missing", [missing])
    _signal_and_wait(shared_dir, "stall3", waiters=[missing], me=rank)
    _healthy("after-stall-bcast")


@pytest.mark.parametrize("collective", ["allreduce", "allgather", "broadcast", "alltoall", "reducescatter"])
def test_a_rank_that_refuses_its_arguments_fails_everyone_at_once_and_names_stay_in_step(collective, request):
    """One rank raises inside an unnamed collective (a dtype hvps cannot move) while the others
    submit theirs: they fail at once, long before the stall time, naming that rank and its reason;
    then the next unnamed collectives pair correctly (fresh random data of one shape, so a
    collective paired with the wrong partner would show as a wrong result, not a mismatch)."""
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    bad = size - 1
    call = {"allreduce": lambda x: hvps.allreduce(x, op=hvps.Sum),
            "allgather": hvps.allgather,
            "broadcast": lambda x: hvps.broadcast(x, root_rank=0),
            "alltoall": hvps.alltoall,
            "reducescatter": lambda x: hvps.reducescatter(x, op=hvps.Sum)}[collective]
    hvps.barrier()
    for round_ in range(2):
        x = np.zeros((size * 2, 3), np.uint32 if rank == bad else np.float32)
        if rank == bad:
            with pytest.raises(TypeError, match="uint32"):
                call(x)
        else:
            with pytest.raises(hvps.HvpsError) as info:
                call(x)
            # at once, not at the stall: the message is the failure announcement's, not the stall check's
            message = str(info.value)
            _assert_names(message, collective, [bad])
            assert "uint32" in message and "before they could submit it" in message, message
            assert "did not submit it within" not in message, message
        xs = all_inputs(np.float32, (7,), f"{key}/{round_}", size)
        check_allreduce_result(hvps.allreduce(xs[rank].copy(), op=hvps.Sum), xs, "Sum", size, what=key)
    _healthy(key)


def test_a_nan_or_infinite_scale_factor_is_refused_as_not_finite_on_every_rank(request):
    """Issue 38: a NaN prescale_factor, given alike on every rank, was reported as a mismatch between ranks
    (NaN is not equal to itself). It is an argument error, at once, on every rank; the job goes on."""
    start = time.monotonic()
    for scales in ({"prescale_factor": float("nan")}, {"postscale_factor": float("inf")}):
        with pytest.raises(ValueError, match="is not a finite number"):
            hvps.allreduce(np.ones(3, np.float32), op=hvps.Sum, **scales)
        with pytest.raises(ValueError, match="is not a finite number"):
            hvps.allreduce(np.ones(3, np.float32), op=hvps.Sum, name="nan.named", **scales)
    assert time.monotonic() - start < STALL / 2
    _healthy(request.node.name)


@pytest.mark.parametrize("named", [False, True])
def test_an_unpicklable_object_fails_every_rank_at_once_with_the_owners_reason(named, request):
    """Issue 38: an object that cannot be pickled on broadcast_object's root left the others waiting out the
    stall time, and the job was then dead. Now every rank fails at once with the root's reason (and likewise
    for allgather_object on the last rank), and the next object collectives work."""
    size, rank = hvps.size(), hvps.rank()
    name = "obj.bad" if named else None
    for which, owner in (("broadcast", size - 1), ("allgather", size - 1)):
        start = time.monotonic()
        obj = (lambda: rank) if rank == owner else {"rank": rank}
        call = (lambda: hvps.broadcast_object(obj, root_rank=owner, name=name)) if which == "broadcast" else \
            (lambda: hvps.allgather_object(obj, name=name))
        if rank == owner:
            with pytest.raises(Exception, match="pickle"):
                call()
        else:
            with pytest.raises(hvps.HvpsError) as info:
                call()
            message = str(info.value)
            assert f"failed on ranks [{owner}]" in message and "cannot be pickled" in message, message
        assert time.monotonic() - start < STALL / 2, f"{which}: {time.monotonic() - start:.1f} s"
    assert hvps.broadcast_object({"from": size - 1}, root_rank=size - 1) == {"from": size - 1}
    assert hvps.allgather_object(rank) == list(range(size))
    _healthy(request.node.name)


def test_everything_still_works_at_the_end(request):
    for i in range(5):
        _healthy(f"{request.node.name}/{i}")
    hvps.barrier()


@pytest.mark.parametrize("bad", [object(), 7, b"bytes", ("a", "b")], ids=["object", "int", "bytes", "tuple"])
def test_non_str_name_is_a_type_error_on_every_rank(bad):
    """str(object()) differs by rank: taken as a name, it would stall the job instead of failing."""
    with pytest.raises(TypeError, match=r"name must be a str"):
        hvps.allreduce(np.ones(3, np.float32), name=bad)
    with pytest.raises(TypeError, match=r"name must be a str"):
        hvps.allgather_async(np.ones(3, np.float32), name=bad)
    with pytest.raises(TypeError, match=r"name must be a str"):
        hvps.broadcast_object({"x": 1}, root_rank=0, name=bad)
    _healthy("after-non-str-name")


def test_non_str_name_through_the_torch_adapter():
    torch = pytest.importorskip("torch")
    import hvps.adapters.torch as hvd

    with pytest.raises(TypeError, match=r"name must be a str"):
        hvd.allreduce(torch.ones(3), name=object())
    with pytest.raises(TypeError, match=r"name must be a str"):
        hvd.sparse_allreduce_async(torch.ones(3).to_sparse(), name=object(), op=hvd.Sum)
    with pytest.raises(TypeError, match=r"name must be a str"):
        hvd.broadcast_(torch.ones(3), root_rank=0, name=object())
    _healthy("after-torch-non-str-name")


def test_collective_in_a_child_forked_after_init_fails_at_once():
    """The child has a copy of the engine but not its thread, and it must never write to the parent's
    control connection: every collective refuses at once, and its exit leaves the job alone."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running the parent's atexit handlers
        os.close(read)
        try:
            t0 = time.monotonic()
            try:
                hvps.allreduce(np.ones(3, np.float32), name="from.child")
                report = "no error"
            except hvps.HvpsError as exc:
                report = f"{time.monotonic() - t0:.3f} {exc}"
            try:
                hvps.barrier()
            except hvps.HvpsError as exc:
                report += f"\n{exc}"
            os.write(write, report.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        report = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    first, _, second = report.partition("\n")
    seconds, _, message = first.partition(" ")
    assert "hvps cannot be used in a child process forked after init" in message, report
    assert "hvps cannot be used in a child process forked after init" in second, report
    print(f"the child's collective was refused after {float(seconds):.3f} s")  # how fast: not pass/fail
    _healthy("after-fork")


def test_a_forked_child_that_exits_normally_leaves_the_job_alone():
    """A child that ends through Python's normal exit runs the atexit handlers it inherited; hvps's
    must not shut the parent's engine down, send on its connection or abort the MPI job."""
    import atexit

    pid = os.fork()
    if pid == 0:
        try:
            atexit._run_exitfuncs()  # what the child's normal exit would run
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    _healthy("after-fork-exit")
