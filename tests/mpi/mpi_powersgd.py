"""Inner multi-rank tests of PowerSGD (issue 28), run under mpirun with 2 and 3 ranks by
``tests/test_powersgd_multirank.py``.

- Several steps of ``Compression.powersgd`` on fresh random gradients (a conv weight, a
  float64 matrix, a float16 one, a bias, a matrix too small to gain) equal PowerSGD written out in numpy
  over every rank's gradients (``powersgd_reference``), are bit-identical on every rank, and
  the statistics count exactly the P and Q bytes.
- DistributedOptimizer submits every gradient during the backward and keeps parameters
  bit-identical; a run resumed from a CheckpointManager checkpoint continues bit-exactly.
- Different settings on different ranks raise HvpsError naming the ranks; a NaN resets that
  tensor's Q and error on every rank, logged once.
"""

import logging

import numpy as np
import pytest
import torch
from hvps_testutil import rng_for, shared_dir
from powersgd_reference import Reference

import hvps
import hvps.adapters.torch as hvd
import hvps.compression as C
from hvps.compression.communicators import bus_factor

pytestmark = pytest.mark.timeout(120)

# (name, shape, dtype, compressed at rank 2 with min_compression_rate 2)
TENSORS = [("conv", (24, 5, 3, 3), np.float32, True), ("double", (40, 30), np.float64, True),
           ("half", (20, 16), np.float16, True), ("bias", (24,), np.float32, False),
           ("small", (3, 4), np.float32, False)]
#: relative tolerance against the float64 reference (float64: the epsilon of 1e-8 shows; float16: its rounding)
TOL = {np.float64: 1e-8, np.float32: 2e-5, np.float16: 2e-3}
STEPS = 4


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    torch.set_num_threads(1)
    yield


def _grad(key, rank, shape, dtype):
    rng = rng_for(key, rank)
    return (rng.standard_normal(shape) * rng.uniform(0.5, 2.0)).astype(dtype)


def _same_on_all_ranks(array, what):
    flat = np.ascontiguousarray(array).reshape(1, -1)
    gathered = hvps.allgather(flat, name=f"check.{what}")
    for r in range(hvps.size()):
        assert np.array_equal(gathered[r].view(np.uint8), flat[0].view(np.uint8)), \
            f"{what}: rank {r} differs from rank {hvps.rank()}"


@pytest.mark.parametrize("variant", ["average-ef-warm", "sum-noef-cold"])
def test_steps_equal_numpy_reference_and_stats_count_bytes(variant):
    size, rank = hvps.size(), hvps.rank()
    average, ef = variant.startswith("average"), "-ef" in variant
    warm = variant.endswith("warm")
    comp = C.powersgd(rank=2, start_iter=1, warm_start=warm, error_feedback=ef)
    refs = {n: Reference(n, size, 2, start_iter=1, warm_start=warm, error_feedback=ef, average=average,
                         dense=not compressed) for n, _, _, compressed in TENSORS}
    op = hvps.Average if average else hvps.Sum
    expected_sent = expected_dense = 0
    for step in range(STEPS):
        everyone = {n: [_grad(f"{variant}.{n}.{step}", r, s, d) for r in range(size)] for n, s, d, _ in TENSORS}
        handles = [comp.start(everyone[n][rank].copy(), n, op) for n, _, _, _ in TENSORS]
        for (n, shape, dtype, compressed), handle in zip(TENSORS, handles):
            out = handle.wait()
            assert out.shape == shape and out.dtype == dtype
            expected = refs[n].step(everyone[n])
            tol = TOL[dtype]
            np.testing.assert_allclose(out, expected, rtol=tol, atol=tol * np.abs(expected).max(),
                                       err_msg=f"{n} step {step}")
            _same_on_all_ranks(out, f"{variant}.{n}.{step}")
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            expected_dense += int(nbytes * bus_factor(size))
            if compressed and step >= 1:
                n_, m_ = shape[0], int(np.prod(shape[1:]))
                factor_bytes = 8 if dtype == np.float64 else 4  # P and Q travel in float32 (float64 for float64)
                expected_sent += int((n_ + m_) * 2 * factor_bytes * bus_factor(size))
            else:
                expected_sent += int(nbytes * bus_factor(size))
    stats = comp.stats
    assert stats.exchanges == STEPS * len(TENSORS)
    assert stats.dense_bytes == expected_dense and stats.bytes_sent == expected_sent == stats.bytes_received
    assert stats.ratio > 1.5 and stats.compress_seconds > 0
    assert set(comp.state.qs) == ({"conv", "double", "half"} if warm else set())
    assert comp.state.steps == {n: STEPS for n, *_ in TENSORS}


def test_settings_differ_across_ranks_raise_naming_ranks():
    rank = hvps.rank()
    comp = C.powersgd(rank=2 if rank == 1 else 1, start_iter=0)
    with pytest.raises(hvps.HvpsError, match=r"ranks \[1\]: rank=2.*|ranks \[0.*\]: rank=1") as info:
        comp.start(np.ones((8, 8), np.float32), "mismatch", hvps.Average)
    others = [r for r in range(hvps.size()) if r != 1]
    assert f"ranks {others}: rank=1" in str(info.value) and "ranks [1]: rank=2" in str(info.value)


def test_nan_resets_q_and_error_on_every_rank_logged_once(caplog):
    size, rank = hvps.size(), hvps.rank()
    comp = C.powersgd(rank=1, start_iter=0)
    shape = (16, 12)
    outs = []
    with caplog.at_level(logging.WARNING, logger="hvps"):
        for step in range(4):
            grad = _grad(f"nan.{step}", rank, shape, np.float32)
            if rank == 0 and step in (1, 2):
                grad[3, 4] = np.nan if step == 1 else np.inf
            outs.append(comp.start(grad, "w", hvps.Average).wait())
            if step in (1, 2):
                assert "w" not in comp.state.qs and "residual/w" not in comp.state.state_dict()
    assert not np.isfinite(outs[1]).all() and not np.isfinite(outs[2]).all()
    assert np.isfinite(outs[3]).all() and np.isfinite(outs[0]).all()
    assert comp.state.resets == {"w": 2} and comp.state.draws["w"] == 3  # first start, then two fresh ones
    assert len([r for r in caplog.records if "PowerSGD" in r.getMessage()]) == 1
    # after the resets, step 3 is PowerSGD from a fresh start: the reference's first step on its gradients
    ref = Reference("w", size, 1)
    ref.draws = 2
    expected = ref.step([_grad("nan.3", r, shape, np.float32) for r in range(size)])
    np.testing.assert_allclose(outs[3], expected, rtol=2e-5, atol=2e-5 * np.abs(expected).max())
    _same_on_all_ranks(outs[3], "nan.after")


def _model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 6 * 6, 10))


def _train(model, opt, steps, first):
    rank = hvps.rank()
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        # every gradient was submitted during the backward (P rounds in flight or done)
        assert len(opt._handles) == len(list(model.parameters()))
        opt.step()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def test_optimizer_identical_and_checkpoint_resume_is_bit_exact():
    d = shared_dir("powersgd-ckpt")

    def build():
        model = _model()
        comp = hvd.Compression.powersgd(rank=2, start_iter=2)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=model.named_parameters(), compression=comp)
        return model, comp, opt

    model, comp, opt = build()
    _train(model, opt, 3, 0)
    mgr = hvd.CheckpointManager(d)
    mgr.save(0, model=model, optimizer=opt, compression_state=comp)
    _train(model, opt, 3, 3)
    straight = _flat(model)
    _same_on_all_ranks(straight, "ckpt.straight")
    assert comp.stats.ratio > 1.5 and {"grad.0.weight", "grad.3.weight"} <= set(comp.state.qs)

    model2, comp2, opt2 = build()
    torch.manual_seed(99)  # the resumed run must not depend on anything but the checkpoint
    assert mgr.load(model=model2, optimizer=opt2, compression=comp2) == 1
    assert comp2.state.steps == {name: 3 for name in comp.state.steps}
    _train(model2, opt2, 3, 3)
    assert np.array_equal(_flat(model2).view(np.uint8), straight.view(np.uint8)), "resumed run differs"
    for key, value in comp.state_dict().items():
        assert np.array_equal(np.asarray(comp2.state_dict()[key]), np.asarray(value)), key
