"""Helpers shared by the inner multi-rank tests.

All data is random but reproducible: every rank can regenerate every other
rank's input from (test key, rank), so references are computed locally with
numpy, independently of hvps.
"""

import os
import zlib

import ml_dtypes
import numpy as np

from hvps.core.launchers import env_size

BF16 = np.dtype(ml_dtypes.bfloat16)

DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": BF16,
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
}
DTYPE_NAMES = list(DTYPES)
FLOAT_NAMES = ["float16", "bfloat16", "float32", "float64"]
INT_NAMES = ["int32", "int64", "uint8"]
UNSUPPORTED = [np.complex64, np.uint32, np.uint64]

OP_NAMES = ["Sum", "Average", "Min", "Max", "Product"]

MIB = 1 << 20


def is_float(dt):
    dt = np.dtype(dt)
    return dt == BF16 or dt.kind == "f"


def is_bool(dt):
    return np.dtype(dt) == np.bool_


def is_int(dt):
    return np.dtype(dt).kind in "iu"


def finfo(dt):
    dt = np.dtype(dt)
    return ml_dtypes.finfo(dt) if dt == BF16 else np.finfo(dt)


def big_count(dt, nbytes=5 * MIB // 4):
    """Element count of a ~1.25 MiB buffer: above the size that a fused allreduce reduces where it lies
    (``REDUCED_ALONE_BYTES``, 1 MiB) and far above MPI's eager limits (so large messages take their own
    protocols); one element more than that, so the ring's segments are uneven at every rank count. (It was
    3 MiB: the float16 and bfloat16 cases then cost ~1 s each at 3 ranks, in test-side arithmetic and
    emulated half-precision sums, for no path that 1.25 MiB does not take.)"""
    return nbytes // np.dtype(dt).itemsize + 1


def world_size_env():
    """The job's size as its launcher said (hvps.core.launchers' one rule)."""
    return env_size()


def rng_for(key, rank):
    seed = zlib.crc32(f"{key}#{rank}".encode())
    return np.random.default_rng(seed)


def random_array(dtype, shape, key, rank, op="Sum"):
    return np.asarray(_random_array(dtype, shape, key, rank, op))


def _random_array(dtype, shape, key, rank, op):
    """Fresh random data for (key, rank).  Ranges keep integer reductions
    free of overflow for up to 3 ranks (so numpy and MPI agree without
    relying on wrap-around) and floats away from overflow."""
    dt = np.dtype(dtype)
    rng = rng_for(key, rank)
    shape = tuple(shape)
    if is_bool(dt):
        return rng.random(shape) < 0.5
    if is_float(dt):
        if op == "Product":
            mag = rng.uniform(0.5, 2.0, shape)
            sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
            return (mag * sign).astype(dt)
        return (rng.standard_normal(shape) * 2.0).astype(dt)
    if dt == np.uint8:
        hi = 7 if op == "Product" else (256 if op in ("Min", "Max") else 80)
        return rng.integers(0, hi, shape).astype(dt)
    if dt == np.uint16:  # the whole range for Min/Max (above int16's), no wrap-around for 3 ranks otherwise
        hi = 40 if op == "Product" else (1 << 16 if op in ("Min", "Max") else 20000)
        return rng.integers(0, hi, shape).astype(dt)
    lo, hi = (-30, 31) if op == "Product" else (-1000, 1001)
    return rng.integers(lo, hi, shape).astype(dt)


def all_inputs(dtype, shape, key, size, op="Sum"):
    return [random_array(dtype, shape, key, r, op) for r in range(size)]


def _scale_int(a, f, dt):
    if f == 1.0:
        return a
    return (a.astype(np.float64) * f).astype(dt)


def ref_allreduce(arrays, op, size, prescale=1.0, postscale=1.0):
    """Return (reference, error_bound_or_None).  For floating dtypes the
    reference is float64 and error_bound an elementwise magnitude bound used
    to derive the tolerance; for integer/bool the reference has the input
    dtype and must match exactly."""
    dt = arrays[0].dtype
    if is_bool(dt):
        if op == "Average":
            raise TypeError("Average on bool")
        if op in ("Sum", "Max"):
            return np.logical_or.reduce(np.stack(arrays), axis=0), None
        return np.logical_and.reduce(np.stack(arrays), axis=0), None
    if is_int(dt):
        xs = [_scale_int(a, prescale, dt) for a in arrays]
        st = np.stack(xs)
        if op in ("Sum", "Average"):
            res = np.add.reduce(st, axis=0, dtype=dt)
            if op == "Average":
                res = (np.sign(res) * (np.abs(res) // size)).astype(dt)  # toward zero, as Horovod
        elif op == "Min":
            res = st.min(axis=0)
        elif op == "Max":
            res = st.max(axis=0)
        else:
            res = np.multiply.reduce(st, axis=0, dtype=dt)
        return _scale_int(res, postscale, dt), None
    # rank by rank in float64 (the order a stacked reduce over axis 0 takes, without the stack)
    fold = {"Sum": np.add, "Average": np.add, "Min": np.minimum, "Max": np.maximum, "Product": np.multiply}[op]
    res = bound = None
    for a in arrays:
        x = a.astype(np.float64)
        if prescale != 1.0:
            x *= prescale
        if res is None:
            res = x.copy()
            bound = np.abs(x) if op in ("Sum", "Average") else None
            continue
        fold(res, x, out=res)
        if bound is not None:
            bound += np.abs(x, out=x)
    if op == "Average":
        res /= size
        bound /= size
    if bound is None:
        bound = np.abs(res)
    if postscale != 1.0:
        res *= postscale
        bound *= abs(postscale)
    return res, bound


def check_allreduce_result(result, arrays, op, size, prescale=1.0, postscale=1.0,
                           what=""):
    dt = arrays[0].dtype
    assert isinstance(result, np.ndarray), f"{what}: result type {type(result)}"
    assert result.dtype == dt, f"{what}: dtype {result.dtype} != {dt}"
    assert result.shape == arrays[0].shape, f"{what}: shape {result.shape} != {arrays[0].shape}"
    ref, bound = ref_allreduce(arrays, op, size, prescale, postscale)
    if bound is None:
        assert_exact(result, ref, what)
        return
    exact_ok = op in ("Min", "Max") and prescale == 1.0 and postscale == 1.0
    if exact_ok:
        assert_exact(result, ref.astype(dt), what)
        return
    fi = finfo(dt)
    eps = float(fi.eps)
    tiny = float(fi.tiny)
    nterms = size + 3
    tol = np.abs(ref)
    tol += bound
    tol *= nterms * eps
    tol += 4 * tiny  # nterms * eps * (bound + |ref|) + 4 * tiny
    got = result.astype(np.float64)
    err = np.abs(got - ref)
    bad = ~(err <= tol)
    if bad.any():
        idx = np.flatnonzero(bad.ravel())[:10]
        raise AssertionError(
            f"{what}: {bad.sum()} of {bad.size} elements out of tolerance; "
            f"first idx {idx.tolist()} got {got.ravel()[idx].tolist()} "
            f"ref {ref.ravel()[idx].tolist()} tol {tol.ravel()[idx].tolist()}")


def assert_exact(result, ref, what=""):
    result = np.asarray(result)
    ref = np.asarray(ref)
    assert result.dtype == ref.dtype, f"{what}: dtype {result.dtype} != {ref.dtype}"
    assert result.shape == ref.shape, f"{what}: shape {result.shape} != {ref.shape}"
    a = np.ascontiguousarray(result).reshape(-1).view(np.uint8)
    b = np.ascontiguousarray(ref).reshape(-1).view(np.uint8)
    if not np.array_equal(a, b):
        ne = np.flatnonzero(result.ravel() != ref.ravel())[:10]
        raise AssertionError(
            f"{what}: arrays differ at {ne.tolist()}: got "
            f"{result.ravel()[ne].tolist()} expected {ref.ravel()[ne].tolist()}")


def rows_split(n, size):
    """Row counts per rank for reducescatter: first n % size ranks get one more."""
    base, extra = divmod(n, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def overflowing_halves(key, size, n=257):
    """Per rank, float32 values in [40000, 60000): their float16 sum over 2 or 3 ranks overflows
    (float16's largest is 65504) though their average does not. Fresh per ``key``."""
    seed = zlib.crc32(key.encode())
    return [np.random.default_rng([seed, r]).uniform(40000, 60000, n).astype(np.float32) for r in range(size)]


def check_guarded_average(results, arrays):
    """Every path's float16-compressed average: finite, and within float16 rounding of the exact mean."""
    exact = np.mean(np.stack(arrays).astype(np.float64), axis=0)
    for path, result in results.items():
        result = np.asarray(result, dtype=np.float64)
        assert np.isfinite(result).all(), f"{path}: the float16 sum overflowed ({np.isinf(result).sum()} inf)"
        np.testing.assert_allclose(result, exact, rtol=2e-3, err_msg=path)


def shared_dir(name):
    """A directory every rank sees: under HVPS_TEST_SHARED_DIR, else a fresh one from rank 0
    (never a fixed /tmp path, whose leftovers from an earlier run would be loaded). Collective."""
    import tempfile
    from pathlib import Path

    import hvps

    base = os.environ.get("HVPS_TEST_SHARED_DIR")
    if not base:
        base = hvps.broadcast_object(tempfile.mkdtemp(prefix="hvps-store-") if hvps.rank() == 0 else None, 0)
    path = Path(base) / name
    if hvps.rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    hvps.barrier()
    return path


def replicated_checkpoint(model, optimizer, train, directory, **wrap):
    """A replicated run (``hvd.DistributedOptimizer`` over ``optimizer``, with the keywords ``wrap``: ``shard=True``
    for a ShardedOptimizer run) trained by ``train(wrapped optimizer)`` and saved as epoch 1 in ``directory`` (dense,
    or the dense model plus the optimizer shards): ``(the wrapped optimizer, its CheckpointManager)``. Collective."""
    import hvps.adapters.torch as hvd

    replicated = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), **wrap)
    train(replicated)
    manager = hvd.CheckpointManager(directory, fsync=False)
    manager.save(1, model=model, optimizer=replicated)
    return replicated, manager


def dyadic(model):
    """``model`` with every parameter rounded to a multiple of 1/8 (its sums stay exact in float32), returned."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.round(p * 8) / 8)
    return model


def shifted(model):
    """``model`` with 1 added to every parameter (so that a load that leaves one out shows), returned."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    return model


def assert_same_optimizer_state(state_dict, reference):
    """Optimizer state dicts ``state_dict`` and ``reference`` hold the same groups and the same state, bit for bit."""
    import torch

    assert state_dict["param_groups"] == reference["param_groups"]
    assert state_dict["state"].keys() == reference["state"].keys()
    for index, entry in reference["state"].items():
        mine = state_dict["state"][index]
        assert mine.keys() == entry.keys(), index
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(mine[key]), torch.as_tensor(value)), (index, key)
