"""Inner tests of the torch gradient path: ``DistributedOptimizer`` is an instance of the wrapped
optimizer's class, and a gradient goes from its hook to ``Engine.submit_all`` in at most four
Python frames, with one handle, one dtype check and no compression lookup, giving the average
of every rank's gradient (numpy reference from every rank's data)."""

import sys

import numpy as np
import pytest
import torch

import hvps.adapters.torch as hvd
from hvps.adapters.torch import optimizer_base as optimizer_base_module
from hvps.adapters.torch import tensors as tensors_module
from hvps.core import handle as handle_module
from hvps.runtime import state as runtime

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    torch.set_num_threads(1)
    yield


def _rank_data(rank, shape, seed, dtype=np.float32):
    return np.random.default_rng([seed, rank]).standard_normal(shape).astype(dtype)


def _mean_over_ranks(shape, seed, dtype=np.float32):
    return np.mean([_rank_data(r, shape, seed, dtype).astype(np.float64) for r in range(hvd.size())], axis=0)


# -- isinstance(opt, type(inner)) ------------------------------------------------------------------
@pytest.mark.parametrize("kind", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_is_an_instance_of_the_wrapped_class(kind):
    model = torch.nn.Linear(3, 2)
    inner = kind(model.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    assert isinstance(opt, kind) and isinstance(opt, hvd.DistributedOptimizer)
    assert isinstance(opt, torch.optim.Optimizer)
    assert type(opt).__name__ == kind.__name__
    again = hvd.DistributedOptimizer(kind(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    assert type(again) is type(opt)  # one subclass per wrapped class
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    assert repr(opt).startswith("DistributedOptimizer(")


def test_refuses_what_is_not_an_optimizer():
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer, not list"):
        hvd.DistributedOptimizer([torch.zeros(1, requires_grad=True)])


def test_state_dict_scheduler_and_reload():
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x = torch.randn(5, 4)
    for _ in range(2):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        scheduler.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.025)
    state = opt.state_dict()
    assert state == inner.state_dict()
    assert all(isinstance(k, int) for k in state["state"])  # torch's own keys, no parameters mixed in
    assert sorted(state["state"]) == [0, 1]
    fresh_model = torch.nn.Linear(4, 2)
    fresh = hvd.DistributedOptimizer(torch.optim.SGD(fresh_model.parameters(), lr=1.0, momentum=0.9),
                                     named_parameters=fresh_model.named_parameters())
    fresh.load_state_dict(state)
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.025)
    assert fresh.param_groups is fresh._inner.param_groups and fresh.state is fresh._inner.state
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(inner.state[p]["momentum_buffer"], fresh.state[q]["momentum_buffer"])


# -- the path from the hook to Engine.submit_all -----------------------------------------------------
class _Trace:
    """Frames from the optimizer's hooks to submit_all, handles made, dtype checks and compression
    lookups while they run."""

    def __init__(self, monkeypatch):
        self.frames, self.handles, self.dtype_checks, self.lookups, self.hooks = [], 0, 0, 0, 0
        self._in_hook = False
        trace = self
        register = torch.Tensor.register_post_accumulate_grad_hook

        def traced_register(tensor, hook):
            def traced_hook(p):
                trace._in_hook = True
                trace.hooks += 1
                try:
                    hook(p)
                finally:
                    trace._in_hook = False
            return register(tensor, traced_hook)

        monkeypatch.setattr(torch.Tensor, "register_post_accumulate_grad_hook", traced_register)
        engine = runtime.engine()
        submit_all = engine.submit_all

        def traced_submit_all(entries):
            if trace._in_hook:
                frame, depth = sys._getframe(1), 1
                while frame.f_code.co_name != "traced_hook":
                    depth, frame = depth + 1, frame.f_back
                trace.frames.append(depth)
            return submit_all(entries)

        monkeypatch.setattr(engine, "submit_all", traced_submit_all)
        handle_init = handle_module.Handle.__init__

        def counted_init(handle, *args, **kwargs):
            trace.handles += trace._in_hook
            handle_init(handle, *args, **kwargs)

        monkeypatch.setattr(handle_module.Handle, "__init__", counted_init)
        dtype_name = tensors_module.dtype_name

        def counted_dtype_name(tensor):
            trace.dtype_checks += trace._in_hook
            return dtype_name(tensor)

        monkeypatch.setattr(tensors_module, "dtype_name", counted_dtype_name)
        resolve = optimizer_base_module.as_gradient_compression

        def counted_resolve(compression):
            trace.lookups += 1
            return resolve(compression)

        monkeypatch.setattr(optimizer_base_module, "as_gradient_compression", counted_resolve)


@pytest.mark.parametrize("compression", ["none", "fp16", "bf16"])
def test_short_path_and_averages(monkeypatch, compression):
    trace = _Trace(monkeypatch)
    shapes = [(6, 5), (6,), (3, 6), (3,)]
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Linear(6, 3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=getattr(hvd.Compression, compression), gradient_predivide_factor=2.0)
    assert trace.lookups == 1  # in __init__ only
    params = list(model.parameters())
    for step in range(2):
        seeds = [100 * step + i for i in range(len(params))]
        targets = [torch.from_numpy(_rank_data(hvd.rank(), s, seed)) for s, seed in zip(shapes, seeds)]
        trace.frames, trace.handles, trace.dtype_checks, trace.hooks = [], 0, 0, 0
        opt.zero_grad()
        sum((p * t).sum() for p, t in zip(params, targets)).backward()  # each gradient: that rank's target
        assert trace.hooks == len(params)
        assert trace.frames == [4] * len(params), trace.frames
        assert trace.handles == len(params) and trace.dtype_checks == len(params)
        opt.synchronize()
        tol = {"none": 1e-6, "fp16": 2e-3, "bf16": 2e-2}[compression]
        for p, s, seed in zip(params, shapes, seeds):
            np.testing.assert_allclose(p.grad.numpy(), _mean_over_ranks(s, seed), rtol=tol, atol=tol)
        with opt.skip_synchronize():
            opt.step()
    assert trace.lookups == 1


def test_group_of_two_dtypes_and_sparse_refused():
    size = hvd.size()
    w32 = torch.zeros(4, requires_grad=True)
    w64 = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w32, w64], lr=0.1), named_parameters=[("a", w32), ("b", w64)],
                                   groups=[[w32, w64]], gradient_predivide_factor=float(size))
    t32 = torch.from_numpy(_rank_data(hvd.rank(), (4,), 7))
    t64 = torch.from_numpy(_rank_data(hvd.rank(), (3,), 8, np.float64))
    ((w32 * t32).sum() + (w64 * t64).sum()).backward()
    opt.synchronize()
    np.testing.assert_allclose(w32.grad.numpy(), _mean_over_ranks((4,), 7), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(w64.grad.numpy(), _mean_over_ranks((3,), 8, np.float64), rtol=1e-12, atol=1e-12)

    emb = torch.nn.Embedding(5, 2, sparse=True)
    dense = torch.zeros(2, requires_grad=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD([emb.weight, dense], lr=0.1),
                                   named_parameters=[("emb", emb.weight), ("dense", dense)],
                                   groups=[[emb.weight, dense]])
    with pytest.raises(ValueError, match="groups cannot reduce sparse gradients"):
        (emb(torch.tensor([1, 2])).sum() + dense.sum()).backward()
