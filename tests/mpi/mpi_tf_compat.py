"""Inner multi-rank tests of the TensorFlow adapter's Horovod compatibility (issue 12, "Also").

Every dtype Horovod supports on CPU through every collective, process sets (members and
non-members), Adasum against the paper's formula, the gradients of grouped_allgather, alltoall and
reducescatter against central differences, SyncBatchNormalization against BatchNormalization on the
global batch (uneven per-rank batches), argument errors raised on every rank before submission,
the rank_op family, elastic's entry points and the exported names, eagerly and inside tf.function; the
Partial* tape and optimizer (local layers' gradients stay local, scaled by 1/size) and load_model.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from hvps_testutil import rng_for, rows_split  # noqa: E402

import hvps  # noqa: E402
import hvps.adapters.tensorflow as hvd  # noqa: E402
import hvps.adapters.tensorflow.keras as hk  # noqa: E402
from hvps.core.launchers import env_size  # noqa: E402

pytestmark = pytest.mark.timeout(120)

MODES = ["eager", "function"]
DTYPES = ["uint8", "uint16", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool"]
SETS = {}

# horovod.tensorflow's and horovod.tensorflow.keras's exported names (their __init__ imports and defs),
# less the TF1-only session hook
HOROVOD_TF = """elastic Compression allgather_object broadcast_object broadcast_object_fn broadcast_variables
allgather grouped_allgather broadcast broadcast_ alltoall init shutdown is_initialized start_timeline stop_timeline
size local_size cross_size rank local_rank cross_rank is_homogeneous rank_op local_rank_op size_op local_size_op
process_set_included_op mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built ddl_built
ccl_built cuda_built rocm_built ProcessSet global_process_set add_process_set remove_process_set Average Sum Adasum
Min Max Product join SyncBatchNormalization allreduce reducescatter grouped_allreduce grouped_reducescatter
broadcast_global_variables DistributedOptimizer DistributedGradientTape PartialDistributedGradientTape
HorovodInternalError gpu_available""".split()
HOROVOD_KERAS = """init shutdown is_initialized start_timeline stop_timeline size local_size cross_size rank local_rank
cross_rank mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built ddl_built ccl_built
cuda_built rocm_built ProcessSet global_process_set add_process_set remove_process_set Average Sum Adasum Min Max
Product Compression callbacks elastic DistributedOptimizer PartialDistributedOptimizer load_model
broadcast_global_variables allreduce allgather broadcast reducescatter""".split()


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.set_threads(1)
    size = env_size()
    SETS["even"] = hvd.ProcessSet([r for r in range(size) if r % 2 == 0])
    SETS["odd"] = hvd.ProcessSet([r for r in range(size) if r % 2 == 1])
    hvd.init(process_sets=[SETS["even"], SETS["odd"]])
    yield


def call(mode, fn, *args):
    """Run ``fn(*args)`` eagerly or inside a fresh tf.function."""
    return fn(*args) if mode == "eager" else tf.function(fn)(*args)


def inputs(dtype, shape, key, ranks):
    """Fresh random arrays per rank for test ``key`` (small integers: sums cannot overflow int8)."""
    out = []
    for r in ranks:
        rng = rng_for(key, r)
        if dtype == "bool":
            out.append(rng.random(shape) < 0.5)
        elif dtype in ("float16", "bfloat16", "float32", "float64"):
            out.append(rng.standard_normal(shape).astype(tf.as_dtype(dtype).as_numpy_dtype))
        else:
            low = 0 if dtype == "uint8" else -20
            out.append(rng.integers(low, 40, shape).astype(tf.as_dtype(dtype).as_numpy_dtype))
    return out


def close(got, expected, dtype, what):
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.dtype == expected.dtype, f"{what}: {got.dtype} != {expected.dtype}"
    tol = {"float16": 1e-2, "bfloat16": 5e-2, "float32": 1e-5, "float64": 1e-12}.get(dtype, 0)
    np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=tol, atol=tol,
                               err_msg=what)


def scatter_block(full, members, index):
    counts = rows_split(full.shape[0], members)
    start = sum(counts[:index])
    return full[start:start + counts[index]]


def check_collectives(dtypes, mode, process_set, key):
    """allreduce (Sum), allgather, broadcast, alltoall, reducescatter and the grouped ops on
    ``process_set``, for every dtype in ``dtypes``, all in one call (one trace in a tf.function)."""
    ranks = process_set.ranks
    me, n = ranks.index(hvd.rank()), len(ranks)
    root = ranks[-1]
    xs = {d: inputs(d, (2 * n, 3), f"{key}-{d}", ranks) for d in dtypes}
    rows = {d: [inputs(d, (i + 1, 2), f"{key}-{d}-rows", ranks)[i] for i in range(n)] for d in dtypes}

    def fn(*tensors):
        kw = {"process_set": process_set}
        outs = []
        for x, g in zip(tensors[::2], tensors[1::2]):  # gathered rows differ by rank
            outs.append((hvd.allreduce(x, op=hvd.Sum, **kw), hvd.allgather(g, **kw), hvd.broadcast(x, root, **kw),
                         hvd.alltoall(x, **kw), hvd.reducescatter(x, op=hvd.Sum, **kw),
                         hvd.grouped_allgather([x, g], **kw), hvd.grouped_reducescatter([x, x], op=hvd.Sum, **kw)))
        return outs

    args = [tf.constant(a) for d in dtypes for a in (xs[d][me], rows[d][me])]
    for d, (ar, ag, bc, a2a, rs, gag, grs) in zip(dtypes, call(mode, fn, *args)):
        total = xs[d][0].copy()
        for x in xs[d][1:]:
            total = (total | x) if d == "bool" else (total + x).astype(total.dtype)
        close(ar.numpy(), total, d, f"allreduce {d}")
        close(ag.numpy(), np.concatenate(rows[d]), d, f"allgather {d}")
        close(bc.numpy(), xs[d][ranks.index(root)], d, f"broadcast {d}")
        close(a2a.numpy(), np.concatenate([x[2 * me:2 * me + 2] for x in xs[d]]), d, f"alltoall {d}")
        close(rs.numpy(), scatter_block(total, n, me), d, f"reducescatter {d}")
        close(gag[0].numpy(), np.concatenate(xs[d]), d, f"grouped_allgather {d}")
        close(gag[1].numpy(), np.concatenate(rows[d]), d, f"grouped_allgather rows {d}")
        for out in grs:
            close(out.numpy(), scatter_block(total, n, me), d, f"grouped_reducescatter {d}")


@pytest.mark.parametrize("mode", MODES)
def test_every_dtype_every_collective(mode):
    check_collectives(DTYPES, mode, hvd.global_process_set, f"tfc-{mode}")


@pytest.mark.parametrize("mode", MODES)
def test_process_sets_members_and_outsiders(mode):
    mine = SETS["even"] if hvd.rank() % 2 == 0 else SETS["odd"]
    other = SETS["odd"] if mine is SETS["even"] else SETS["even"]
    check_collectives(["float32", "int8"], mode, mine, f"tfc-set-{mode}")
    assert hvd.process_set_included_op(mine.process_set_id).numpy() == 1
    assert hvd.size_op(mine.process_set_id).numpy() == mine.size()
    if other.size():
        assert hvd.process_set_included_op(other.process_set_id).numpy() == 0
        # at trace time inside a tf.function; as Horovod's ops: InvalidArgumentError (a ValueError too)
        with pytest.raises(tf.errors.InvalidArgumentError, match="not a member") as refused:
            call(mode, lambda x: hvd.allreduce(x, process_set=other), tf.ones(2))
        assert isinstance(refused.value, ValueError)
        with pytest.raises(tf.errors.InvalidArgumentError, match="not a member"):
            hvd.barrier(process_set=other)
    unknown = hvd.ProcessSet([0])
    unknown.process_set_id = 10  # not registered: a ValueError (Horovod's test_horovod_allreduce_process_set_id_error)
    with pytest.raises(ValueError, match="not registered"):
        call(mode, lambda x: hvd.allreduce(x, process_set=unknown), tf.ones(2))
    # the ranks stay in step: a global collective right after
    assert hvd.allreduce(tf.ones(2), op=hvd.Sum).numpy().tolist() == [hvd.size()] * 2


@pytest.mark.parametrize("mode", MODES)
def test_adasum_matches_the_formula(mode):
    size, me = hvd.size(), hvd.rank()
    xs = inputs("float64", (50,), f"tfc-adasum-{mode}", range(size))
    if size & (size - 1):
        with pytest.raises(NotImplementedError, match="power-of-two"):
            call(mode, lambda x: hvd.allreduce(x, op=hvd.Adasum), tf.constant(xs[me]))
        return
    got = call(mode, lambda x: hvd.allreduce(x, op=hvd.Adasum), tf.constant(xs[me])).numpy()
    a, b = xs
    dot = a @ b
    expected = (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


# -- gradients ------------------------------------------------------------------------------------
EPS = 1e-6


def _global_loss(fn, x, w):
    local = float(tf.reduce_sum(w * fn(tf.constant(x))).numpy())
    return float(hvps.allreduce(np.asarray([local]), op=hvps.Sum)[0])


def _numeric_grad(fn, x, w):
    """d(sum over ranks of <w, fn(x)>)/d(this rank's x) by central differences."""
    grad = np.zeros_like(x)
    numels = hvps.allgather_object(x.size)
    for r in range(hvd.size()):
        for i in range(numels[r]):
            values = []
            for sign in (1.0, -1.0):
                xp = x.copy()
                if r == hvd.rank():
                    xp.reshape(-1)[i] += sign * EPS
                values.append(_global_loss(fn, xp, w))
            if r == hvd.rank():
                grad.reshape(-1)[i] = (values[0] - values[1]) / (2 * EPS)
    return grad


def _splits():
    return tf.constant([(s + hvd.rank()) % 2 + 1 for s in range(hvd.size())], dtype=tf.int32)


# case -> (fn, rows of x, rows of the output, Horovod's gradient / the sum-of-losses gradient)
GRAD_CASES = {
    "grouped-allgather": (lambda x: tf.concat(hvd.grouped_allgather([x, 2.0 * x]), 0), "rank", "gathered2",
                          lambda n: 1.0 / n),
    "alltoall": (lambda x: hvd.alltoall(x, splits=_splits())[0], "splits", "received", lambda n: 1.0),
    "reducescatter-sum": (lambda x: hvd.reducescatter(x, op=hvd.Sum), "fixed", "scattered", lambda n: n),
    "reducescatter-average": (lambda x: hvd.reducescatter(x, op=hvd.Average, prescale_factor=0.5), "fixed",
                              "scattered", lambda n: n),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradients_numerically(case, mode):
    size, rank = hvd.size(), hvd.rank()
    fn, rows_kind, out_kind, scale = GRAD_CASES[case]
    splits = [[(s + r) % 2 + 1 for s in range(size)] for r in range(size)]
    rows = {"rank": rank + 1, "splits": sum(splits[rank]), "fixed": 2 * size + 1}[rows_kind]
    out_rows = {"gathered2": 2 * sum(r + 1 for r in range(size)), "received": sum(s[rank] for s in splits),
                "scattered": rows_split(2 * size + 1, size)[rank]}[out_kind]
    x = rng_for(f"tfc-grad-{case}", rank).standard_normal((rows, 3))
    w = tf.constant(rng_for(f"tfc-grad-w-{case}", rank).standard_normal((out_rows, 3)))

    def analytic(xt):
        with tf.GradientTape() as tape:
            tape.watch(xt)
            loss = tf.reduce_sum(w * fn(xt))
        return tape.gradient(loss, xt)

    got = call(mode, analytic, tf.constant(x)).numpy()
    expected = _numeric_grad(fn, x, w) * scale(size)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=f"{case} {mode}")


# -- SyncBatchNormalization -------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_sync_batch_norm_matches_global_batch(mode):
    size, rank = hvd.size(), hvd.rank()
    batches = [inputs("float64", (r + 2, 4, 3), f"tfc-sbn-x-{mode}", [r])[0] * (r + 1) for r in range(size)]
    weights = [inputs("float64", b.shape, f"tfc-sbn-w-{mode}", [r])[0] for r, b in enumerate(batches)]
    keras.utils.set_random_seed(7)
    sync = hvd.SyncBatchNormalization(momentum=0.5, dtype="float64")
    ref = keras.layers.BatchNormalization(momentum=0.5, dtype="float64")
    for layer, n in ((sync, batches[rank].shape[0]), (ref, 1)):
        layer.build((n, 4, 3))
        layer.gamma.assign(np.linspace(0.5, 1.5, 3))
        layer.beta.assign(np.linspace(-1, 1, 3))

    def step(layer, x, w):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(w * y)
        return (y, *tape.gradient(loss, [x, layer.gamma, layer.beta]))

    y, dx, dgamma, dbeta = call(mode, lambda x, w: step(sync, x, w), tf.constant(batches[rank]),
                                tf.constant(weights[rank]))
    ry, rdx, rdgamma, rdbeta = step(ref, tf.constant(np.concatenate(batches)), tf.constant(np.concatenate(weights)))
    start = sum(b.shape[0] for b in batches[:rank])
    mine = slice(start, start + batches[rank].shape[0])
    np.testing.assert_allclose(y.numpy(), ry.numpy()[mine], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(dx.numpy(), rdx.numpy()[mine], rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(hvd.allreduce(dgamma, op=hvd.Sum).numpy(), rdgamma.numpy(), rtol=1e-9)
    np.testing.assert_allclose(hvd.allreduce(dbeta, op=hvd.Sum).numpy(), rdbeta.numpy(), rtol=1e-9)
    np.testing.assert_allclose(sync.moving_mean.numpy(), ref.moving_mean.numpy(), rtol=1e-9)
    np.testing.assert_allclose(sync.moving_variance.numpy(), ref.moving_variance.numpy(), rtol=1e-9)


# -- errors, names, basics -----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_argument_errors_raise_before_submission_on_every_rank(mode):
    mine = SETS["even"] if hvd.rank() % 2 == 0 else SETS["odd"]
    cases = [
        (TypeError, lambda: hvd.allreduce(tf.constant([True, False]), op=hvd.Average)),
        (ValueError, lambda: hvd.broadcast(tf.ones(2), root_rank=hvd.size())),
        (NotImplementedError, lambda: hvd.reducescatter(tf.ones((4, 2)), op=hvd.Adasum)),
        (NotImplementedError, lambda: hvd.allreduce(tf.ones(2), op=hvd.Adasum, process_set=mine)),
        (ValueError, lambda: hvd.allreduce(tf.ones(2), op="median")),
        (TypeError, lambda: hvd.allgather(tf.constant(["a"]))),
        (ValueError, lambda: hvd.alltoall(tf.ones((2, 2)), splits=tf.constant([1.0, 1.0]))),
        (TypeError, lambda: hvd.allreduce(tf.ones(2), process_set=object())),
    ]
    for error, fn in cases:
        with pytest.raises(error):
            call(mode, lambda: fn())
    # nothing was submitted: an unnamed collective right after still matches on every rank
    assert hvd.allreduce(tf.ones(3), op=hvd.Sum).numpy().tolist() == [hvd.size()] * 3


def test_names_basics_and_elastic():
    assert set(HOROVOD_TF) <= set(dir(hvd)), set(HOROVOD_TF) - set(dir(hvd))
    assert set(HOROVOD_KERAS) <= set(dir(hk)), set(HOROVOD_KERAS) - set(dir(hk))
    assert hvd.HorovodInternalError is hvps.HorovodInternalError
    ops = tf.function(lambda: (hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op()))()
    assert [int(t.numpy()) for t in ops] == [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()]
    assert ops[0].dtype == tf.int32
    assert hvd.process_set_included_op(99).numpy() == -3
    assert hvd.gpu_available("tensorflow") == bool(tf.config.list_physical_devices("GPU"))
    assert hvd.mpi_ops._basics._get_process_set_ids_and_ranks()[0] == list(range(hvd.size()))
    assert isinstance(hvd.is_homogeneous(), bool)
    assert hvd.broadcast_object_fn(root_rank=0)({"r": hvd.rank()}) == {"r": 0}
    assert callable(hvd.elastic.run(lambda state: None))  # the retry loop's wrapper (tests/mpi/mpi_elastic_state.py)
    with pytest.raises(ValueError, match="needs a Keras model"):
        hvd.elastic.TensorFlowKerasState(None)
    value = hk.allreduce(np.float64(hvd.rank()), name="keras.value", op=hvd.Sum)
    assert float(value.numpy()) == sum(range(hvd.size()))


# ---------------------------------------------------------------------------- local layers, load_model
def _two_layers():
    """A shared and a local Dense layer with the same weights on every rank."""
    shared, local = keras.layers.Dense(3), keras.layers.Dense(2)
    shared.build((None, 4))
    local.build((None, 3))
    init = np.random.default_rng(7)
    for layer in (shared, local):
        layer.set_weights([init.standard_normal(w.shape).astype("float32") for w in layer.get_weights()])
    return shared, local


def _local_grads(shared, local, x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(local(shared(x)) ** 2)
    return [g.numpy() for g in tape.gradient(loss, shared.trainable_weights + local.trainable_weights)]


def _partial_expectation(shared, local):
    """(this rank's input, the gradients Horovod's Partial* give it: shared ones averaged over the ranks,
    local ones this rank's own divided by the size), computed from every rank's input."""
    size, rank = hvd.size(), hvd.rank()
    xs = [rng_for("partial", r).standard_normal((5, 4)).astype("float32") for r in range(size)]
    per_rank = [_local_grads(shared, local, tf.constant(x)) for x in xs]
    n = len(shared.trainable_weights)
    expected = [np.mean([p[i] for p in per_rank], axis=0) for i in range(n)]
    return xs[rank], per_rank[rank], expected + [g / size for g in per_rank[rank][n:]]


@pytest.mark.parametrize("mode", MODES)
def test_partial_distributed_gradient_tape(mode):
    shared, local = _two_layers()
    x, _, expected = _partial_expectation(shared, local)

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(local(shared(x)) ** 2)
        tape = hvd.PartialDistributedGradientTape(tape, local_layers=local)
        return tape.gradient(loss, shared.trainable_weights + local.trainable_weights)

    for got, want in zip(call(mode, step, tf.constant(x)), expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="Keras layers"):
        hvd.PartialDistributedGradientTape(tf.GradientTape(), local_layers=["not a layer"])


def test_partial_distributed_optimizer():
    shared, local = _two_layers()
    _, own, expected = _partial_expectation(shared, local)
    variables = shared.trainable_weights + local.trainable_weights
    before = [v.numpy() for v in variables]
    opt = hk.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=[local])
    opt.apply([tf.constant(g) for g in own], variables)
    for v, b, want in zip(variables, before, expected):
        np.testing.assert_allclose(v.numpy(), b - want, rtol=1e-5, atol=1e-5)


def test_load_model_wraps_the_optimizer(tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    path = tmp_path / f"model-{hvd.rank()}.keras"
    model.save(path)
    loaded = hk.load_model(str(path), compression=hvd.Compression.fp16)
    assert isinstance(loaded.optimizer, hk.DistributedOptimizer)
    assert type(loaded.optimizer.inner_optimizer).__name__ == "SGD"
    assert loaded.optimizer.compression.name == "fp16"
    x = rng_for("load_model", hvd.rank()).standard_normal((8, 4)).astype("float32")
    loaded.train_on_batch(x, np.zeros((8, 2), "float32"))  # one step through the wrapped optimizer


# ------------------------------------------------------------------------- Horovod's optimizer entry points
def test_tf1_optimizer_on_a_process_set():
    """``DistributedOptimizer`` wraps a TF1 ``tf.compat.v1.train.Optimizer`` (graph mode, a session):
    members apply the set's average, the others their own gradient (Horovod's
    test_legacy_DistributedOptimizer_process_sets)."""
    mine = SETS["even"] if hvd.rank() % 2 == 0 else SETS["odd"]
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        variable = tf.compat.v1.Variable([0.0], use_resource=True)

        class Constant(tf.compat.v1.train.GradientDescentOptimizer):
            def compute_gradients(self, *args, **kwargs):
                return [(tf.constant([float(hvd.rank() + 1)]), variable)]

        opt = hvd.DistributedOptimizer(Constant(-1.0), process_set=mine)
        assert isinstance(opt, tf.compat.v1.train.Optimizer)
        update = opt.apply_gradients(opt.compute_gradients())
        session.run(tf.compat.v1.global_variables_initializer())
        session.run(update)
        got = session.run(variable)[0]
    assert got == pytest.approx(np.mean([r + 1 for r in mine.ranks]))
    with pytest.raises(NotImplementedError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0), backward_passes_per_step=2)
    with pytest.raises(TypeError, match="wraps a keras.optimizers.Optimizer or a tf.compat.v1.train.Optimizer"):
        hvd.DistributedOptimizer(object())


@pytest.mark.parametrize("mode", ["callable", "tape"])
def test_keras_optimizer_compute_gradients(mode):
    """Horovod's (Keras 2's) ``_compute_gradients(loss, var_list, grad_loss, tape)`` and ``get_gradients``:
    the gradients averaged over the ranks."""
    x = tf.Variable([1.0, 2.0])
    factor = float(hvd.rank() + 1)
    opt = hk.DistributedOptimizer(keras.optimizers.SGD(0.1))
    if mode == "callable":
        pairs = opt._compute_gradients(lambda: tf.reduce_sum(x * factor), [x])
    else:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(x * factor)
        pairs = opt.compute_gradients(loss, [x], tape=tape)
    mean = np.mean([r + 1.0 for r in range(hvd.size())])
    assert pairs[0][1] is x
    np.testing.assert_allclose(pairs[0][0].numpy(), [mean, mean])

    class WithGetGradients(keras.optimizers.SGD):
        def get_gradients(self, loss, params):
            return [tf.constant([factor, factor])]

    got = hk.DistributedOptimizer(WithGetGradients(0.1)).get_gradients(None, [x])
    np.testing.assert_allclose(got[0].numpy(), [mean, mean])
