"""Inner multi-rank tests for the TensorFlow adapter's collectives (hvps.adapters.tensorflow).

Every collective against numpy for float16/float32/float64/int32/int64 (plus
bfloat16 and uint8 for allreduce), eagerly and under tf.function; numerical
gradient checks of allreduce, grouped_allreduce, allgather and broadcast;
bad input (string dtype, mismatched shapes).
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from hvps_testutil import (  # noqa: E402
    DTYPES,
    OP_NAMES,
    all_inputs,
    assert_exact,
    check_allreduce_result,
    check_guarded_average,
    overflowing_halves,
    random_array,
    ref_allreduce,
    rows_split,
)

import hvps  # noqa: E402
import hvps.adapters.tensorflow as hvd  # noqa: E402

pytestmark = pytest.mark.timeout(120)

MAIN_DTYPES = ["float16", "float32", "float64", "int32", "int64"]
MODES = ["eager", "function"]


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.set_threads(1)
    hvd.init()
    yield


def to_np(t):
    return np.asarray(t.numpy())


def call(mode, fn, *args):
    """Run ``fn(*args)`` eagerly or inside a fresh tf.function (tensors returned either way)."""
    if mode == "eager":
        return fn(*args)
    return tf.function(fn)(*args)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", MAIN_DTYPES + ["bfloat16", "uint8"])
def test_allreduce_every_op(dtype, mode):
    dt = DTYPES[dtype]
    size, rank = hvd.size(), hvd.rank()
    key = f"tf-ar-{dtype}-{mode}"
    cases = [(op, f"{key}-{op}") for op in OP_NAMES]
    inputs = {op: all_inputs(dt, (5, 7), k, size, op) for op, k in cases}

    def fn(*xs):
        return [hvd.allreduce(x, op=getattr(hvd, op)) for x, (op, _) in zip(xs, cases)]

    outs = call(mode, fn, *[tf.constant(inputs[op][rank]) for op, _ in cases])
    for out, (op, _) in zip(outs, cases):
        assert out.dtype == tf.as_dtype(dt)
        assert tuple(out.shape) == (5, 7)
        check_allreduce_result(to_np(out), inputs[op], op, size, what=f"{dtype} {op} {mode}")


@pytest.mark.parametrize("mode", MODES)
def test_fp16_average_of_large_gradients_is_guarded_on_every_path(mode, request):
    """Values whose float16 sum overflows but whose average does not: hvd.allreduce,
    hvd.grouped_allreduce and DistributedGradientTape all scale by 1/size before the cast."""
    size, rank = hvd.size(), hvd.rank()
    xs = overflowing_halves(request.node.name, size)
    fp16 = hvd.Compression.fp16
    var = tf.Variable(tf.zeros(len(xs[rank])))

    def fn(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(var * x)
        (grad,) = hvd.DistributedGradientTape(tape, compression=fp16).gradient(loss, [var])
        return (hvd.allreduce(x, op=hvd.Average, compression=fp16),
                hvd.grouped_allreduce([x], op=hvd.Average, compression=fp16)[0], grad)

    outs = call(mode, fn, tf.constant(xs[rank]))
    check_guarded_average(dict(zip(["allreduce", "grouped_allreduce", "DistributedGradientTape"],
                                   (to_np(o) for o in outs))), xs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_allreduce_scaling_and_compression(dtype, mode):
    dt = DTYPES[dtype]
    size, rank = hvd.size(), hvd.rank()
    xs = all_inputs(dt, (3, 4), f"tf-scale-{dtype}", size)

    def fn(x):
        return (hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
                hvd.allreduce(x, op=hvd.Average, compression=hvd.Compression.fp16))

    scaled, compressed = call(mode, fn, tf.constant(xs[rank]))
    check_allreduce_result(to_np(scaled), xs, "Sum", size, 0.5, 3.0, what="scaled")
    assert compressed.dtype == tf.as_dtype(dt)
    ref, _ = ref_allreduce([x.astype(np.float16) for x in xs], "Average", size)
    np.testing.assert_allclose(to_np(compressed).astype(np.float64), ref, rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", MAIN_DTYPES)
def test_grouped_allreduce(dtype, mode):
    dt = DTYPES[dtype]
    size, rank = hvd.size(), hvd.rank()
    shapes = [(3,), (2, 5), (4, 1, 2)]
    inputs = [all_inputs(dt, s, f"tf-grouped-{dtype}-{i}", size) for i, s in enumerate(shapes)]
    outs = call(mode, lambda *ts: hvd.grouped_allreduce(list(ts), op=hvd.Sum),
                *[tf.constant(x[rank]) for x in inputs])
    assert len(outs) == len(shapes)
    for out, xs in zip(outs, inputs):
        check_allreduce_result(to_np(out), xs, "Sum", size, what=f"grouped {dtype}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", MAIN_DTYPES)
def test_allgather_broadcast_alltoall_reducescatter(dtype, mode):
    dt = DTYPES[dtype]
    size, rank = hvd.size(), hvd.rank()
    key = f"tf-coll-{dtype}-{mode}"
    # allgather: rank r contributes r + 1 rows
    gathered_in = [random_array(dt, (r + 1, 3), f"{key}-ag", r) for r in range(size)]
    # broadcast from the last rank
    root = size - 1
    bcast_in = [random_array(dt, (2, 3), f"{key}-bc", r) for r in range(size)]
    # alltoall with uneven splits: rank r sends (s + r) % 3 rows to rank s
    splits = [[(s + r) % 3 for s in range(size)] for r in range(size)]
    a2a_in = [random_array(dt, (sum(splits[r]), 2), f"{key}-a2a", r) for r in range(size)]
    # reducescatter: 2 * size + 1 rows, so the first rank gets an extra one
    rows = 2 * size + 1
    rs_in = [random_array(dt, (rows, 3), f"{key}-rs", r) for r in range(size)]

    def fn(g, b, a, s, rsx):
        out, received = hvd.alltoall(a, splits=s)
        return (hvd.allgather(g), hvd.broadcast(b, root_rank=root), out, received,
                hvd.reducescatter(rsx, op=hvd.Sum))

    g, b, a, received, rs = call(mode, fn, tf.constant(gathered_in[rank]), tf.constant(bcast_in[rank]),
                                 tf.constant(a2a_in[rank]), tf.constant(splits[rank], dtype=tf.int32),
                                 tf.constant(rs_in[rank]))
    assert_exact(to_np(g), np.concatenate(gathered_in), "allgather")
    assert_exact(to_np(b), bcast_in[root], "broadcast")
    expected = []
    for src in range(size):
        start = sum(splits[src][:rank])
        expected.append(a2a_in[src][start : start + splits[src][rank]])
    assert_exact(to_np(a), np.concatenate(expected), "alltoall")
    assert to_np(received).tolist() == [splits[src][rank] for src in range(size)]
    counts = rows_split(rows, size)
    start = sum(counts[:rank])
    result = to_np(rs)
    assert result.shape == (counts[rank], 3)
    check_allreduce_result(result, [x[start : start + counts[rank]] for x in rs_in], "Sum", size,
                           what="reducescatter")


def test_broadcast_variables_and_objects():
    size, rank = hvd.size(), hvd.rank()
    variables = [tf.Variable(np.full((3, 2), rank, np.float32)), tf.Variable(np.int64(rank * 10))]
    hvd.broadcast_variables(variables, root_rank=1)
    assert_exact(variables[0].numpy(), np.full((3, 2), 1, np.float32), "variable")
    assert int(variables[1].numpy()) == 10

    @tf.function
    def in_graph():
        hvd.broadcast_variables(variables, root_rank=0)

    variables[0].assign(np.full((3, 2), rank + 5, np.float32))
    in_graph()
    assert_exact(variables[0].numpy(), np.full((3, 2), 5, np.float32), "variable in tf.function")
    assert hvd.broadcast_object({"rank": rank} if rank == 0 else None, root_rank=0) == {"rank": 0}
    assert hvd.allgather_object(rank) == list(range(size))


# -- gradients ----------------------------------------------------------------------------------
EPS = 1e-6


def _global_loss(fn, x, w):
    """sum over ranks of <w_r, fn(x_r)>, as a float (the sum over ranks goes through the numpy core)."""
    local = float(tf.reduce_sum(w * fn(tf.constant(x))).numpy())
    return float(hvps.allreduce(np.asarray([local]), op=hvps.Sum)[0])


def _numeric_grad(fn, x, w):
    """d(global loss)/d(this rank's x), by central differences, every rank perturbing in turn."""
    size, rank = hvd.size(), hvd.rank()
    grad = np.zeros_like(x)
    numels = hvps.allgather_object(x.size)  # allgather inputs differ in size by rank
    for r in range(size):
        for i in range(numels[r]):
            values = []
            for sign in (1.0, -1.0):
                xp = x.copy()
                if r == rank:
                    xp.reshape(-1)[i] += sign * EPS
                values.append(_global_loss(fn, xp, w))
            if r == rank:
                grad.reshape(-1)[i] = (values[0] - values[1]) / (2 * EPS)
    return grad


GRAD_CASES = {
    "allreduce-sum": lambda x: hvd.allreduce(x, op=hvd.Sum),
    "allreduce-average-scaled": lambda x: hvd.allreduce(x, op=hvd.Average, prescale_factor=0.5,
                                                        postscale_factor=3.0),
    "grouped-allreduce": lambda x: tf.concat(hvd.grouped_allreduce([x, 2.0 * x], op=hvd.Sum), axis=0),
    "allgather": lambda x: hvd.allgather(x) ** 2,
    "broadcast": lambda x: hvd.broadcast(x, root_rank=hvd.size() - 1) ** 2,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradient_numerically(case, mode):
    size, rank = hvd.size(), hvd.rank()
    fn = GRAD_CASES[case]
    rows = rank + 1 if case == "allgather" else 2  # allgather: rows differ by rank
    x = random_array(np.float64, (rows, 3), f"tf-grad-{case}", rank)
    out_rows = {"allgather": sum(r + 1 for r in range(size)), "grouped-allreduce": 2 * rows}.get(case, rows)
    w = tf.constant(random_array(np.float64, (out_rows, 3), f"tf-grad-w-{case}", rank))

    def analytic(xt):
        with tf.GradientTape() as tape:
            tape.watch(xt)
            loss = tf.reduce_sum(w * fn(xt))
        return tape.gradient(loss, xt)

    got = to_np(call(mode, analytic, tf.constant(x)))
    expected = _numeric_grad(fn, x, w)
    if case in ("allgather", "broadcast"):
        expected = expected / size  # Horovod's gradient: the members' output gradients averaged, not summed
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=f"{case} {mode}")


def test_distributed_gradient_tape_sparse_and_dense():
    size, rank = hvd.size(), hvd.rank()
    table = tf.Variable(np.arange(12, dtype=np.float32).reshape(6, 2))
    dense = tf.Variable(np.ones(3, np.float32))
    ids = tf.constant([rank % 6, (rank + 2) % 6])
    for sparse_as_dense in (False, True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, ids)) * (rank + 1) + tf.reduce_sum(dense * float(rank))
        g_table, g_dense = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense).gradient(
            loss, [table, dense])
        assert isinstance(g_table, tf.IndexedSlices) != sparse_as_dense
        expected = np.zeros((6, 2))
        for r in range(size):
            for i in (r % 6, (r + 2) % 6):
                expected[i] += (r + 1) / size
        np.testing.assert_allclose(tf.convert_to_tensor(g_table).numpy(), expected, rtol=1e-6)
        np.testing.assert_allclose(g_dense.numpy(), np.full(3, sum(range(size)) / size), rtol=1e-6)


# -- bad input (last: the core must stay healthy after each) ----------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_string_dtype_is_a_type_error(mode):
    with pytest.raises(TypeError, match="string"):
        call(mode, lambda x: hvd.allreduce(x), tf.constant(["a", "b"]))
    with pytest.raises(TypeError, match="string"):
        call(mode, lambda x: hvd.allgather(x), tf.constant(["a", "b"]))


@pytest.mark.parametrize("mode", MODES)
def test_mismatched_shapes_raise_within_stall_timeout(mode):
    rank = hvd.rank()
    x = tf.zeros((5,) if rank == 0 else (4,))
    stall = float(os.environ.get("HVPS_STALL_CHECK_TIME_SECONDS", "60"))
    start = time.monotonic()
    if mode == "eager":
        with pytest.raises(hvps.HvpsError):
            hvd.allreduce(x, op=hvd.Sum, name=f"tf.mismatch.{mode}")
    else:
        # inside a graph the core's HvpsError reaches the caller as a TensorFlow op error
        with pytest.raises(tf.errors.OpError, match="HvpsError|mismatch|shape"):
            tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, name=f"tf.mismatch.{mode}"))(x)
    assert time.monotonic() - start < stall * 1.5 + 5
    # still healthy
    out = hvd.allreduce(tf.ones((2,)), op=hvd.Sum, name=f"tf.after.{mode}")
    assert to_np(out).tolist() == [hvd.size()] * 2


def test_tf1_session_runs_many_unnamed_collectives_at_once(request):
    """A TF1 graph whose unnamed collectives of one shape all run in one session.run: TensorFlow
    picks their order, differently on each rank. Each must still meet its own partner (fresh random
    data, so a wrong pairing is a wrong result, not a mismatch)."""
    size, rank = hvd.size(), hvd.rank()
    key = request.node.name
    inputs = [all_inputs(np.float32, (6,), f"{key}/{i}", size) for i in range(12)]
    ops = ["Sum", "Min", "Max"]
    graph = tf.Graph()
    with graph.as_default():
        outs = [hvd.allreduce(tf.constant(xs[rank]), op=getattr(hvd, ops[i % 3])) for i, xs in enumerate(inputs)]
        gathered = hvd.allgather(tf.constant(inputs[0][rank][: rank + 1]))
        # each collective holds an inter-op thread until its partners arrive: this module's set_threads(1)
        # would leave one, so the session gets its own pool (as README's TensorFlow section says)
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=len(outs) + 1)
        with tf.compat.v1.Session(graph=graph, config=config) as session:
            results = session.run(outs + [gathered])
    for i, (xs, got) in enumerate(zip(inputs, results)):
        check_allreduce_result(np.asarray(got), xs, ops[i % 3], size, what=f"{key} collective {i}")
    assert_exact(results[-1], np.concatenate([inputs[0][r][: r + 1] for r in range(size)]), key)


def test_eager_errors_are_the_tensorflow_errors_horovod_raises():
    """A failed collective is tf.errors.FailedPreconditionError and HvpsError; an argument the op
    refuses is tf.errors.InvalidArgumentError and ValueError (as Horovod's ops raise them)."""
    size, rank = hvd.size(), hvd.rank()
    with pytest.raises(tf.errors.FailedPreconditionError) as failed:
        hvd.allreduce(tf.zeros((3,) if rank == 0 else (4,)), op=hvd.Sum)
    assert isinstance(failed.value, hvps.HvpsError) and "mismatch" in str(failed.value)
    with pytest.raises(tf.errors.InvalidArgumentError) as refused:
        hvd.alltoall(tf.zeros((size + 1,)))
    assert isinstance(refused.value, ValueError) and "divisible" in str(refused.value)
    assert to_np(hvd.allreduce(tf.ones((2,)), op=hvd.Sum)).tolist() == [size] * 2  # names still in step


def test_horovod_tensor_interface_of_compression():
    for dtype in (tf.float32, tf.float64, tf.int32, tf.uint16):
        compressed, ctx = hvd.Compression.fp16.compress(tf.ones((3,), dtype))
        assert compressed.dtype == (tf.float16 if dtype.is_floating else dtype)
        assert hvd.Compression.fp16.decompress(compressed, ctx).dtype == dtype
    assert hvd._executing_eagerly() and hvd.util._executing_eagerly()


def test_uninitialized_wrappers_refuse_before_init():
    hvd.barrier()
    with pytest.raises(ValueError):
        hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(TypeError):
        hvd.allreduce(tf.ones(2), process_set=object())
