"""Inner multi-rank tests: allreduce and grouped_allreduce (numpy core API).

Run by tests/test_multirank.py under mpirun with np in (2, 3) and with
HVPS_ALLREDUCE_ALGORITHM=mpi and =ring; also run in a plain process
(world size 1) by tests/test_single_process.py.
"""

import numpy as np
import pytest
from hvps_testutil import (
    DTYPE_NAMES,
    DTYPES,
    FLOAT_NAMES,
    INT_NAMES,
    MIB,
    OP_NAMES,
    all_inputs,
    assert_exact,
    big_count,
    check_allreduce_result,
    rng_for,
)

import hvps

pytestmark = pytest.mark.timeout(180)

SHAPES = ["empty", "one", "odd", "big"]


def make_shape(name, dt):
    return {"empty": (0,), "one": (1,), "odd": (7, 11, 13),
            "big": (big_count(dt),)}[name]


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvps.init()
    assert hvps.is_initialized()
    yield


def _op(name):
    return getattr(hvps, name)


CASES = [(d, o, s) for d in DTYPE_NAMES for o in OP_NAMES for s in SHAPES
         if not (d == "bool" and o == "Average")]


@pytest.mark.parametrize("dtype,op,shape", CASES)
def test_allreduce(dtype, op, shape, request):
    dt = DTYPES[dtype]
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    xs = all_inputs(dt, make_shape(shape, dt), key, size, op)
    x = xs[rank].copy()
    res = hvps.allreduce(x, op=_op(op))
    check_allreduce_result(res, xs, op, size, what=key)
    assert_exact(x, xs[rank], f"{key}: input was modified")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("op", ["Sum", "Max"])
def test_allreduce_async_scalar_and_2d(dtype, op, request):
    dt = DTYPES[dtype]
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    s_in = all_inputs(dt, (), key + "s", size, op)
    m_in = all_inputs(dt, (5, 3), key + "m", size, op)
    h1 = hvps.allreduce_async(s_in[rank].copy(), op=_op(op))
    h2 = hvps.allreduce_async(m_in[rank].copy(), op=_op(op))
    check_allreduce_result(np.asarray(h2.wait()), m_in, op, size, what=key + "m")
    check_allreduce_result(np.asarray(h1.wait()), s_in, op, size, what=key + "s")


@pytest.mark.parametrize("dtype", FLOAT_NAMES + INT_NAMES)
def test_allreduce_default_op_is_average(dtype, request):
    dt = DTYPES[dtype]
    size, rank = hvps.size(), hvps.rank()
    xs = all_inputs(dt, (101,), request.node.name, size, "Average")
    res = hvps.allreduce(xs[rank].copy())
    check_allreduce_result(res, xs, "Average", size, what=request.node.name)


@pytest.mark.parametrize("dtype", FLOAT_NAMES + INT_NAMES)
@pytest.mark.parametrize("op", ["Sum", "Average", "Max"])
@pytest.mark.parametrize("shape", ["odd", "big"])
def test_allreduce_prescale_postscale(dtype, op, shape, request):
    dt = DTYPES[dtype]
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    xs = all_inputs(dt, make_shape(shape, dt), key, size, op)
    # uint8: keep post * reduce(pre * x) inside [0, 255] (float->uint8
    # casts of out-of-range values are undefined in numpy).
    pre, post = (0.5, 2.0) if dtype == "uint8" else (0.5, 3.0)
    res = hvps.allreduce(xs[rank].copy(), op=_op(op), prescale_factor=pre,
                         postscale_factor=post)
    check_allreduce_result(res, xs, op, size, pre, post, what=key)


@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_allreduce_async_prescale_postscale(dtype, request):
    dt = DTYPES[dtype]
    size, rank = hvps.size(), hvps.rank()
    xs = all_inputs(dt, (333,), request.node.name, size)
    h = hvps.allreduce_async(xs[rank].copy(), op=hvps.Sum, prescale_factor=0.25,
                             postscale_factor=2.0)
    check_allreduce_result(h.wait(), xs, "Sum", size, 0.25, 2.0, what=request.node.name)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", ["odd", "big"])
def test_allreduce_out_in_place(dtype, shape, request):
    dt = DTYPES[dtype]
    op = "Max" if dtype == "bool" else "Sum"
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    xs = all_inputs(dt, make_shape(shape, dt), key, size, op)
    x = xs[rank].copy()
    res = hvps.allreduce(x, op=_op(op), out=x)
    check_allreduce_result(x, xs, op, size, what=key + " (out buffer)")
    check_allreduce_result(np.asarray(res), xs, op, size, what=key + " (returned)")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "uint8"])
def test_allreduce_out_separate_buffer(dtype, request):
    dt = DTYPES[dtype]
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    xs = all_inputs(dt, (4, 9), key, size)
    x = xs[rank].copy()
    out = np.zeros_like(x)
    res = hvps.allreduce(x, op=hvps.Sum, out=out)
    check_allreduce_result(out, xs, "Sum", size, what=key + " (out)")
    check_allreduce_result(np.asarray(res), xs, "Sum", size, what=key + " (returned)")
    assert_exact(x, xs[rank], key + ": input modified")


@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_allreduce_out_in_place_async(dtype, request):
    dt = DTYPES[dtype]
    size, rank = hvps.size(), hvps.rank()
    xs = all_inputs(dt, (1013,), request.node.name, size)
    x = xs[rank].copy()
    h = hvps.allreduce_async(x, op=hvps.Sum, out=x)
    h.wait()
    check_allreduce_result(x, xs, "Sum", size, what=request.node.name)


def test_allreduce_noncontiguous_input(request):
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    xs = all_inputs(np.float64, (6, 10), key, size)
    views = [a.T for a in xs]  # Fortran-ordered view of a C array
    res = hvps.allreduce(xs[rank].copy().T, op=hvps.Sum)
    check_allreduce_result(res, views, "Sum", size, what=key)
    strided = [a[::2, ::3] for a in xs]
    res2 = hvps.allreduce(xs[rank].copy()[::2, ::3], op=hvps.Sum)
    check_allreduce_result(res2, strided, "Sum", size, what=key + " strided")


def test_allreduce_named_reused(request):
    """The same explicit name may be reused once the previous op completed
    (this is what training loops do every step)."""
    size, rank = hvps.size(), hvps.rank()
    for i in range(4):
        xs = all_inputs(np.float32, (64,), f"{request.node.name}{i}", size)
        res = hvps.allreduce(xs[rank].copy(), op=hvps.Sum, name="reused.tensor")
        check_allreduce_result(res, xs, "Sum", size, what=f"iteration {i}")


def test_bool_average_raises_type_error():
    x = np.array([True, False, True])
    with pytest.raises(TypeError):
        hvps.allreduce(x, op=hvps.Average)
    with pytest.raises(TypeError):
        hvps.allreduce(x)  # default op is Average
    with pytest.raises(TypeError):
        hvps.allreduce_async(x, op=hvps.Average)
    with pytest.raises(TypeError):
        hvps.grouped_allreduce([x, x.copy()], op=hvps.Average)
    # still usable afterwards
    size, rank = hvps.size(), hvps.rank()
    xs = all_inputs(np.bool_, (17,), "after-bool-average", size)
    check_allreduce_result(hvps.allreduce(xs[rank].copy(), op=hvps.Sum), xs, "Sum", size)


@pytest.mark.parametrize("np_dtype", [np.complex64, np.uint32, np.uint64],
                         ids=["complex64", "uint32", "uint64"])
def test_allreduce_unsupported_dtype(np_dtype):
    x = np.zeros(4, dtype=np_dtype)
    with pytest.raises(TypeError):
        hvps.allreduce(x, op=hvps.Sum)
    with pytest.raises(TypeError):
        hvps.allreduce_async(x, op=hvps.Sum)
    with pytest.raises(TypeError):
        hvps.grouped_allreduce([np.zeros(3, np.float32), x], op=hvps.Sum)


@pytest.mark.parametrize("op", OP_NAMES)
@pytest.mark.parametrize("dtype", FLOAT_NAMES + INT_NAMES)
def test_grouped_allreduce_same_dtype(dtype, op, request):
    dt = DTYPES[dtype]
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    shapes = [(0,), (1,), (7, 11, 13), (1013,), (3, 5), ()]
    ins = [all_inputs(dt, s, f"{key}/{i}", size, op) for i, s in enumerate(shapes)]
    outs = hvps.grouped_allreduce([x[rank].copy() for x in ins], op=_op(op))
    assert isinstance(outs, list) and len(outs) == len(shapes)
    for i, (o, x) in enumerate(zip(outs, ins)):
        check_allreduce_result(np.asarray(o), x, op, size, what=f"{key} member {i}")


def test_grouped_allreduce_mixed_dtypes_and_bool(request):
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    specs = [("float32", (50,)), ("float64", (3, 3)), ("int32", (21,)),
             ("uint8", (9,)), ("bfloat16", (33,)), ("float16", (8, 2)),
             ("int64", (5,)), ("bool", (40,))]
    ins = [all_inputs(DTYPES[d], s, f"{key}/{i}", size, "Max")
           for i, (d, s) in enumerate(specs)]
    outs = hvps.grouped_allreduce([x[rank].copy() for x in ins], op=hvps.Max)
    assert len(outs) == len(specs)
    for i, (o, x) in enumerate(zip(outs, ins)):
        check_allreduce_result(np.asarray(o), x, "Max", size, what=f"{key} member {i}")


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64"])
def test_grouped_allreduce_async_with_scaling(dtype, request):
    dt = DTYPES[dtype]
    size, rank = hvps.size(), hvps.rank()
    key = request.node.name
    shapes = [(10,), (big_count(dt, 3 * MIB) // 3,), (2, 2, 2)]  # a member of 1 MiB: reduced where it lies
    ins = [all_inputs(dt, s, f"{key}/{i}", size) for i, s in enumerate(shapes)]
    h = hvps.grouped_allreduce_async([x[rank].copy() for x in ins], op=hvps.Average,
                                     prescale_factor=0.5, postscale_factor=4.0)
    outs = h.wait()
    assert len(outs) == len(shapes)
    for i, (o, x) in enumerate(zip(outs, ins)):
        check_allreduce_result(np.asarray(o), x, "Average", size, 0.5, 4.0,
                               what=f"{key} member {i}")


def test_many_sequential_unnamed_allreduces(request):
    """Auto-named ops in the same order on all ranks, mixed dtypes/sizes."""
    size, rank = hvps.size(), hvps.rank()
    rng = np.random.default_rng(1234)  # same on all ranks: shapes/dtypes
    for i in range(60):
        dtype = DTYPE_NAMES[rng.integers(len(DTYPE_NAMES))]
        op = "Max" if dtype == "bool" else "Sum"
        n = int(rng.integers(0, 3000))
        xs = all_inputs(DTYPES[dtype], (n,), f"{request.node.name}/{i}", size, op)
        res = hvps.allreduce(xs[rank].copy(), op=_op(op))
        check_allreduce_result(res, xs, op, size, what=f"iteration {i} {dtype} n={n}")


def test_integer_sum_wraps_like_numpy(request):
    """Sums that overflow wrap around (as numpy and NCCL do), never saturate: Open MPI 4.1's
    AVX kernels saturate, so hvps turns them off (open-mpi/ompi#8045)."""
    size, rank = hvps.size(), hvps.rank()
    for dtype in (np.uint8, np.int32):
        info = np.iinfo(dtype)
        xs = [rng_for(f"{request.node.name}/{dtype.__name__}", r).integers(info.max // 2, info.max, 1001)
              .astype(dtype) for r in range(size)]
        result = hvps.allreduce(xs[rank].copy(), op=hvps.Sum, name=f"wrap.{dtype.__name__}")
        expected = np.sum(np.stack(xs), axis=0, dtype=dtype)
        assert_exact(result, expected, f"{dtype.__name__} sum with overflow")
