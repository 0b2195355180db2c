"""Inner multi-rank tests for Horovod semantics of the torch adapter: gradients of the
collectives, Adasum, SyncBatchNorm, dtypes, in-place grouped allreduce, join and optimizer
state. References are numpy (or single-process torch) on fresh random data."""

import os

import numpy as np
import pytest
import torch

os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"

from hvps_testutil import random_array  # noqa: E402

import hvps.adapters.torch as hvd  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    yield


def _t(array):
    return torch.from_numpy(np.ascontiguousarray(array).copy())


def _inputs(key, shape, dtype=np.float64):
    return [random_array(dtype, shape, key, r) for r in range(hvd.size())]


# -- gradients --------------------------------------------------------------------------------------
def test_allgather_grad_is_averaged_output_grad_rows(request):
    size, me = hvd.size(), hvd.rank()
    rows = [2 + r for r in range(size)]
    x = _t(random_array(np.float64, (rows[me], 3), request.node.name, me)).requires_grad_()
    ws = _inputs(request.node.name + "w", (sum(rows), 3))
    (hvd.allgather(x) * _t(ws[me])).sum().backward()
    start = sum(rows[:me])
    np.testing.assert_allclose(x.grad.numpy(), np.mean(ws, axis=0)[start:start + rows[me]], rtol=1e-12)


def test_grouped_allgather_grad(request):
    size, me = hvd.size(), hvd.rank()
    xs = [_t(random_array(np.float32, (me + 1, 2), request.node.name + str(i), me)).requires_grad_()
          for i in range(3)]
    ws = _inputs(request.node.name + "w", (size * (size + 1) // 2, 2), np.float32)
    outs = hvd.grouped_allgather(xs)
    sum((o * _t(ws[me])).sum() for o in outs).backward()
    start = me * (me + 1) // 2
    for x in xs:
        np.testing.assert_allclose(x.grad.numpy(), np.mean(ws, axis=0)[start:start + me + 1], rtol=1e-6)


@pytest.mark.parametrize("root", [0, -1])
def test_broadcast_grad(root, request):
    size, me = hvd.size(), hvd.rank()
    root = root % size
    x = _t(random_array(np.float64, (4, 3), request.node.name, me)).requires_grad_()
    ws = _inputs(request.node.name + "w", (4, 3))
    (hvd.broadcast(x, root) * _t(ws[me])).sum().backward()
    expect = np.mean(ws, axis=0) if me == root else np.zeros((4, 3))
    np.testing.assert_allclose(x.grad.numpy(), expect, rtol=1e-12)


def test_alltoall_grad_routes_back(request):
    size, me = hvd.size(), hvd.rank()
    splits = [[1 + (r + j) % 3 for j in range(size)] for r in range(size)]
    x = _t(random_array(np.float64, (sum(splits[me]), 2), request.node.name, me)).requires_grad_()
    out, received = hvd.alltoall(x, torch.tensor(splits[me], dtype=torch.int32))
    assert received.tolist() == [splits[r][me] for r in range(size)]
    w = _t(random_array(np.float64, tuple(out.shape), request.node.name + "w", me))
    (out * w).sum().backward()
    # rank r's block j went to rank j at offset sum(splits[k][j] for k < r); its gradient is that slice of w_j
    expect = []
    for j in range(size):
        offset = sum(splits[k][j] for k in range(me))
        w_j = random_array(np.float64, (sum(splits[k][j] for k in range(size)), 2), request.node.name + "w", j)
        expect.append(w_j[offset:offset + splits[me][j]])
    np.testing.assert_allclose(x.grad.numpy(), np.concatenate(expect), rtol=1e-12)


def test_alltoall_without_splits_returns_the_tensor_alone():
    size = hvd.size()
    out = hvd.alltoall(torch.arange(2.0 * size))
    assert isinstance(out, torch.Tensor) and out.shape == (2 * size,)


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_reducescatter_grad(op, request):
    size, me = hvd.size(), hvd.rank()
    x = _t(random_array(np.float64, (2 * size, 3), request.node.name, me)).requires_grad_()
    out = hvd.reducescatter(x, op=getattr(hvd, op))
    ws = _inputs(request.node.name + "w", (2, 3))
    (out * _t(ws[me])).sum().backward()
    scale = size if op == "Sum" else 1  # Horovod's rule: gathered output gradients, times size for Sum
    np.testing.assert_allclose(x.grad.numpy(), scale * np.concatenate(ws), rtol=1e-12)


# -- dtypes and in-place grouped allreduce ---------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.uint8, torch.bool, torch.bfloat16, torch.float16])
def test_every_horovod_cpu_dtype_moves(dtype):
    size, me = hvd.size(), hvd.rank()
    t = torch.full((3, 2), me % 2, dtype=dtype)
    gathered = hvd.allgather(t)
    assert gathered.dtype == dtype and [int(v) for v in gathered[::3, 0].tolist()] == [r % 2 for r in range(size)]
    assert hvd.broadcast(t, size - 1).eq(torch.full((3, 2), (size - 1) % 2, dtype=dtype)).all()
    out = hvd.alltoall(torch.full((size,), me % 2, dtype=dtype))
    assert [int(v) for v in out.tolist()] == [r % 2 for r in range(size)]
    if dtype != torch.bool:
        assert int(hvd.allreduce(t, op=hvd.Sum)[0, 0]) == sum(r % 2 for r in range(size))


def test_grouped_allreduce_in_place(request):
    size, me = hvd.size(), hvd.rank()
    shapes = [(3,), (4, 2), (1,), (5, 1, 2)]
    per_rank = [[random_array(np.float32, s, request.node.name + str(i), r) for i, s in enumerate(shapes)]
                for r in range(size)]
    tensors = [_t(a) for a in per_rank[me]] + [torch.tensor([me], dtype=torch.int32)]
    returned = hvd.grouped_allreduce_(tensors, op=hvd.Sum)
    assert all(a is b for a, b in zip(returned, tensors))
    for i in range(len(shapes)):
        np.testing.assert_allclose(tensors[i].numpy(), np.sum([p[i] for p in per_rank], axis=0), rtol=1e-5)
    assert tensors[-1].item() == sum(range(size))


def test_integer_average_rounds_toward_zero():
    size = hvd.size()
    t = torch.tensor([-(size + 1), size + 1, -1], dtype=torch.int32) if hvd.rank() == 0 else torch.zeros(3, dtype=torch.int32)
    assert hvd.allreduce(t, op=hvd.Average).tolist() == [int(v / size) for v in [-(size + 1), size + 1, -1]]


# -- join ------------------------------------------------------------------------------------------
def test_join_with_allreduce_and_error_for_others(request):
    size, me = hvd.size(), hvd.rank()
    xs = _inputs(request.node.name, (6,))
    for first in range(size):
        if me == first:
            last = hvd.join()
        else:
            got = hvd.allreduce(_t(xs[me]), op=hvd.Average, name="joined")
            expect = sum(xs[r] for r in range(size) if r != first) / size
            np.testing.assert_allclose(got.numpy(), expect, rtol=1e-12)
            # named per round: an unnamed one takes its name from a per-rank counter, which the rank that
            # joined did not advance (a mismatch the stall check would report, after its timeout)
            with pytest.raises(RuntimeError, match="join"):
                hvd.allgather(torch.ones(2), name=f"after_join.{first}")
            last = hvd.join()
        assert last != first or size == 1
        assert hvd.allgather_object(last) == [last] * size


# -- Adasum ----------------------------------------------------------------------------------------
def _adasum_reference(vectors):
    """The paper's pairwise combination, applied as a binary tree over ranks 0..n-1 (numpy, float64)."""
    level = [np.asarray(v, dtype=np.float64) for v in vectors]
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[::2], level[1::2]):
            dot, aa, bb = a @ b, a @ a, b @ b
            ca = 1 - dot / (2 * aa) if aa else 1.0
            cb = 1 - dot / (2 * bb) if bb else 1.0
            nxt.append(ca * a + cb * b)
        level = nxt
    return level[0]


@pytest.mark.parametrize("length", [1, 7, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adasum_matches_the_formula(length, dtype, request):
    size, me = hvd.size(), hvd.rank()
    xs = _inputs(request.node.name, (length,))
    if size & (size - 1):
        with pytest.raises(NotImplementedError):
            hvd.allreduce(_t(xs[me]).to(dtype), op=hvd.Adasum)
        return
    got = hvd.allreduce(_t(xs[me]).to(dtype), op=hvd.Adasum)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    np.testing.assert_allclose(got.double().numpy(), _adasum_reference(xs), rtol=tolerance, atol=tolerance)


def test_adasum_of_parallel_and_orthogonal_vectors():
    size, me = hvd.size(), hvd.rank()
    if size & (size - 1):  # Horovod's rule: refused on every rank alike, nothing submitted
        with pytest.raises(NotImplementedError):
            hvd.allreduce(torch.ones(2), op=hvd.Adasum)
        return
    same = hvd.allreduce(torch.full((5,), 3.0, dtype=torch.float64), op=hvd.Adasum)
    np.testing.assert_allclose(same.numpy(), np.full(5, 3.0), rtol=1e-12)  # identical vectors: their average
    basis = torch.zeros(size, dtype=torch.float64)
    basis[me] = 1.0 + me
    np.testing.assert_allclose(hvd.allreduce(basis, op=hvd.Adasum).numpy(), np.arange(1.0, size + 1), rtol=1e-12)


def test_adasum_optimizer_combines_updates():
    size, me = hvd.size(), hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    start = model.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    x = torch.zeros(1, 3)
    x[0, me % 3] = 1.0
    model(x).sum().backward()
    if size & (size - 1):
        with pytest.raises(NotImplementedError):
            opt.step()
        return
    opt.step()
    deltas = []
    for r in range(size):
        g = np.zeros(3)
        g[r % 3] = 1.0
        deltas.append(-0.5 * g)
    np.testing.assert_allclose((model.weight.detach() - start).numpy().ravel(), _adasum_reference(deltas), rtol=1e-6)


# -- SyncBatchNorm ----------------------------------------------------------------------------------
@pytest.mark.parametrize("spatial", [(), (3, 2)])
def test_sync_batch_norm_matches_batch_norm_on_the_global_batch(spatial, request):
    size, me = hvd.size(), hvd.rank()
    channels = 4
    rows = [1 + (2 * r) % 3 for r in range(size)]  # uneven per-rank batches
    key = request.node.name
    full = torch.from_numpy(random_array(np.float64, (sum(rows), channels) + spatial, key, 0))
    grads = torch.from_numpy(random_array(np.float64, (sum(rows), channels) + spatial, key + "g", 0))
    weight = torch.from_numpy(random_array(np.float64, (channels,), key + "w", 0))
    bias = torch.from_numpy(random_array(np.float64, (channels,), key + "b", 0))
    start = sum(rows[:me])
    mine = slice(start, start + rows[me])

    ref = (torch.nn.BatchNorm1d if not spatial else torch.nn.BatchNorm2d)(channels).double()
    sync = hvd.SyncBatchNorm(channels).double()
    for module in (ref, sync):
        with torch.no_grad():
            module.weight.copy_(weight)
            module.bias.copy_(bias)
    for step in range(2):  # the running statistics accumulate over steps
        x_ref = full.clone().requires_grad_()
        x_mine = full[mine].clone().requires_grad_()
        out_ref, out_mine = ref(x_ref), sync(x_mine)
        torch.testing.assert_close(out_mine, out_ref[mine], rtol=1e-10, atol=1e-10)
        (out_ref * grads).sum().backward()
        (out_mine * grads[mine]).sum().backward()
        torch.testing.assert_close(x_mine.grad, x_ref.grad[mine], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(sync.running_mean, ref.running_mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(sync.running_var, ref.running_var, rtol=1e-10, atol=1e-12)
    # parameter gradients stay local: their sum over ranks is the global batch's
    torch.testing.assert_close(hvd.allreduce(sync.weight.grad, op=hvd.Sum), ref.weight.grad, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(hvd.allreduce(sync.bias.grad, op=hvd.Sum), ref.bias.grad, rtol=1e-9, atol=1e-10)
    sync.eval()
    ref.eval()
    torch.testing.assert_close(sync(full[mine]), ref(full)[mine], rtol=1e-10, atol=1e-10)


# SyncBatchNorm's CUDA path (torch's fused statistics kernels, issue 43 finding 7) on CPU tensors: those
# kernels exist only for CUDA, so CPU stand-ins with their documented semantics replace them here; hvps's
# code around them (one allgather of [mean, invstd, count], the reductions, an empty rank) runs as it is.
def _bn_dims(x):
    return [d for d in range(x.dim()) if d != 1]


def _bn_view(v, x):
    return v.view([1, -1] + [1] * (x.dim() - 2))


def _bn_stats(x, eps):
    var, mean = torch.var_mean(x, _bn_dims(x), unbiased=False)
    return mean, torch.rsqrt(var + eps)


def _bn_gather(x, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts):
    total = counts.sum()
    mean = (mean_all * counts[:, None]).sum(0) / total
    var_all = invstd_all.pow(-2) - eps
    var = (counts[:, None] * (var_all + (mean_all - mean) ** 2)).sum(0) / total
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(momentum * mean)
        running_var.mul_(1 - momentum).add_(momentum * var * total / (total - 1))
    return mean, torch.rsqrt(var + eps)


def _bn_elemt(x, weight, bias, mean, invstd, eps):
    out = (x - _bn_view(mean, x)) * _bn_view(invstd, x)
    return out * _bn_view(weight, x) + _bn_view(bias, x) if weight is not None else out


def _bn_backward_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
    sum_dy = dy.sum(_bn_dims(x))
    sum_dy_xmu = (dy * (x - _bn_view(mean, x))).sum(_bn_dims(x))
    return sum_dy, sum_dy_xmu, sum_dy_xmu * invstd, sum_dy


def _bn_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    total = count.sum()
    scale = _bn_view(invstd, x) * (_bn_view(weight, x) if weight is not None else 1.0)
    xmu = x - _bn_view(mean, x)
    return scale * (dy - _bn_view(sum_dy / total, x) - xmu * _bn_view(invstd, x) ** 2 * _bn_view(sum_dy_xmu / total, x))


@pytest.mark.parametrize("spatial", [(), (3, 2)])
def test_fused_sync_batch_norm_matches_batch_norm_with_an_empty_rank(spatial, request, monkeypatch):
    from hvps.adapters.torch import sync_batch_norm

    for name, kernel in (("batch_norm_stats", _bn_stats), ("batch_norm_gather_stats_with_counts", _bn_gather),
                         ("batch_norm_elemt", _bn_elemt), ("batch_norm_backward_reduce", _bn_backward_reduce),
                         ("batch_norm_backward_elemt", _bn_backward_elemt)):
        monkeypatch.setattr(torch, name, kernel)
    size, me = hvd.size(), hvd.rank()
    channels = 3
    rows = [(3, 0, 2)[r % 3] for r in range(size)]  # rank 1 holds no rows
    key = request.node.name
    full = torch.from_numpy(random_array(np.float64, (sum(rows), channels) + spatial, key, 0))
    grads = torch.from_numpy(random_array(np.float64, (sum(rows), channels) + spatial, key + "g", 0))
    start = sum(rows[:me])
    mine = slice(start, start + rows[me])
    ref = (torch.nn.BatchNorm1d if not spatial else torch.nn.BatchNorm2d)(channels, momentum=0.3).double()
    weight = torch.linspace(0.5, 1.5, channels, dtype=torch.float64, requires_grad=True)
    bias = torch.linspace(-1.0, 1.0, channels, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        ref.weight.copy_(weight)
        ref.bias.copy_(bias)
    running_mean, running_var = torch.zeros(channels, dtype=torch.float64), torch.ones(channels, dtype=torch.float64)
    x_ref, x_mine = full.clone().requires_grad_(), full[mine].clone().requires_grad_()
    out_ref = ref(x_ref)
    out_mine = sync_batch_norm._FusedSyncBatchNormFunction.apply(x_mine, weight, bias, running_mean, running_var,
                                                                 1e-5, 0.3, hvd.global_process_set)
    torch.testing.assert_close(out_mine, out_ref[mine], rtol=1e-10, atol=1e-10)
    (out_ref * grads).sum().backward()
    (out_mine * grads[mine]).sum().backward()
    torch.testing.assert_close(x_mine.grad, x_ref.grad[mine], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(running_mean, ref.running_mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(running_var, ref.running_var, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(hvd.allreduce(weight.grad, op=hvd.Sum), ref.weight.grad, rtol=1e-9, atol=1e-10)


# -- optimizer state, compression ------------------------------------------------------------------
def test_broadcast_optimizer_state_with_gradless_parameters():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.index = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
            self.table = torch.nn.Parameter(torch.rand(4))

    model = Model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert model.index.grad is None
    assert torch.equal(hvd.broadcast(model.table.grad, root_rank=0), torch.zeros(4))


def test_fp16_compression_static_interface():
    for dtype in (torch.float32, torch.float64, torch.int8, torch.int64):
        t = torch.ones(2, 3, dtype=dtype)
        wire, ctx = hvd.Compression.fp16.compress(t)
        assert wire.dtype == (torch.float16 if dtype.is_floating_point else dtype)
        back = hvd.Compression.fp16.decompress(wire, ctx)
        assert back.dtype == dtype and torch.equal(back, t)


def test_optimizer_on_a_process_set(request):
    size, me = hvd.size(), hvd.rank()
    evens = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    try:
        torch.manual_seed(1)
        model = torch.nn.Linear(2, 1, bias=False)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                       named_parameters=model.named_parameters(), process_set=evens)
        xs = _inputs(request.node.name, (1, 2))
        start = model.weight.detach().clone()
        model(_t(xs[me]).float()).sum().backward()
        opt.step()
        members = evens.ranks if evens.included() else [me]
        expect = start.numpy() - np.mean([xs[r] for r in members], axis=0)
        np.testing.assert_allclose(model.weight.detach().numpy(), expect, rtol=1e-5)
    finally:
        hvd.remove_process_set(evens)


def test_sparse_allreduce_async_matches_dense(request):
    me = hvd.rank()
    dense = _inputs(request.node.name, (6, 3))
    masked = [np.where(np.abs(d) > 1.5, d, 0.0) for d in dense]
    result = hvd.sparse_allreduce_async(_t(masked[me]).to_sparse(), name="sparse", op=hvd.Average)()
    np.testing.assert_allclose(result.to_dense().numpy(), np.mean(masked, axis=0), rtol=1e-12)
