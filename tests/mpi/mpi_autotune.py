"""Inner multi-rank test: HVPS_AUTOTUNE=1 during a real training loop (the outer test sets one
warm-up step and two timed steps per setting). Every step's averaged gradients are checked against
mpi4py's reference while rank 0 tries settings; at the end every rank runs the chosen one."""

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hvps
import hvps.adapters.torch as hvd
from hvps.runtime import autotune
from hvps.runtime import state as runtime

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    yield


def test_autotune_chooses_a_setting_every_rank_applies_while_gradients_stay_exact():
    size, rank = hvd.size(), hvd.rank()
    comm = MPI.COMM_WORLD
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    params = list(model.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.05), named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    rng = np.random.default_rng([11, rank])
    searched = len(autotune.THRESHOLDS) + len(autotune.CYCLES_MS) - 1
    for step in range(searched * 3 + 6):
        x = torch.from_numpy(rng.standard_normal((8, 32)).astype(np.float32))
        loss = model(x).square().mean()
        local = torch.autograd.grad(loss, params, retain_graph=True)  # no hooks: this rank's own gradients
        loss.backward()
        opt.synchronize()
        for p, g in zip(params, local):
            expected = comm.allreduce(g.numpy()) / size
            np.testing.assert_allclose(p.grad.numpy(), expected, rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()
    engine = runtime.engine()
    report = comm.bcast(hvps.autotune_report() if rank == 0 else None)
    assert report is not None and report["done"], report
    assert len(report["samples"]) == searched and all(s["steps"] == 2 for s in report["samples"]), report
    chosen = report["chosen"]
    best = min(report["samples"], key=lambda s: s["median_step_s"])
    assert chosen == {"fusion_threshold": best["fusion_threshold"], "cycle_time_ms": best["cycle_time_ms"]}
    assert engine.fusion_threshold == chosen["fusion_threshold"], f"rank {rank}"
    assert engine.cycle_s == pytest.approx(chosen["cycle_time_ms"] / 1000.0), f"rank {rank}"
    if rank != 0:
        assert hvps.autotune_report() is None
