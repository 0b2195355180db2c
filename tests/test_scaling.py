"""hvps.core.scaling (prescale, postscale, Average, predivide, the overflow guard) and what the
adapters share in hvps.adapters.common, against numpy references with fresh random data."""

import numpy as np
import pytest
import torch

from hvps import ReduceOp
from hvps.adapters.common import options
from hvps.adapters.common.controls import CompressionControls
from hvps.adapters.common.ops import resolve_op
from hvps.compression import Compression, GradientCompression
from hvps.compression.framework_compressors import as_gradient_compression
from hvps.compression.summable import summable_plan
from hvps.core import arrays, dtypes, scaling
from hvps.core.views import as_tensor

pytestmark = pytest.mark.unit

RNG = np.random.default_rng()
INTS = ["int8", "int16", "int32", "int64", "uint8"]
FLOATS = ["float16", "bfloat16", "float32", "float64"]


def _random(name: str, n: int = 257) -> np.ndarray:
    dtype = dtypes.BY_NAME[name]
    if name in INTS:
        info = np.iinfo(dtype)
        low, high = max(info.min, -100), min(info.max, 100)
        return RNG.integers(low, high, n).astype(dtype)
    return (RNG.standard_normal(n) * 10).astype(dtype)


@pytest.mark.parametrize("name", INTS + FLOATS)
def test_scale_matches_reference_on_numpy_and_torch(name):
    array = _random(name)
    factor = float(RNG.uniform(0.1, 3.0))
    if name in INTS:
        expected = np.trunc(array.astype(np.float64) * factor).astype(array.dtype)
    elif name in ("float16", "bfloat16"):
        expected = (array.astype(np.float32) * np.float32(factor)).astype(array.dtype)
    else:
        expected = array * array.dtype.type(factor)
    host, tensor = array.copy(), as_tensor(array.copy())
    scaling.scale(host, factor)
    scaling.scale(tensor, factor)
    np.testing.assert_array_equal(host, expected)
    assert torch.equal(tensor, as_tensor(expected))


@pytest.mark.parametrize("name", INTS + FLOATS)
def test_divide_rounds_integers_toward_zero(name):
    array = _random(name)
    size = int(RNG.integers(2, 7))
    if name in INTS:
        expected = np.trunc(array.astype(np.float64) / size).astype(array.dtype)
    elif name in ("float16", "bfloat16"):
        expected = (array.astype(np.float32) / np.float32(size)).astype(array.dtype)
    else:
        expected = array / array.dtype.type(size)
    host, tensor = array.copy(), as_tensor(array.copy())
    scaling.divide(host, size)
    scaling.divide(tensor, size)
    np.testing.assert_array_equal(host, expected)
    assert torch.equal(tensor, as_tensor(expected))


def test_bool_factors_raise_and_unit_factors_are_no_ops():
    for array in (np.ones(3, np.bool_), torch.ones(3, dtype=torch.bool)):
        with pytest.raises(TypeError, match="not defined for bool"):
            scaling.scale(array, 0.5)
        scaling.scale(array, 1.0)  # nothing to do, nothing refused


def test_prescaled_and_finish():
    src = RNG.standard_normal(64).astype(np.float32)
    kept = src.copy()
    assert scaling.prescaled(src, 1.0) is src
    copy = scaling.prescaled(src, 0.25)
    np.testing.assert_array_equal(copy, kept * np.float32(0.25))
    np.testing.assert_array_equal(src, kept)  # the input is never changed
    out = np.empty_like(src)
    assert scaling.prescaled(src, 0.5, out=out) is out
    np.testing.assert_array_equal(out, kept * np.float32(0.5))
    summed = RNG.integers(-50, 50, 31).astype(np.int32)
    finished = summed.copy()
    scaling.finish(finished, ReduceOp.Average, 4, 3.0)
    expected = np.trunc(np.trunc(summed / 4) * 3.0).astype(np.int32)
    np.testing.assert_array_equal(finished, expected)
    assert scaling.wire_op(ReduceOp.Average) is ReduceOp.Sum
    assert scaling.wire_op(ReduceOp.Max) is ReduceOp.Max


def test_scaled_keeps_float64_precision():
    array = RNG.standard_normal(100)
    np.testing.assert_array_equal(scaling.scaled(array, 1 / 3), array * (1 / 3))
    small = array.astype(np.float32)
    np.testing.assert_array_equal(scaling.scaled(small, 1 / 3), small * np.float32(1 / 3))
    assert scaling.scaled(small, 1 / 3).dtype == np.float32


def test_predivide_factors():
    factor = float(RNG.uniform(1.5, 8.0))
    assert scaling.predivide_factors(ReduceOp.Average, factor) == (1.0 / factor, factor)
    assert scaling.predivide_factors(ReduceOp.Sum, 1.0) == (1.0, 1.0)
    with pytest.raises(ValueError, match="only defined for op=Average"):
        scaling.predivide_factors(ReduceOp.Sum, factor)


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_sum_plan_gives_the_average_and_calls_size_only_when_needed(size):
    calls = []

    def ranks():
        calls.append(1)
        return size

    pre, post = 0.5, 2.0
    plain = scaling.sum_plan(ReduceOp.Average, ranks, None, pre, post)
    assert plain == (1.0, ReduceOp.Average, pre, post, 1.0) and not calls
    assert scaling.sum_plan(ReduceOp.Sum, ranks, scaling.overflow_guard, pre, post) == (1.0, ReduceOp.Sum, pre,
                                                                                          post, 1.0)
    assert not calls
    guarded = scaling.sum_plan(ReduceOp.Average, ranks, scaling.overflow_guard, pre, post)
    assert calls
    if size == 1:
        assert guarded == plain
    else:
        assert guarded == (pre / size, ReduceOp.Sum, 1.0, 1.0, post * (1.0 / size) / (1.0 / size))
    # whatever the plan, the result is postscale * sum(prescale * x) / size
    xs = RNG.standard_normal((size, 16))
    for plan in (plain, guarded, scaling.sum_plan(ReduceOp.Average, ranks, None, pre, post,
                                                  collective_averages=False)):
        total = (xs * plan.before * plan.prescale).sum(axis=0)
        total = total / size * plan.postscale if plan.op is ReduceOp.Average else total * plan.postscale
        np.testing.assert_allclose(total * plan.after, post * (pre * xs).sum(axis=0) / size, rtol=1e-12)


def test_summable_plan_guards_casts_of_floating_tensors_only():
    size = int(RNG.integers(2, 9))
    fp16, none = Compression.fp16.compressor, Compression.none.compressor
    assert summable_plan(fp16, ReduceOp.Average, lambda: size).before == 1.0 / size
    assert summable_plan(fp16, ReduceOp.Average, lambda: size, all_floating=False).op is ReduceOp.Average
    assert summable_plan(none, ReduceOp.Average, lambda: pytest.fail("size asked")).op is ReduceOp.Average


class _Ops:
    is_floating = staticmethod(lambda t: t.dtype.is_floating_point)
    scale = staticmethod(lambda t, factor: t * factor)
    divide = staticmethod(lambda t, divisor: t / divisor)


def test_tensor_helpers():
    ts = [torch.randn(5), torch.randn(3)]
    assert scaling.scale_all(ts, 1.0, _Ops) is ts
    for got, t in zip(scaling.scale_all(ts, 0.5, _Ops), ts):
        assert torch.equal(got, t * 0.5)
    assert torch.equal(scaling.averaged(ts[0], ReduceOp.Average, 4, _Ops), ts[0] / 4)
    assert scaling.averaged(ts[0], ReduceOp.Sum, 4, _Ops) is ts[0]
    assert scaling.gradient_factor(ReduceOp.Sum, 3, 0.5, 2.0) == 3.0
    assert scaling.gradient_factor(ReduceOp.Average, 3, 0.5, 4.0) == 2.0


def test_resolve_op():
    assert resolve_op(None, None) is ReduceOp.Average
    assert resolve_op(False, None) is ReduceOp.Sum
    assert resolve_op(True, None) is ReduceOp.Average
    assert resolve_op(None, ReduceOp.Max) is ReduceOp.Max
    assert resolve_op(None, "min") is ReduceOp.Min
    with pytest.raises(ValueError, match="not both"):
        resolve_op(True, ReduceOp.Sum)
    with pytest.raises(ValueError, match="unknown reduce op"):
        resolve_op(None, "median")


def _as_compression(compression):
    return as_gradient_compression(compression, lambda a: a, lambda t: t)


def test_gradient_options():
    opts = options.gradient_options(ReduceOp.Average, 4.0, None, _as_compression)
    assert opts.op is ReduceOp.Average and opts.compression.name == "none"
    assert (opts.prescale, opts.postscale) == (0.25, 4.0)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        options.gradient_options(None, 1.0, None, _as_compression, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="only defined for op=Average"):
        options.gradient_options(ReduceOp.Sum, 2.0, None, _as_compression)
    with pytest.raises(ValueError, match="with Average, Sum or Adasum, not ReduceOp.Min"):
        options.gradient_options(ReduceOp.Min, 1.0, None, _as_compression,
                                 ops=(ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum))
    with pytest.raises(ValueError, match="with Average or Sum only, not Max"):
        options.gradient_options(ReduceOp.Max, 1.0, Compression.topk(0.1), _as_compression)
    assert options.gradient_options(ReduceOp.Max, 1.0, Compression.fp16, _as_compression).op is ReduceOp.Max
    with pytest.raises(TypeError, match="compression must be"):
        options.gradient_options(None, 1.0, "fp16", _as_compression)


def test_compression_controls():
    class Wrapper(CompressionControls):
        def __init__(self, compression: GradientCompression) -> None:
            self.compression = compression

    dgc = Compression.dgc(0.01, warmup=[0.5])
    wrapper = Wrapper(dgc)
    assert dgc.compressor.density == 0.5
    wrapper.set_epoch(3)
    assert dgc.compressor.density == 0.01
    dgc.stats.bytes_sent, dgc.stats.dense_bytes = 10, 40
    assert wrapper.compression_stats()["ratio"] == 4.0


def test_a_read_only_send_buffer_becomes_a_tensor_without_a_warning():
    import warnings

    sent = np.frombuffer(b"\x01\x02\x03\x04", dtype=np.uint8)  # read-only, as pickled objects travel
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert as_tensor(sent).tolist() == [1, 2, 3, 4]


def test_same_address_tells_an_in_place_collective_from_one_between_arrays():
    buffer = np.arange(8, dtype=np.float32)
    assert arrays.same_address(buffer, buffer) and arrays.same_address(buffer, buffer.reshape(2, 4))
    assert arrays.same_address(buffer[:4], buffer.reshape(-1))  # a view from the same start
    assert not arrays.same_address(buffer[1:], buffer)  # overlapping, another start
    assert not arrays.same_address(buffer, np.arange(8, dtype=np.float32))
