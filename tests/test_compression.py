"""Single-process tests of hvps.compression (issue 4): compressors, selection,
error feedback, DGC state, density schedule, checkpoints of the state, bad input.

Nothing here initialises hvps: compressors and memories work on plain numpy
arrays. Where DGC's clipping needs the world size, ``runtime.size`` is patched.
The multi-rank side (exchanges, stats, DistributedOptimizer) is in
``tests/mpi/mpi_compression.py``.
"""

import math
import zlib

import ml_dtypes
import numpy as np
import pytest

import hvps.compression as C
from hvps.compression import memory as memory_module
from hvps.compression.communicators import Allgather, Allreduce, choose
from hvps.compression.selection import exact_topk, sampled_topk

pytestmark = pytest.mark.unit

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
SHAPES = [(), (0,), (1,), (7,), (3, 5, 4), (129, 67)]


def rng_for(key):
    return np.random.default_rng(zlib.crc32(key.encode()))


def randn(shape, dtype, key, scale=1.0):
    """Fresh normal data (with a few large entries, as gradients have)."""
    rng = rng_for(key)
    x = rng.standard_normal(shape) * scale
    if x.size > 4:
        x.reshape(-1)[rng.integers(x.size, size=3)] *= 20
    return np.asarray(x).astype(dtype)


def bits(a):
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def assert_bitwise(a, b, what=""):
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    assert np.array_equal(bits(a), bits(b)), f"{what}: arrays differ at {np.flatnonzero(a.ravel() != b.ravel())[:8]}"


COMPRESSORS = {
    "none": lambda: C.NoneCompressor(),
    "fp16": lambda: C.CastCompressor("float16"),
    "bf16": lambda: C.CastCompressor(BF16),
    "int8": lambda: C.Int8Compressor(),
    "int8-stochastic": lambda: C.Int8Compressor(chunk=64, stochastic=True, seed=3),
    "topk-exact": lambda: C.TopKCompressor(0.05, selection="exact"),
    "topk-sampled": lambda: C.TopKCompressor(0.05, selection="sampled"),
}


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("kind", list(COMPRESSORS))
@pytest.mark.parametrize("dtype", FLOATS, ids=[d.name for d in FLOATS])
def test_round_trip_keeps_shape_and_dtype(kind, dtype):
    compressor = COMPRESSORS[kind]()
    for shape in SHAPES:
        x = randn(shape, dtype, f"rt-{kind}-{dtype}-{shape}")
        original = x.copy()
        payloads, ctx = compressor.compress(x, "t")
        assert all(isinstance(p, np.ndarray) for p in payloads)
        out = compressor.decompress(payloads, ctx)
        assert out.shape == x.shape and out.dtype == x.dtype, (kind, shape)
        assert_bitwise(x, original, "compress must not modify its input")
        if kind == "none":
            assert_bitwise(out, x)
        elif kind in ("fp16", "bf16"):
            wire = np.dtype(np.float16) if kind == "fp16" else BF16
            assert payloads[0].dtype == wire and payloads[0].size == x.size
            assert_bitwise(out, x.astype(wire).astype(dtype), kind)


@pytest.mark.parametrize("dtype", FLOATS, ids=[d.name for d in FLOATS])
def test_topk_density_one_is_lossless(dtype):
    x = randn((31, 9), dtype, f"dense-{dtype}")
    for selection in ("exact", "sampled"):
        c = C.TopKCompressor(1.0, selection=selection)
        assert_bitwise(c.decompress(*c.compress(x, "t")), x, selection)


# ----------------------------------------------------------------------------- top-k selection
@pytest.mark.parametrize("dtype", FLOATS, ids=[d.name for d in FLOATS])
@pytest.mark.parametrize("n,density", [(1000, 0.01), (4097, 0.1), (50_000, 0.003), (100, 0.001)])
def test_exact_topk_keeps_exactly_the_k_largest(dtype, n, density):
    """Exactly k entries, and no entry left out is larger in magnitude than one kept;
    where magnitudes are distinct (float32/64 here) that is one set: argsort's first k."""
    rng = rng_for(f"topk-{dtype}-{n}")
    x = (rng.standard_normal(n) * 2.0 ** rng.integers(-8, 8, n)).astype(dtype)
    mags = np.abs(x.astype(np.float64))
    c = C.TopKCompressor(density, selection="exact")
    (indices, values), ctx = c.compress(x, "t")
    k = max(1, int(n * density))
    assert indices.dtype == np.int32 and values.dtype == dtype and indices.size == values.size == k
    assert np.all(np.diff(indices) > 0), "indices sorted and unique"
    mask = np.zeros(n, bool)
    mask[indices] = True
    assert mags[mask].min() >= mags[~mask].max()
    if dtype == np.float64 or (dtype == np.float32 and np.unique(mags).size == n):
        np.testing.assert_array_equal(indices, np.sort(np.argsort(-mags)[:k]))
    assert_bitwise(values, x[indices])
    out = c.decompress([indices, values], ctx)
    assert_bitwise(out[mask], x[mask])
    assert not np.any(out[~mask])


def _assert_is_top_set(magnitudes, chosen, k, low=0.8):
    """``chosen`` holds m unique indices with ceil(low*k) <= m <= k, and they are the m largest
    magnitudes: every chosen magnitude >= every magnitude left out (ties may go either way)."""
    assert chosen.size == np.unique(chosen).size
    assert math.ceil(low * k) <= chosen.size <= k, (chosen.size, k)
    mask = np.zeros(magnitudes.size, bool)
    mask[chosen] = True
    assert magnitudes[mask].min() >= magnitudes[~mask].max()


@pytest.mark.parametrize("dist", ["normal", "heavy-tailed", "ties", "sorted", "sparse"])
def test_sampled_topk_returns_a_top_set_of_at_most_k(dist):
    """Sampled selection never returns more than k entries, at least 0.8k, and never
    skips a larger magnitude for a smaller one (it is the exact top-m for some m in [0.8k, k])."""
    n, k = 300_001, 3000  # larger than the 65,536-element sample, so the sampled path runs
    rng = rng_for(f"sampled-{dist}")
    if dist == "normal":
        x = rng.standard_normal(n)
    elif dist == "heavy-tailed":
        x = rng.standard_cauchy(n)
    elif dist == "ties":  # only 50 distinct magnitudes: many ties at the threshold
        x = rng.integers(-25, 26, n).astype(np.float64)
    elif dist == "sorted":  # a strided sample sees a biased picture of sorted data
        x = np.sort(rng.standard_normal(n))
    else:  # 99.5% exact zeros, as a masked DGC accumulation has
        x = np.zeros(n)
        x[rng.choice(n, 1500, replace=False)] = rng.standard_normal(1500)
    mags = np.abs(x).astype(np.float32)
    sizes = set()
    for seed in range(6):
        chosen = sampled_topk(mags, k, rng=np.random.default_rng(seed))
        _assert_is_top_set(mags, chosen, k)
        sizes.add(chosen.size)
    # and through the compressor: the values sent are the input's, at those indices
    c = C.TopKCompressor(k / n)
    x32 = x.astype(np.float32)
    (indices, values), _ = c.compress(x32, "t")
    _assert_is_top_set(mags, indices, c.k_for(n))
    assert_bitwise(values, x32[indices])


def test_sampled_topk_small_tensor_is_exact():
    x = randn(5000, np.float32, "small")
    chosen = sampled_topk(np.abs(x), 50, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(np.sort(chosen), np.sort(exact_topk(np.abs(x), 50)))
    assert chosen.size == 50


# ----------------------------------------------------------------------------- error feedback
@pytest.mark.parametrize("kind", ["topk-exact", "topk-sampled", "int8", "int8-stochastic", "fp16"])
def test_error_feedback_residual_is_exactly_what_was_dropped(kind):
    """After every step: compensated == gradient + previous residual and
    residual == compensated - decompress(compress(compensated)), bit for bit."""
    compressor = COMPRESSORS[kind]()
    if kind == "topk-sampled":
        compressor = C.TopKCompressor(0.01)
    memory = C.ResidualMemory()
    n = 70_001  # above the sample size: the sampled path runs
    previous = np.zeros(n, np.float32)
    sent_total = np.zeros(n, np.float64)
    grads_total = np.zeros(n, np.float64)
    for step in range(4):
        grad = randn(n, np.float32, f"ef-{kind}-{step}")
        grad_copy = grad.copy()
        compensated = memory.compensate(grad, "w")
        assert_bitwise(grad, grad_copy, "compensate must not modify the gradient")
        assert_bitwise(compensated, grad + previous if step else grad, f"step {step} compensated")
        payloads, ctx = compressor.compress(compensated, "w")
        # as the pipeline does: update gets the very array that was compressed (it may reuse
        # that buffer, which the memory owns, for the residual), so check against a copy
        before = compensated.copy()
        memory.update(compensated, "w", compressor, payloads, ctx)
        compensated = before
        sent = compressor.decompress(payloads, ctx)
        residual = memory.residuals["w"]
        assert_bitwise(residual, compensated - sent, f"step {step} residual")
        if kind.startswith("topk"):
            # what was sent is gone from the residual; the rest stays untouched
            sent_mask = np.zeros(n, bool)
            sent_mask[payloads[0]] = True
            assert not residual[sent_mask].any()
            assert_bitwise(residual[~sent_mask], compensated[~sent_mask])
        previous = residual.copy()
        sent_total += sent
        grads_total += grad
    # nothing is lost: everything sent plus what is left equals every gradient given
    np.testing.assert_allclose(sent_total + previous, grads_total, rtol=0, atol=1e-4)


def test_no_memory_keeps_nothing():
    memory = C.NoMemory()
    x = randn(100, np.float32, "nomem")
    assert memory.compensate(x, "a") is x
    memory.update(x, "a", C.TopKCompressor(0.1), *C.TopKCompressor(0.1).compress(x, "a"))
    assert memory.state_dict() == {}


# ----------------------------------------------------------------------------- int8
@pytest.mark.parametrize("chunk", [1, 7, 256, 1000])
@pytest.mark.parametrize("dtype", FLOATS, ids=[d.name for d in FLOATS])
def test_int8_error_bound_per_chunk(chunk, dtype):
    """Round to nearest: |x - q(x)| <= scale/2 per chunk (scale = max|chunk|/127), plus the
    float32 arithmetic and the output dtype's rounding; the payload is 1 byte an element
    plus one float32 scale per chunk."""
    n = 5003
    x = randn(n, dtype, f"int8-{chunk}-{dtype}", scale=0.01)
    c = C.Int8Compressor(chunk=chunk)
    payloads, ctx = c.compress(x, "t")
    nchunks = -(-n // chunk)
    assert payloads[0].nbytes == nchunks * chunk and payloads[1].dtype == np.float32
    assert payloads[1].size == nchunks
    out = c.decompress(payloads, ctx)
    xf = np.zeros(nchunks * chunk)
    xf[:n] = x.astype(np.float64)
    scale = np.abs(xf.reshape(-1, chunk)).max(axis=1) / 127
    err = np.abs(out.astype(np.float64) - x.astype(np.float64))
    padded = np.zeros(nchunks * chunk)
    padded[:n] = err
    eps_out = float(ml_dtypes.finfo(dtype).eps) if dtype == BF16 else float(np.finfo(dtype).eps)
    bound = scale[:, None] * (0.5 + 1e-5) + np.abs(xf.reshape(-1, chunk)) * eps_out
    assert np.all(padded.reshape(-1, chunk) <= bound + 1e-30)
    # not trivially exact: the quantiser does lose information
    if chunk > 1:
        assert err.max() > 0


def test_int8_zero_chunk_and_extremes():
    x = np.zeros(600, np.float32)
    x[300:] = randn(300, np.float32, "half")
    c = C.Int8Compressor(chunk=256)
    payloads, ctx = c.compress(x, "t")
    out = c.decompress(payloads, ctx)
    assert not out[:256].any()  # an all-zero chunk stays zero (scale 1, no division by zero)
    assert np.all(np.isfinite(out))
    # the largest magnitude of each chunk is reproduced to float32 rounding
    for lo in (256, 512):
        chunk = x[lo:lo + 256]
        i = np.argmax(np.abs(chunk))
        assert out[lo + i] == pytest.approx(chunk[i], rel=1e-6)


def test_int8_stochastic_rounding_is_unbiased():
    """The mean of many stochastic quantisations converges to the input (QSGD);
    round-to-nearest keeps a fixed bias on the same input."""
    chunk, draws = 64, 4000
    rng = rng_for("stoch")
    levels = rng.integers(-120, 120, chunk).astype(np.float64)
    fractions = rng.uniform(0.2, 0.8, chunk)  # far from .0/.5: nearest rounding is biased by >= 0.2
    x = ((levels + fractions) / 127.0).astype(np.float32)
    x[0] = 1.0  # pin the chunk's scale to 1/127
    scale = 1.0 / 127
    stochastic = C.Int8Compressor(chunk=chunk, stochastic=True, seed=11)
    total = np.zeros(chunk)
    for _ in range(draws):
        payloads, ctx = stochastic.compress(x, "t")
        q = stochastic.decompress(payloads, ctx).astype(np.float64)
        assert np.all(np.abs(q - x) < scale * (1 + 1e-5))  # one of the two neighbouring levels
        total += q
    mean = total / draws
    # each draw's error has standard deviation <= scale/2: 5 sigma of the mean
    sigma = scale / 2 / math.sqrt(draws)
    assert np.max(np.abs(mean - x)) < 5 * sigma
    nearest = C.Int8Compressor(chunk=chunk)
    q = nearest.decompress(*nearest.compress(x, "t")).astype(np.float64)
    assert np.max(np.abs(q - x)[1:]) > 0.19 * scale > 4 * 5 * sigma


# ----------------------------------------------------------------------------- DGC
def _dgc_step(memory, compressor, grad, name="w"):
    compensated = memory.compensate(grad, name)
    payloads, ctx = compressor.compress(compensated, name)
    memory.update(compensated, name, compressor, payloads, ctx)
    return payloads


def test_dgc_momentum_correction_and_masking_by_hand():
    """u = m*u + g; v = v + u; the top-k of v is sent; sent entries are cleared from u and v.
    All numbers are exact in binary floating point."""
    memory = C.DgcMemory(momentum=0.5)
    compressor = C.TopKCompressor(0.25, selection="exact")  # k = 1 of 4
    f32 = lambda *v: np.array(v, np.float32)  # noqa: E731

    idx, val = _dgc_step(memory, compressor, f32(1, -3, 2, 0.5))
    # u = v = g; |-3| is the largest
    assert idx.tolist() == [1] and val.tolist() == [-3]
    np.testing.assert_array_equal(memory.velocities["w"], f32(1, 0, 2, 0.5))
    np.testing.assert_array_equal(memory.accumulations["w"], f32(1, 0, 2, 0.5))

    idx, val = _dgc_step(memory, compressor, f32(0.5, 1, -4, 0.25))
    # u = 0.5*(1,0,2,.5) + g = (1, 1, -3, .5); v = (1,0,2,.5) + u = (2, 1, -1, 1)
    assert idx.tolist() == [0] and val.tolist() == [2]
    np.testing.assert_array_equal(memory.velocities["w"], f32(0, 1, -3, 0.5))
    np.testing.assert_array_equal(memory.accumulations["w"], f32(0, 1, -1, 1))

    idx, val = _dgc_step(memory, compressor, f32(1, 0, 1, 2))
    # u = 0.5*(0,1,-3,.5) + g = (1, .5, -.5, 2.25); v = (0,1,-1,1) + u = (1, 1.5, -1.5, 3.25)
    assert idx.tolist() == [3] and val.tolist() == [3.25]
    np.testing.assert_array_equal(memory.velocities["w"], f32(1, 0.5, -0.5, 0))
    np.testing.assert_array_equal(memory.accumulations["w"], f32(1, 1.5, -1.5, 0))

    # tensors are independent by name
    idx, val = _dgc_step(memory, compressor, f32(0, 0, 7, 0), name="b")
    assert idx.tolist() == [2] and val.tolist() == [7]
    np.testing.assert_array_equal(memory.accumulations["w"], f32(1, 1.5, -1.5, 0))


def test_dgc_local_gradient_clipping(monkeypatch):
    """The gradient is clipped to norm clip_norm / sqrt(size) before momentum (size patched to 4)."""
    monkeypatch.setattr(memory_module.runtime, "size", lambda: 4)
    memory = C.DgcMemory(momentum=0.0, clip_norm=2.0)  # limit 2 / sqrt(4) = 1
    v = memory.compensate(np.array([3.0, 4.0], np.float32), "a")  # norm 5 -> scaled by 1/5
    np.testing.assert_allclose(v, [0.6, 0.8], rtol=1e-6)
    small = np.array([0.3, -0.4], np.float32)  # norm 0.5 < 1: untouched
    np.testing.assert_array_equal(memory.compensate(small, "b"), small)


def test_dgc_matches_a_dense_reference_over_many_steps():
    """Random gradients over 6 steps: the memory equals a float64 reference of the
    paper's update (Lin et al., Algorithm 1 with momentum correction and factor masking)."""
    n, m = 2000, 0.9
    memory = C.DgcMemory(momentum=m)
    compressor = C.TopKCompressor(0.01, selection="exact")
    u = np.zeros(n)
    v = np.zeros(n)
    for step in range(6):
        g = randn(n, np.float32, f"dgc-ref-{step}")
        u = m * u + g
        v = v + u
        idx, val = _dgc_step(memory, compressor, g)
        expected = np.sort(np.argsort(-np.abs(v))[:20])
        np.testing.assert_array_equal(idx, expected)
        np.testing.assert_allclose(val, v[expected], rtol=1e-5)
        u[expected] = 0
        v[expected] = 0
        np.testing.assert_allclose(memory.velocities["w"], u, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(memory.accumulations["w"], v, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- schedule
def test_density_schedule():
    s = C.DensitySchedule(0.001, [0.25, 0.0625, 0.015625, 0.004])
    assert [s.at(e) for e in range(6)] == [0.25, 0.0625, 0.015625, 0.004, 0.001, 0.001]
    assert s.at(1000) == 0.001
    assert C.DensitySchedule(0.01).at(0) == 0.01


def test_dgc_warmup_through_set_epoch():
    gc = C.Compression.dgc(0.001)
    assert gc.compressor.density == C.DGC_WARMUP[0] == 0.25
    seen = []
    for epoch in range(7):
        gc.set_epoch(epoch)
        seen.append(gc.compressor.density)
    assert seen == [0.25, 0.0625, 0.015625, 0.004, 0.001, 0.001, 0.001]
    # the density in force decides k
    gc.set_epoch(0)
    assert gc.compressor.k_for(10_000) == 2500
    gc.set_epoch(9)
    assert gc.compressor.k_for(10_000) == 10
    # no warm-up: the final density from the start
    assert C.Compression.dgc(0.01, warmup=()).compressor.density == 0.01
    # compressions without a schedule ignore set_epoch
    topk = C.Compression.topk(0.02)
    topk.set_epoch(3)
    assert topk.compressor.density == 0.02


# ----------------------------------------------------------------------------- state
def _run(gc, grads, name="layer.weight"):
    """The pipeline's local half (compensate, compress, update) without communication."""
    out = []
    for g in grads:
        compensated = gc.memory.compensate(g, name)
        payloads, ctx = gc.compressor.compress(compensated, name)
        gc.memory.update(compensated, name, gc.compressor, payloads, ctx)
        out.append([p.copy() for p in payloads])
    return out


@pytest.mark.parametrize("factory", [lambda: C.Compression.topk(0.01, selection="exact"),
                                     lambda: C.Compression.dgc(0.01, warmup=(), selection="exact"),
                                     lambda: C.create("int8", error_feedback=True)],
                         ids=["topk", "dgc", "int8-ef"])
def test_state_dict_round_trip(factory):
    grads = [randn(3000, np.float32, f"sd-{i}") for i in range(6)]
    original = factory()
    _run(original, grads[:3])
    _run(original, grads[:1], name="other")
    state = {k: v.copy() for k, v in original.state_dict().items()}
    assert state, "error-feedback state is saved"
    assert all("/" in k for k in state)
    names = {k.split("/", 1)[1] for k in state}
    assert names == {"layer.weight", "other"}
    assert any(v.any() for v in state.values())

    restored = factory()
    checkpoint = {k: v.copy() for k, v in state.items()}
    restored.load_state_dict(state)
    assert set(restored.state_dict()) == set(state)
    for k, v in restored.state_dict().items():
        assert_bitwise(v, state[k], k)
        assert v is not state[k]  # copies: later steps do not write into the checkpoint
    after_original = _run(original, grads[3:])
    after_restored = _run(restored, grads[3:])
    for a, b in zip(after_original, after_restored):
        for pa, pb in zip(a, b):
            assert_bitwise(pa, pb)
    for k, v in state.items():  # loading copied: the later steps did not write into the checkpoint
        assert_bitwise(v, checkpoint[k], k)

    # a fresh one (no state) continues differently: the state matters
    fresh = _run(factory(), grads[3:4])
    assert not all(np.array_equal(a, b) for a, b in zip(fresh[0], after_original[0]))

    # loading an empty state clears it
    restored.load_state_dict({})
    assert restored.state_dict() == {}


# ----------------------------------------------------------------------------- API, registry
def test_namespace_registry_and_communicator_choice():
    import hvps.adapters.torch as hvd

    # the torch adapter's namespace builds the core's compressions, adding Horovod's tensor interface
    for name in ("none", "fp16", "bf16", "int8"):
        ours = getattr(hvd.Compression, name)
        assert isinstance(ours, C.GradientCompression) and ours.name == getattr(C.Compression, name).name
        assert callable(ours.compress) and callable(ours.decompress)
    assert hvd.Compression.topk(0.05).name == C.create("topk", density=0.05).name
    for name in ("none", "fp16", "bf16", "int8"):
        gc = getattr(C.Compression, name)
        assert isinstance(gc, C.GradientCompression)
        assert C.create(name).name == name
    assert set(C.REGISTRY) == {"none", "fp16", "bf16", "int8", "topk", "dgc", "powersgd"}
    topk = C.create("topk", density=0.05)
    assert isinstance(topk.compressor, C.TopKCompressor) and topk.compressor.density == 0.05
    assert isinstance(topk.memory, C.ResidualMemory)
    assert isinstance(C.create("topk", density=0.05, error_feedback=False).memory, C.NoMemory)
    dgc = C.create("dgc", density=0.001, momentum=0.8)
    assert isinstance(dgc.memory, C.DgcMemory) and dgc.memory.momentum == 0.8
    # summable payloads go through allreduce, sparse and quantised ones through allgather
    assert {n: C.create(n).summable for n in C.REGISTRY} == {
        "none": True, "fp16": True, "bf16": True, "int8": False, "topk": False, "dgc": False,
        "powersgd": False}  # PowerSGD's P and Q are summed, but in two rounds of its own
    assert isinstance(choose(C.CastCompressor("float16"), 2), Allreduce)
    assert isinstance(choose(C.TopKCompressor(0.1), 2), Allgather)
    # each access builds a new object: no state shared between two optimizers
    assert C.Compression.int8 is not C.Compression.int8
    # quantize is int8 with its options (it once bound the int8 property and raised TypeError)
    quantized = C.Compression.quantize(chunk=64, error_feedback=True)
    assert quantized.name == "int8" and quantized.compressor.chunk == 64
    assert isinstance(quantized.memory, C.ResidualMemory)


def test_payload_sizes_and_wire_model():
    n = 100_000
    x = randn(n, np.float32, "sizes")
    topk = C.TopKCompressor(0.01)
    payloads, _ = topk.compress(x, "t")
    assert sum(p.nbytes for p in payloads) <= 1000 * (4 + 4)
    int8 = C.Int8Compressor()
    payloads, _ = int8.compress(x, "t")
    assert sum(p.nbytes for p in payloads) == 100_096 + 4 * 391
    # ring allreduce: 2(n-1)/n of the buffer each way; allgather: own payload to n-1 peers
    assert Allreduce().wire_bytes([x], 4) == (int(x.nbytes * 1.5),) * 2
    assert Allreduce().wire_bytes([x], 1) == (0, 0)
    assert Allgather(3).wire_bytes([x[:10], x[:5]], 3) == (120, 120)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("density", [0, -0.1, 1.0001, 2, float("nan"), float("inf")])
def test_bad_density_raises_value_error(density):
    with pytest.raises(ValueError, match="density"):
        C.TopKCompressor(density)
    with pytest.raises(ValueError, match="density"):
        C.Compression.topk(density)
    with pytest.raises(ValueError, match="densit"):
        C.Compression.dgc(density)
    with pytest.raises(ValueError, match="densit"):
        C.create("topk", density=density)
    with pytest.raises(ValueError, match="densit"):
        C.DensitySchedule(0.01, [0.25, density])


@pytest.mark.parametrize("kind", [k for k in COMPRESSORS if k != "none"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.bool_, np.complex64])
def test_lossy_compressor_on_integer_tensor_raises_type_error(kind, dtype):
    x = np.ones(10, dtype)
    with pytest.raises(TypeError, match="floating-point"):
        COMPRESSORS[kind]().compress(x, "t")


def test_unknown_name_and_other_bad_arguments():
    with pytest.raises(ValueError, match="unknown compression 'zip'.*topk"):
        C.create("zip")
    with pytest.raises(TypeError):
        C.create("topk", ratio=0.1)  # the keyword is density
    with pytest.raises(ValueError, match="selection"):
        C.TopKCompressor(0.1, selection="approximate")
    with pytest.raises(ValueError, match="chunk"):
        C.Int8Compressor(chunk=0)
    with pytest.raises(ValueError, match="momentum"):
        C.DgcMemory(momentum=1.0)
    with pytest.raises(ValueError, match="clip_norm"):
        C.DgcMemory(clip_norm=0)
