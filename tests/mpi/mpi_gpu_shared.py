"""Two (or more) ranks sharing one GPU through a host data plane (issue 43; run by benchmarks/gpu_check.sh).

NCCL refuses two ranks on one GPU, so these run with ``HVPS_BACKEND=mpi`` (CUDA tensors staged through
host memory, or handed to a CUDA-aware MPI). Every rank trains on ``cuda:0``. Checked: the
DistributedOptimizer against one process training on the global batch, join with uneven batches,
SyncBatchNorm against BatchNorm on the global batch, and the device of the optimizer state that
``broadcast_optimizer_state`` loads. Skipped, with the reason, without a GPU.
"""

import pytest
import torch

import hvps.adapters.torch as hvd

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason=f"no CUDA GPU: torch {torch.__version__} sees none")


@pytest.fixture(scope="module", autouse=True)
def initialized():
    hvd.init()
    torch.cuda.set_device(0)
    yield


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).cuda()


def _batch(step, rows):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, 8, generator=g).cuda(), torch.randn(rows, 4, generator=g).cuda()


def test_distributed_optimizer_matches_the_global_batch():
    size, rank = hvd.size(), hvd.rank()
    model, reference = _model(0), _model(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    per = 4
    for step in range(3):
        x, y = _batch(step, per * size)
        mine = slice(rank * per, (rank + 1) * per)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.device.type == "cuda"
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_join_with_uneven_batches():
    rank = hvd.rank()
    model = _model(1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    for step in range(2 + rank):  # rank r runs 2 + r steps; the others contribute zeros meanwhile
        x, y = _batch(step, 4)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert hvd.join(0) == hvd.size() - 1


def test_sync_batch_norm_matches_batch_norm_on_the_global_batch():
    size, rank = hvd.size(), hvd.rank()
    rows = [2 + r for r in range(size)]
    g = torch.Generator().manual_seed(7)
    full = torch.randn(sum(rows), 6, 5, 5, generator=g).cuda()
    dy = torch.randn(sum(rows), 6, 5, 5, generator=g).cuda()
    start = sum(rows[:rank])
    mine = slice(start, start + rows[rank])
    sync, ref = hvd.SyncBatchNorm(6).cuda(), torch.nn.BatchNorm2d(6).cuda()
    x_ref, x_mine = full.clone().requires_grad_(), full[mine].clone().requires_grad_()
    out_ref, out_mine = ref(x_ref), sync(x_mine)
    (out_ref * dy).sum().backward()
    (out_mine * dy[mine]).sum().backward()
    torch.testing.assert_close(out_mine, out_ref[mine], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x_mine.grad, x_ref.grad[mine], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sync.running_var, ref.running_var, rtol=1e-4, atol=1e-5)


def test_loaded_optimizer_state_lies_on_the_parameters_device():
    model = _model(2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if hvd.rank() == 0:
        x, y = _batch(0, 4)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    before = torch.cuda.memory_allocated(0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for state in opt.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.dim():
                assert value.device == torch.device("cuda", 0), value.device
    received = hvd.broadcast_object({"m": torch.ones(3, device="cuda")}, 0)
    assert received["m"].device == torch.device("cuda", 0)
    assert torch.cuda.memory_allocated(0) >= before
