"""Inner multi-rank tests for the PyTorch adapter (hvps.adapters.torch)."""

import numpy as np
import pytest
import torch
from hvps_testutil import (
    BF16,
    DTYPES,
    OP_NAMES,
    all_inputs,
    assert_exact,
    big_count,
    check_allreduce_result,
    check_guarded_average,
    overflowing_halves,
    random_array,
    rows_split,
)

import hvps.adapters.torch as hvd

pytestmark = pytest.mark.timeout(180)

TORCH_DTYPES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8, "bool": torch.bool,
}


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    yield


def to_t(a):
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def to_np(t):
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16).copy()
    return t.numpy().copy()


def _check(t, arrays, op, size, pre=1.0, post=1.0, what=""):
    assert isinstance(t, torch.Tensor), f"{what}: got {type(t)}"
    assert t.dtype == TORCH_DTYPES[str(arrays[0].dtype)], f"{what}: dtype {t.dtype}"
    check_allreduce_result(to_np(t), arrays, op, size, pre, post, what=what)


CASES = [(d, o) for d in TORCH_DTYPES for o in OP_NAMES if not (d == "bool" and o == "Average")]


@pytest.mark.parametrize("shape", [(0,), (7, 11, 13), "big"], ids=["empty", "odd", "big"])
@pytest.mark.parametrize("dtype,op", CASES)
def test_allreduce(dtype, op, shape, request):
    dt = DTYPES[dtype]
    size, rank = hvd.size(), hvd.rank()
    shape = (big_count(dt),) if shape == "big" else shape
    xs = all_inputs(dt, shape, request.node.name, size, op)
    t = to_t(xs[rank])
    res = hvd.allreduce(t, op=getattr(hvd, op))
    _check(res, xs, op, size, what=request.node.name)
    assert_exact(to_np(t), xs[rank], "input modified")


def test_average_flag(request):
    size, rank = hvd.size(), hvd.rank()
    xs = all_inputs(np.float64, (31,), request.node.name, size)
    _check(hvd.allreduce(to_t(xs[rank]), average=True), xs, "Average", size)
    _check(hvd.allreduce(to_t(xs[rank]), average=False), xs, "Sum", size)
    _check(hvd.allreduce(to_t(xs[rank])), xs, "Average", size)  # default Average


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64"])
def test_allreduce_scaling(dtype, request):
    size, rank = hvd.size(), hvd.rank()
    xs = all_inputs(DTYPES[dtype], (257,), request.node.name, size)
    res = hvd.allreduce(to_t(xs[rank]), op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    _check(res, xs, "Sum", size, 0.5, 3.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "bool"])
def test_inplace_allreduce_variants(dtype, request):
    dt = DTYPES[dtype]
    op = "Max" if dtype == "bool" else "Sum"
    size, rank = hvd.size(), hvd.rank()
    key = request.node.name
    xs = all_inputs(dt, (6, 5), key, size, op)
    t = to_t(xs[rank])
    ptr = t.data_ptr()
    r = hvd.allreduce_(t, op=getattr(hvd, op))
    assert r is t or r.data_ptr() == ptr
    assert t.data_ptr() == ptr
    _check(t, xs, op, size, what="allreduce_")

    ys = all_inputs(dt, (1013,), key + "y", size, op)
    u = to_t(ys[rank])
    h = hvd.allreduce_async_(u, op=getattr(hvd, op))
    r = hvd.synchronize(h)
    _check(u, ys, op, size, what="allreduce_async_")

    gs = [all_inputs(dt, (n,), f"{key}g{n}", size, op) for n in (3, 0, 40)]
    ts = [to_t(g[rank]) for g in gs]
    hvd.grouped_allreduce_(ts, op=getattr(hvd, op))
    for tt, g in zip(ts, gs):
        _check(tt, g, op, size, what="grouped_allreduce_")

    gs2 = [all_inputs(dt, (n,), f"{key}h{n}", size, op) for n in (9, 2)]
    ts2 = [to_t(g[rank]) for g in gs2]
    hvd.synchronize(hvd.grouped_allreduce_async_(ts2, op=getattr(hvd, op)))
    for tt, g in zip(ts2, gs2):
        _check(tt, g, op, size, what="grouped_allreduce_async_")


def test_async_poll_synchronize(request):
    size, rank = hvd.size(), hvd.rank()
    key = request.node.name
    ins = [all_inputs(np.float32, (100 * (i + 1),), f"{key}{i}", size) for i in range(6)]
    hs = [hvd.allreduce_async(to_t(x[rank]), op=hvd.Sum, name=f"{key}.{i}")
          for i, x in enumerate(ins)]
    import time
    deadline = time.monotonic() + 60
    while not all(hvd.poll(h) for h in hs):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    for h, x in reversed(list(zip(hs, ins))):
        _check(hvd.synchronize(h), x, "Sum", size)
    gi = [all_inputs(np.float64, (5,), f"{key}g{i}", size) for i in range(3)]
    outs = hvd.synchronize(hvd.grouped_allreduce_async([to_t(g[rank]) for g in gi], op=hvd.Average))
    for o, g in zip(outs, gi):
        _check(o, g, "Average", size)
    outs = hvd.grouped_allreduce([to_t(g[rank]) for g in gi], op=hvd.Min)
    for o, g in zip(outs, gi):
        _check(o, g, "Min", size)


def test_compression_fp16(request):
    size, rank = hvd.size(), hvd.rank()
    xs = all_inputs(np.float32, (2000,), request.node.name, size)
    res = hvd.allreduce(to_t(xs[rank]), op=hvd.Sum, compression=hvd.Compression.fp16)
    assert res.dtype == torch.float32
    # tolerance of an fp16 reduction
    halfs = [x.astype(np.float16) for x in xs]
    check_allreduce_result(to_np(res).astype(np.float16), halfs, "Sum", size)
    res2 = hvd.allreduce(to_t(xs[rank]), op=hvd.Sum, compression=hvd.Compression.none)
    _check(res2, xs, "Sum", size)


def test_fp16_average_of_large_gradients_is_guarded_on_every_path(request):
    """Gradients whose float16 sum overflows but whose average does not: the optimizer's
    per-gradient path (numpy pipeline on MPI, torch ops on tdist), its groups= path,
    hvd.allreduce and hvd.grouped_allreduce all scale by 1/size before the cast."""
    size, rank = hvd.size(), hvd.rank()
    xs = overflowing_halves(request.node.name, size)
    fp16 = hvd.Compression.fp16

    def through_optimizer(tag, **kwargs):
        param = torch.nn.Parameter(torch.zeros(len(xs[rank])))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([param], lr=0.0), named_parameters=[(f"guard.{tag}", param)],
                                       compression=fp16, **kwargs)
        (param * torch.from_numpy(xs[rank])).sum().backward()
        opt.synchronize()
        return param.grad.numpy().copy()

    results = {
        "optimizer": through_optimizer("each"),
        "optimizer groups=1": through_optimizer("grouped", groups=1),
        "allreduce": hvd.allreduce(torch.from_numpy(xs[rank]), op=hvd.Average, compression=fp16).numpy(),
        "grouped_allreduce": hvd.grouped_allreduce([torch.from_numpy(xs[rank])], op=hvd.Average,
                                                   compression=fp16)[0].numpy(),
    }
    check_guarded_average(results, xs)


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_allgather(dtype, request):
    dt = DTYPES[dtype]
    size, rank = hvd.size(), hvd.rank()
    key = request.node.name
    rows = [[2, 0, 5][r % 3] for r in range(size)]
    xs = [random_array(dt, (rows[r], 3), key, r) for r in range(size)]
    res = hvd.allgather(to_t(xs[rank]))
    assert res.dtype == TORCH_DTYPES[dtype]
    assert_exact(to_np(res), np.concatenate(xs), key)
    big = [random_array(dt, (big_count(dt) // 16 // size + r, 16), key + "big", r)
           for r in range(size)]
    h = hvd.allgather_async(to_t(big[rank]))
    assert_exact(to_np(hvd.synchronize(h)), np.concatenate(big), key + " big")


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_broadcast_every_root(dtype, request):
    dt = DTYPES[dtype]
    size, rank = hvd.size(), hvd.rank()
    for root in range(size):
        key = f"{request.node.name}/{root}"
        mine = random_array(dt, (3, 17, 5), key, rank)
        expect = random_array(dt, (3, 17, 5), key, root)
        t = to_t(mine)
        res = hvd.broadcast(t, root_rank=root)
        assert_exact(to_np(res), expect, key)
        assert_exact(to_np(t), mine, key + " input modified")
        t2 = to_t(mine)
        ptr = t2.data_ptr()
        hvd.broadcast_(t2, root_rank=root)
        assert t2.data_ptr() == ptr
        assert_exact(to_np(t2), expect, key + " broadcast_")
        t3 = to_t(mine)
        hvd.synchronize(hvd.broadcast_async_(t3, root_rank=root))
        assert_exact(to_np(t3), expect, key + " broadcast_async_")
        t4 = to_t(mine)
        assert_exact(to_np(hvd.synchronize(hvd.broadcast_async(t4, root_rank=root))), expect,
                     key + " broadcast_async")


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_alltoall(dtype, request):
    dt = DTYPES[dtype]
    size, rank = hvd.size(), hvd.rank()
    key = request.node.name
    splits = [[(r + 2 * j + 1) % 4 for j in range(size)] for r in range(size)]
    xs = [random_array(dt, (sum(splits[r]), 2), key, r) for r in range(size)]
    out, recv = hvd.alltoall(to_t(xs[rank]), splits=torch.tensor(splits[rank], dtype=torch.int32))
    exp = np.concatenate([xs[j][sum(splits[j][:rank]):sum(splits[j][:rank + 1])]
                          for j in range(size)])
    assert isinstance(out, torch.Tensor) and out.dtype == TORCH_DTYPES[dtype]
    assert_exact(to_np(out), exp, key)
    assert [int(v) for v in recv] == [splits[j][rank] for j in range(size)]
    # default equal split, async
    ys = [random_array(dt, (2 * size, 3), key + "eq", r) for r in range(size)]
    out2, recv2 = hvd.synchronize(hvd.alltoall_async(to_t(ys[rank])))
    exp2 = np.concatenate([ys[j][2 * rank:2 * rank + 2] for j in range(size)])
    assert_exact(to_np(out2), exp2, key + " equal")
    assert [int(v) for v in recv2] == [2] * size


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "int32", "uint8"])
@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_reducescatter(dtype, op, request):
    dt = DTYPES[dtype]
    size, rank = hvd.size(), hvd.rank()
    n = 2 * size + 1
    xs = all_inputs(dt, (n, 4), request.node.name, size, op)
    res = hvd.reducescatter(to_t(xs[rank]), op=getattr(hvd, op))
    counts = rows_split(n, size)
    off = sum(counts[:rank])
    _check(res, [x[off:off + counts[rank]] for x in xs], op, size)
    res2 = hvd.synchronize(hvd.reducescatter_async(to_t(xs[rank]), op=getattr(hvd, op)))
    _check(res2, [x[off:off + counts[rank]] for x in xs], op, size)


def test_uint16_tensors(request):
    """torch.uint16 (which Horovod's TensorFlow ops take) through allreduce, allgather and broadcast."""
    size, rank = hvd.size(), hvd.rank()
    key = request.node.name
    for op in ("Sum", "Min", "Max", "Product"):
        xs = all_inputs(np.uint16, (17, 3), f"{key}/{op}", size, op)
        reduced = hvd.allreduce(to_t(xs[rank]), op=getattr(hvd, op))
        assert reduced.dtype == torch.uint16, f"{key}: {op} returned {reduced.dtype}"
        check_allreduce_result(to_np(reduced), xs, op, size, what=f"{key} {op}")
    rows = [random_array(np.uint16, (r + 1, 5), f"{key}/ag", r) for r in range(size)]
    assert_exact(to_np(hvd.allgather(to_t(rows[rank]))), np.concatenate(rows), key)
    mine = random_array(np.uint16, (9,), f"{key}/bc", rank)
    assert_exact(to_np(hvd.broadcast(to_t(mine), root_rank=0)), random_array(np.uint16, (9,), f"{key}/bc", 0), key)


@pytest.mark.parametrize("tdtype", [torch.uint32, torch.complex64], ids=["uint32", "complex64"])
def test_unsupported_dtype(tdtype):
    t = torch.zeros(4, dtype=tdtype)
    with pytest.raises(TypeError):
        hvd.allreduce(t, op=hvd.Sum)
    with pytest.raises(TypeError):
        hvd.allgather(t)
    with pytest.raises(TypeError):
        hvd.broadcast(t, root_rank=0)


# ------------------------------------------------------------------ autograd

@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_allreduce_autograd(op, request):
    size, rank = hvd.size(), hvd.rank()
    key = request.node.name
    xs = all_inputs(np.float64, (4, 5), key, size)
    ws = all_inputs(np.float64, (4, 5), key + "w", size)
    x = to_t(xs[rank]).requires_grad_(True)
    y = hvd.allreduce(x, op=getattr(hvd, op))
    check_allreduce_result(to_np(y), xs, op, size)
    (y * to_t(ws[rank])).sum().backward()
    # d/dx_r sum_k <w_k, reduce(x)> = reduce_op(w) (Horovod semantics)
    check_allreduce_result(to_np(x.grad), ws, op, size, what="grad")


def test_allgather_autograd(request):
    size, rank = hvd.size(), hvd.rank()
    key = request.node.name
    rows = [r + 1 for r in range(size)]
    total = sum(rows)
    xs = [random_array(np.float64, (rows[r], 3), key, r) for r in range(size)]
    ws = all_inputs(np.float64, (total, 3), key + "w", size)
    x = to_t(xs[rank]).requires_grad_(True)
    y = hvd.allgather(x)
    assert_exact(to_np(y), np.concatenate(xs))
    (y * to_t(ws[rank])).sum().backward()
    off = sum(rows[:rank])
    # Horovod's allgather gradient: the output gradients averaged over ranks, this rank's rows
    expect = np.mean(np.stack(ws), axis=0)[off:off + rows[rank]]
    np.testing.assert_allclose(to_np(x.grad), expect, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ helpers

def _model(seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return m


@pytest.mark.parametrize("root", ["first", "last"])
def test_broadcast_parameters(root):
    size, rank = hvd.size(), hvd.rank()
    root_rank = 0 if root == "first" else size - 1
    m = _model(100 + rank)
    m.register_buffer("buf", torch.arange(3, dtype=torch.int64) * (rank + 1))
    hvd.broadcast_parameters(m.state_dict(), root_rank=root_rank)
    ref = _model(100 + root_rank)
    ref.register_buffer("buf", torch.arange(3, dtype=torch.int64) * (root_rank + 1))
    for (k, a), (_, b) in zip(m.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), k
    # named_parameters() form
    m2 = _model(200 + rank)
    hvd.broadcast_parameters(m2.named_parameters(), root_rank=root_rank)
    ref2 = _model(200 + root_rank)
    for a, b in zip(m2.parameters(), ref2.parameters()):
        assert torch.equal(a, b)


def _opt_state_arrays(opt):
    sd = opt.state_dict()
    out = []
    for pid in sorted(sd["state"]):
        for k in sorted(sd["state"][pid]):
            v = sd["state"][pid][k]
            out.append((pid, k, v.detach().numpy().copy() if torch.is_tensor(v) else v))
    hyper = [(k, v) for g in sd["param_groups"] for k, v in sorted(g.items()) if k != "params"]
    return out, hyper


@pytest.mark.parametrize("kind", ["sgd_momentum", "adam", "adam_fresh"])
def test_broadcast_optimizer_state(kind):
    size, rank = hvd.size(), hvd.rank()
    root = size - 1
    m = _model(300)  # same params everywhere
    if kind == "sgd_momentum":
        opt = torch.optim.SGD(m.parameters(), lr=0.01 * (rank + 1), momentum=0.9)
    else:
        opt = torch.optim.Adam(m.parameters(), lr=0.001 * (rank + 1))
    if kind != "adam_fresh":
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(rank))
        m(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    hvd.broadcast_optimizer_state(opt, root_rank=root)
    hvd.broadcast_parameters(m.state_dict(), root_rank=root)
    state, hyper = _opt_state_arrays(opt)
    gathered = hvd.allgather_object((state, hyper))
    root_state, root_hyper = gathered[root]
    assert hyper == root_hyper, f"hyper-parameters differ: {hyper} vs {root_hyper}"
    assert abs(opt.param_groups[0]["lr"] - (0.01 if kind == "sgd_momentum" else 0.001)
               * (root + 1)) < 1e-12
    assert len(state) == len(root_state)
    for (pid, k, v), (rpid, rk, rv) in zip(state, root_state):
        assert (pid, k) == (rpid, rk)
        if isinstance(v, np.ndarray):
            assert_exact(v, rv, f"state {pid}/{k}")
        else:
            assert v == rv, f"state {pid}/{k}"


def test_broadcast_and_allgather_object():
    size, rank = hvd.size(), hvd.rank()
    for root in range(size):
        obj = {"r": rank, "t": torch.arange(rank + 2), "s": "v" * rank}
        got = hvd.broadcast_object(obj, root_rank=root)
        assert got["r"] == root and got["s"] == "v" * root
        assert torch.equal(got["t"], torch.arange(root + 2))
    assert hvd.broadcast_object("x" if rank == 0 else None) == "x"
    assert hvd.allgather_object((rank, "a" * rank)) == [(r, "a" * r) for r in range(size)]


def test_barrier_and_topology():
    size, rank = hvd.size(), hvd.rank()
    hvd.barrier()
    assert hvd.local_rank() == rank and hvd.local_size() == size
    assert hvd.is_initialized()


def test_join_all_ranks():
    size = hvd.size()
    last = hvd.join()
    assert isinstance(last, int) and 0 <= last < size
    assert hvd.allgather_object(last) == [last] * size
    # collectives keep working afterwards
    x = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum)
    assert x.item() == sum(range(size))


def test_join_uneven_work(request):
    """Horovod semantics: after a rank joins, the other ranks' allreduces
    complete with the joined rank contributing zeros."""
    size, rank = hvd.size(), hvd.rank()
    key = request.node.name
    # rank r performs r + 1 Sum allreduces, then joins
    for i in range(size):
        xs = all_inputs(np.float64, (10,), f"{key}/{i}", size)
        if i <= rank:
            res = hvd.allreduce(to_t(xs[rank]), op=hvd.Sum, name=f"uneven.{i}")
            active = [xs[r] for r in range(size) if i <= r]
            expect = np.sum(np.stack(active), axis=0)
            np.testing.assert_allclose(to_np(res), expect, rtol=1e-12, atol=1e-12,
                                       err_msg=f"step {i}")
    last = hvd.join()
    assert last == size - 1
    x = hvd.allreduce(torch.tensor([1.0 + rank]), op=hvd.Sum)
    assert x.item() == sum(1.0 + r for r in range(size))
