"""Inner multi-rank training tests: DistributedOptimizer vs single-process
training on the global batch (computed in-process on every rank, no hvps)."""

import os

import pytest
import torch

import hvps.adapters.torch as hvd

pytestmark = pytest.mark.timeout(240)

GLOBAL_BATCH = 24  # divisible by 1, 2, 3 and, per rank, by 2 micro-batches
STEPS = 20


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    torch.set_num_threads(1)
    yield


def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3))


def _data(step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=g)
    y = torch.randn(GLOBAL_BATCH, 3, generator=g)
    return x, y


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _assert_same_on_all_ranks(model, step):
    flat = _flat(model)
    gathered = hvd.allgather(flat.reshape(1, -1))
    for r in range(hvd.size()):
        assert torch.equal(gathered[r], flat), \
            f"step {step}: parameters of rank {r} differ from rank {hvd.rank()}"


def _train(bpps, predivide=1.0, groups=None, use_skip_sync=False, optim="sgd"):
    size, rank = hvd.size(), hvd.rank()
    model = _mlp(7 + rank)  # deliberately different init on every rank
    ref = _mlp(7)           # rank 0's init: what broadcast_parameters yields
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)

    def make_opt(params):
        if optim == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)
        return torch.optim.Adam(params, lr=0.01)

    base = make_opt(model.parameters())
    kwargs = {"named_parameters": model.named_parameters(), "backward_passes_per_step": bpps,
              "gradient_predivide_factor": predivide}
    if groups is not None:
        kwargs["groups"] = groups
    opt = hvd.DistributedOptimizer(base, **kwargs)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    ref_opt = make_opt(ref.parameters())
    loss_fn = torch.nn.MSELoss()  # mean over the (micro-)batch

    local = GLOBAL_BATCH // size
    micro = local // bpps
    for step in range(STEPS):
        x, y = _data(step)
        # ---- distributed
        opt.zero_grad()
        xr, yr = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        for m in range(bpps):
            sl = slice(m * micro, (m + 1) * micro)
            loss_fn(model(xr[sl]), yr[sl]).backward()
        if use_skip_sync:
            opt.synchronize()
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        # ---- single-process reference on the global batch.  Horovod semantics:
        # gradients are summed locally over the bpps passes and averaged over
        # ranks, i.e. grad = (1/size) sum_r sum_m grad(mean loss of micro-batch
        # (r, m)) = bpps * grad(mean loss over the global batch).
        ref_opt.zero_grad()
        (bpps * loss_fn(ref(x), y)).backward()
        ref_opt.step()

        _assert_same_on_all_ranks(model, step)
        got, exp = _flat(model), _flat(ref)
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"step {step}: {m}")
    return model


def test_distributed_optimizer_matches_single_process():
    _train(bpps=1)


def test_backward_passes_per_step_2():
    _train(bpps=2)


def test_gradient_predivide_factor_and_groups():
    _train(bpps=1, predivide=2.0, groups=2)


def test_skip_synchronize_and_adam():
    _train(bpps=1, use_skip_sync=True, optim="adam")


def test_zero_grad_with_pending_handles_raises():
    model = _mlp(3)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = _data(99)
    torch.nn.functional.mse_loss(model(x), y).backward()  # submits allreduces
    with pytest.raises((AssertionError, RuntimeError)):
        opt.zero_grad()
    opt.step()  # completes the pending allreduces on every rank
    opt.zero_grad()  # fine now
    _assert_same_on_all_ranks(model, "after zero_grad test")


def test_too_many_backward_passes_raises():
    """Horovod: more backward passes than backward_passes_per_step before
    step() is an error."""
    model = _mlp(4)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=1)
    x, y = _data(98)
    torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    # a clean step afterwards works and keeps the ranks in sync
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    _assert_same_on_all_ranks(model, "after too-many-passes test")


def _one_gib_gradient_beside_small_ones():
    """A 1 GiB gradient (a 128k x 2,048 fp32 embedding is one) through DistributedOptimizer,
    mixed with small ones: every rank ends the step with the average of every rank's gradient."""
    import numpy as np

    size, rank = hvd.size(), hvd.rank()
    numel = 1 << 28  # 2**30 bytes of float32
    big = torch.nn.Parameter(torch.zeros(numel))
    small = _mlp(7)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD([big, *small.parameters()], lr=1.0),
        named_parameters=[("big", big), *small.named_parameters()])

    def touched(r):  # rank r's gradient: random values at random places, zero elsewhere
        rng = np.random.default_rng(4242 + r)
        return torch.from_numpy(rng.integers(0, numel, 4096)), \
            torch.from_numpy(rng.standard_normal(4096).astype(np.float32))

    idx, vals = touched(rank)
    x, y = _data(rank)
    loss = (big[idx] * vals).sum() + torch.nn.functional.mse_loss(small(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

    every = [touched(r) for r in range(size)]
    places, slot = torch.cat([i for i, _ in every]).unique(return_inverse=True)
    expected = torch.zeros(len(places)).index_add_(0, slot, torch.cat([v for _, v in every]) / size)
    with torch.no_grad():  # SGD with lr 1 from zeros: the parameter is minus the averaged gradient
        assert torch.allclose(-big[places], expected, rtol=1e-5, atol=1e-6), \
            f"rank {rank}: the 1 GiB gradient's average is wrong where ranks' gradients are not zero"
        assert int(torch.count_nonzero(big)) == int(torch.count_nonzero(expected)), \
            f"rank {rank}: the 1 GiB gradient's average is not zero where every rank's gradient is"
    _assert_same_on_all_ranks(small, "after the 1 GiB step")


# Seconds of memory traffic per run: collected only where the outer test asks for it (the
# multi-rank MPI jobs), not in every job that runs this module.
if os.environ.get("HVPS_TEST_ONE_GIB") == "1":
    test_one_gib_gradient_beside_small_ones = _one_gib_gradient_beside_small_ones
