"""Inner multi-rank tests of gradient compression (issue 4), run under mpirun by
``tests/test_compression_multirank.py`` with 2 and 3 ranks.

- The pipeline's exchange (allreduce of summable payloads, allgather + aggregate
  of sparse and quantised ones) gives the same result as a dense allreduce of
  every rank's decompressed tensor. Each rank computes its own decompressed
  tensor with a *twin*: a second, identically built compression run through the
  same local steps (error feedback, prescaling, same RNG draws) without
  communication.
- The statistics count exactly the payload bytes: what this rank sent, and what
  the other ranks' payloads (gathered separately) add up to.
- DistributedOptimizer with every compression keeps parameters bit-identical on
  all ranks.
"""

import time

import numpy as np
import pytest
import torch
from hvps_testutil import BF16, finfo, rng_for

import hvps
import hvps.adapters.torch as hvd
import hvps.compression as C

pytestmark = pytest.mark.timeout(240)

FACTORIES = {
    "none": lambda: C.Compression.none,
    "fp16": lambda: C.Compression.fp16,
    "bf16": lambda: C.Compression.bf16,
    "int8": lambda: C.Compression.int8,
    "int8-stochastic-ef": lambda: C.create("int8", chunk=64, stochastic=True, error_feedback=True),
    "topk-exact": lambda: C.Compression.topk(0.01, selection="exact"),
    "topk-sampled": lambda: C.Compression.topk(0.01),
    "topk-no-ef": lambda: C.Compression.topk(0.02, error_feedback=False),
    "dgc": lambda: C.Compression.dgc(0.01, warmup=(0.1,)),
    "dgc-clip": lambda: C.Compression.dgc(0.02, momentum=0.5, clip_norm=0.5, warmup=(), selection="exact"),
}
WIRE = {"fp16": np.dtype(np.float16), "bf16": BF16}

# (name, shape, dtype): one tensor larger than the 65,536-element sample, so
# sampled selection runs its sampled path (and counts differ between ranks)
TENSORS = [("big", (300_001,), np.float32), ("matrix", (33, 17), np.float32),
           ("bias", (5,), np.float32), ("double", (2048,), np.float64)]


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    torch.set_num_threads(1)
    yield


def _grad(key, rank, shape, dtype):
    rng = rng_for(key, rank)
    x = rng.standard_normal(shape) * rng.uniform(0.5, 2.0)
    if x.size > 8:
        x.reshape(-1)[rng.integers(x.size, size=4)] *= 30
    return x.astype(dtype)


def _twin_step(twin, array, name, average, size):
    """The local half of ``GradientCompression.start`` on the twin: returns (payloads, decompressed)."""
    compensated = twin.memory.compensate(array, name)
    prescale = twin.compressor.prescale(size) if average else 1.0
    if prescale != 1.0:  # as the pipeline scales: in float64 for float64, else in float32
        wide = np.float64 if compensated.dtype == np.float64 else np.float32
        compensated = (compensated * np.asarray(prescale, dtype=wide)).astype(compensated.dtype, copy=False)
    payloads, ctx = twin.compressor.compress(compensated, name)
    payloads = [p.copy() for p in payloads]
    decompressed = twin.compressor.decompress(payloads, ctx).copy()
    twin.memory.update(compensated, name, twin.compressor, payloads, ctx)
    return payloads, decompressed


def _same_on_all_ranks(array, what):
    flat = np.ascontiguousarray(array).reshape(1, -1)
    gathered = hvps.allgather(flat, name=f"check.{what}")
    for r in range(hvps.size()):
        assert np.array_equal(gathered[r].view(np.uint8), flat[0].view(np.uint8)), \
            f"{what}: rank {r} differs from rank {hvps.rank()}"


@pytest.mark.parametrize("op", ["Average", "Sum"])
@pytest.mark.parametrize("kind", list(FACTORIES))
def test_exchange_equals_dense_allreduce_of_decompressed(kind, op):
    size, rank = hvps.size(), hvps.rank()
    average = op == "Average"
    pipeline, twin = FACTORIES[kind](), FACTORIES[kind]()
    for step in range(3):
        for tname, shape, dtype in TENSORS:
            name = f"{kind}.{op}.{tname}"
            key = f"{name}.{step}"
            x = _grad(key, rank, shape, dtype)
            original = x.copy()
            pending = pipeline.start(x, name, getattr(hvps.ReduceOp, op))
            result = pending.wait()
            if kind != "none":  # "none" sends the gradient itself, reduced in place
                assert np.array_equal(x, original), "compression must not modify the gradient"
            assert result.shape == x.shape and result.dtype == x.dtype
            _same_on_all_ranks(result, f"{key}.result")

            _, own = _twin_step(twin, original.copy(), name, average, size)
            dense = hvps.allreduce(own, op=hvps.Sum, name=f"{key}.dense")
            bound = hvps.allreduce(np.abs(own).astype(np.float64), op=hvps.Sum, name=f"{key}.bound")
            if average and twin.compressor.prescale(size) == 1.0:
                dense = dense / dtype(size)
                bound = bound / size
            # fp16/bf16 payloads are summed in the wire dtype; the rest in the gradient's dtype
            eps = float(finfo(WIRE.get(kind, dtype)).eps)
            tol = 2 * size * eps * bound + 1e-30
            err = np.abs(result.astype(np.float64) - dense.astype(np.float64))
            assert np.all(err <= tol), (
                f"{key}: {np.sum(err > tol)} of {err.size} off; max err {err.max()} tol {tol.max()}")
            if kind == "dgc-clip" and step == 0:
                # local clipping to clip_norm / sqrt(size) before momentum; masking only lowers the norm
                assert np.linalg.norm(pipeline.memory.velocities[name]) <= 0.5 / np.sqrt(size) * (1 + 1e-5)
            if kind.startswith(("topk", "dgc")):
                # sparse: only indices some rank sent are nonzero
                assert np.count_nonzero(result) <= size * max(1, int(x.size * pipeline.compressor.density))

            if step == 0 and kind in ("none", "int8", "topk-exact"):
                # independent reference: every rank's input, compressed by a fresh compressor
                ref = np.zeros(shape, np.float64)
                ref_abs = np.zeros(shape, np.float64)
                for r in range(size):
                    fresh = FACTORIES[kind]().compressor
                    part = fresh.decompress(*fresh.compress(_grad(key, r, shape, dtype), name))
                    ref += part
                    ref_abs += np.abs(part)
                if average:
                    ref /= size
                    ref_abs /= size
                err = np.abs(result.astype(np.float64) - ref)
                assert np.all(err <= 2 * size * float(finfo(dtype).eps) * ref_abs + 1e-30), f"{key}: reference"


def _payload_bytes(payloads):
    return sum(p.nbytes for p in payloads)


@pytest.mark.parametrize("kind", list(FACTORIES))
def test_stats_count_payload_bytes(kind):
    size, rank = hvps.size(), hvps.rank()
    pipeline, twin = FACTORIES[kind](), FACTORIES[kind]()
    expected = {"sent": 0, "received": 0, "dense": 0}
    unequal = False
    started = time.perf_counter()
    for tname, shape, dtype in TENSORS:
        name = f"stats.{kind}.{tname}"
        x = _grad(name, rank, shape, dtype)
        payloads, _ = _twin_step(twin, x.copy(), name, True, size)
        own = _payload_bytes(payloads)
        every = hvps.allgather(np.array([own], np.int64), name=f"{name}.sizes")
        unequal |= len(set(every.tolist())) > 1
        bus = 2 * (size - 1) / size
        if pipeline.summable:  # ring allreduce model: 2(n-1)/n of the payload each way
            expected["sent"] += int(own * bus)
            expected["received"] += int(own * bus)
        else:  # allgather: own payload to n-1 peers; every other rank's payload in
            expected["sent"] += own * (size - 1)
            expected["received"] += int(every.sum() - own)
        expected["dense"] += int(x.nbytes * bus)
        pipeline.start(x, name).wait()
        if kind in ("fp16", "bf16"):
            assert own == x.size * 2
        elif kind.startswith("int8"):
            chunk = 64 if "stochastic" in kind else 256
            nchunks = -(-x.size // chunk)
            assert own == nchunks * chunk + 4 * nchunks  # int8 per element (padded) + a float32 scale
        elif kind.startswith(("topk", "dgc")):
            k = max(1, int(x.size * twin.compressor.density))
            itemsize = np.dtype(dtype).itemsize
            assert own <= k * (4 + itemsize)
            if kind == "topk-exact":
                assert own == k * (4 + itemsize)
    elapsed = time.perf_counter() - started
    stats = pipeline.stats
    assert stats.exchanges == len(TENSORS)
    assert stats.bytes_sent == expected["sent"]
    assert stats.bytes_received == expected["received"], (stats.bytes_received, expected["received"])
    assert stats.dense_bytes == expected["dense"]
    assert stats.ratio == pytest.approx(expected["dense"] / expected["sent"])
    # both sides were timed on every exchange, and only within it
    assert stats.compress_seconds > 0 and stats.decompress_seconds > 0
    assert stats.compress_seconds + stats.decompress_seconds < elapsed, (stats.as_dict(), elapsed)
    as_dict = stats.as_dict()
    assert as_dict["bytes_sent"] == expected["sent"] and as_dict["ratio"] == stats.ratio
    if kind == "topk-sampled":
        # the sampled selection sends between 0.8k and k entries: ranks differ, and
        # the receive side must count what actually came, not the own size times n-1
        assert unequal, "test data should give ranks different payload sizes"
    stats.reset()
    assert stats.exchanges == 0 and stats.bytes_sent == 0


def test_lossy_pipeline_rejects_integers_before_touching_state():
    for kind in ("fp16", "int8", "topk-sampled", "dgc"):
        gc = FACTORIES[kind]()
        with pytest.raises(TypeError, match="floating-point"):
            gc.start(np.arange(10, dtype=np.int64), "ints")
        assert gc.state_dict() == {} and gc.stats.exchanges == 0
    # integers pass through uncompressed
    gc = C.Compression.none
    out = gc.start(np.arange(6, dtype=np.int64) * (hvps.rank() + 1), "ints.none", hvps.Sum).wait()
    np.testing.assert_array_equal(out, np.arange(6) * sum(range(1, hvps.size() + 1)))


# ----------------------------------------------------------------------------- optimizer
def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("kind", list(FACTORIES))
def test_distributed_optimizer_keeps_parameters_identical(kind):
    size, rank = hvd.size(), hvd.rank()
    model = _mlp(3 + rank)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    start = _flat(model).clone()
    compression = FACTORIES[kind]()
    momentum = 0.0 if kind.startswith("dgc") else 0.9  # DGC applies momentum itself
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum),
                                   named_parameters=model.named_parameters(), compression=compression)
    assert opt.compression is compression
    g = torch.Generator().manual_seed(500 + rank)  # every rank its own data
    steps = 4
    for step in range(steps):
        opt.set_epoch(step)
        x = torch.randn(16, 20, generator=g)
        y = torch.randint(0, 5, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        flat = _flat(model)
        gathered = hvd.allgather(flat.reshape(1, -1), name=f"opt.{kind}.{step}")
        for r in range(size):
            assert torch.equal(gathered[r], flat), f"{kind} step {step}: rank {r} differs from rank {rank}"
    assert not torch.equal(_flat(model), start), "training moved the parameters"
    n_params = len(list(model.parameters()))
    stats = opt.compression_stats()
    assert stats["exchanges"] == steps * n_params
    assert stats["bytes_sent"] > 0 and stats["dense_bytes"] > 0
    if kind in ("topk-exact", "topk-sampled", "dgc", "dgc-clip"):
        assert stats["ratio"] > 10
    elif kind in ("fp16", "bf16"):
        assert stats["ratio"] == pytest.approx(2.0, rel=1e-3)
    elif kind.startswith("int8"):
        # allgathered: own payload (~1/4, small tensors padded to a chunk) to each of n-1 peers
        assert stats["bytes_sent"] < stats["dense_bytes"]
    state = opt.compression.state_dict()
    if kind in ("topk-exact", "topk-sampled", "int8-stochastic-ef", "dgc", "dgc-clip"):
        names = {key.split("/", 1)[1] for key in state}
        assert names == {f"grad.{n}" for n, _ in model.named_parameters()}
    else:
        assert state == {}
