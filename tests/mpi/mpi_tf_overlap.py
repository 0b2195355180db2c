"""Inner multi-rank tests of the TensorFlow gradient overlap (hvps/adapters/tensorflow/overlap.py).

Gradients averaged by DistributedGradientTape (eagerly and inside tf.function) and by the Keras
DistributedOptimizer (model.fit) against numpy references built from every rank's local
gradients (gathered with allgather_object), with small buckets so that a model spans several:
float16/float32/float64, compression none and fp16, odd sizes, a process set, a predivide
factor, sparse and None gradients. Then the point of it all: inside one tf.function step the
first bucket's collective is submitted before the backward pass has computed the first layer's
gradient. And the failure paths: a shape mismatch between ranks is an error naming the bucket's
variables, and a step that fails between the starts and the finishes leaves nothing behind.
"""

import os
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from hvps_testutil import random_array  # noqa: E402

import hvps.adapters.tensorflow as hvd  # noqa: E402
import hvps.adapters.tensorflow.keras as hk  # noqa: E402
from hvps.adapters.tensorflow import overlap  # noqa: E402
from hvps.core.launchers import env_size  # noqa: E402

pytestmark = pytest.mark.timeout(180)

MODES = ["eager", "function"]
#: odd sizes: at 64-byte buckets, 3 buckets (float16, float32), the first variables in the last
SHAPES = [(3, 7), (7,), (7, 5), (5,), (5, 1), (1,), (33,)]
_SIZE = env_size()
#: ranks 0 and 1: a set of their own at 3 ranks; at 2 they are every rank, the global set (a set of the same
#: ranks as it is a duplicate, which init refuses, as Horovod's does)
PAIR = hvd.ProcessSet([0, 1]) if _SIZE > 2 else hvd.global_process_set


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init(process_sets=[PAIR] if PAIR is not hvd.global_process_set else None)
    yield


@pytest.fixture(autouse=True)
def _small_buckets(monkeypatch):
    monkeypatch.setenv(overlap.BUCKET_ENV, "64")
    yield
    assert overlap.pending_count() == 0, "a bucket was started and never finished"


def _variables(dtype, key):
    """The same initial weights on every rank (seeded by ``key``, not by rank)."""
    return [tf.Variable(random_array(dtype, s, f"{key}-w{i}", 0) * 0.5, name=f"w{i}") for i, s in enumerate(SHAPES)]


def _loss(variables, x):
    """A chain: every variable's gradient needs the ones after it (the backward's order)."""
    h = x
    (a0, b0, a1, b1, a2, b2, c) = variables
    h = tf.tanh(tf.matmul(h, a0) + b0)
    h = tf.tanh(tf.matmul(h, a1) + b1)
    h = tf.matmul(h, a2) + b2
    return tf.reduce_sum(h * h) + tf.reduce_sum(c * c) * tf.reduce_sum(x)


def _gather_mean(local, members):
    """The average over ``members`` of every rank's local gradients, in float64."""
    everyone = hvd.allgather_object([np.asarray(g, dtype=np.float64) for g in local])
    return [np.mean([everyone[r][i] for r in members], axis=0) for i in range(len(local))]


def _tolerance(dtype, compression):
    if dtype == "float16" or compression == "fp16":
        return dict(rtol=2e-2, atol=2e-2)
    if dtype == "float32":
        return dict(rtol=1e-5, atol=1e-5)
    return dict(rtol=1e-12, atol=1e-12)


def _run(mode, fn, *args):
    return fn(*args) if mode == "eager" else tf.function(fn)(*args)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,compression", [("float32", "none"), ("float64", "none"), ("float16", "none"),
                                               ("float32", "fp16"), ("float16", "fp16")])
def test_tape_matches_numpy_reference(mode, dtype, compression, request):
    key = request.node.name
    size, rank = hvd.size(), hvd.rank()
    variables = _variables(dtype, key)
    x = tf.constant(random_array(dtype, (4, 3), f"{key}-x", rank))
    comp = getattr(hvd.Compression, compression)
    before = len(overlap.submissions)

    def step(x):
        with tf.GradientTape() as tape:
            loss = _loss(variables, x)
        local = tape.gradient(loss, variables)
        with tf.GradientTape() as tape:
            loss = _loss(variables, x)
        averaged = hvd.DistributedGradientTape(tape, compression=comp).gradient(loss, variables)
        return local, averaged

    local, averaged = _run(mode, step, x)
    expected = _gather_mean([g.numpy() for g in local], range(size))
    buckets = {name for name, _ in overlap.submissions[before:]}
    assert len(buckets) > 1, f"one bucket only: {buckets}"
    for i, (got, want) in enumerate(zip(averaged, expected)):
        assert got.dtype == tf.as_dtype(dtype) and tuple(got.shape) == SHAPES[i]
        np.testing.assert_allclose(got.numpy().astype(np.float64), want, err_msg=f"w{i}",
                                   **_tolerance(dtype, compression))


@pytest.mark.parametrize("mode", MODES)
def test_process_set_predivide_sparse_and_none(mode, request):
    """Members of PAIR average over PAIR (rank 2 keeps its own gradients); predivide leaves the
    average unchanged; an IndexedSlices gradient is allgathered while the buckets fly; an unused
    variable's gradient stays None."""
    key = request.node.name
    rank = hvd.rank()
    variables = _variables("float32", key)
    table = tf.Variable(np.arange(12, dtype=np.float32).reshape(6, 2), name="table")
    unused = tf.Variable(np.ones(3, np.float32), name="unused")
    ids = tf.constant([rank % 6, (rank + 2) % 6])
    x = tf.constant(random_array("float32", (4, 3), f"{key}-x", rank))
    everything = variables + [table, unused]

    def loss_fn():
        return _loss(variables, x) + tf.reduce_sum(tf.gather(table, ids)) * float(rank + 1)

    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn()
        local = tape.gradient(loss, variables)
        with tf.GradientTape() as tape:
            loss = loss_fn()
        tape = hvd.DistributedGradientTape(tape, process_set=PAIR, gradient_predivide_factor=2.0,
                                           name="overlap.pair")
        return local, tape.gradient(loss, everything)

    local, averaged = _run(mode, step)
    local = [g.numpy() for g in local]
    members = [0, 1]
    mean = _gather_mean(local, members)  # a global collective: every rank calls it
    expected = mean if rank in members else local
    for i, (got, want) in enumerate(zip(averaged[:len(variables)], expected)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5, err_msg=f"w{i} rank {rank}")
    sparse, none = averaged[-2:]
    assert none is None
    assert isinstance(sparse, tf.IndexedSlices)
    table_expected = np.zeros((6, 2))
    for r in (members if rank in members else [rank]):
        for i in (r % 6, (r + 2) % 6):
            table_expected[i] += (r + 1) / (len(members) if rank in members else 1)
    np.testing.assert_allclose(tf.convert_to_tensor(sparse).numpy(), table_expected, rtol=1e-6)


def test_keras_fit_matches_numpy_sgd():
    """model.fit with the DistributedOptimizer (several buckets): each step applies the ranks'
    averaged gradients, checked against plain SGD on the gathered local gradients."""
    size, rank = hvd.size(), hvd.rank()
    lr, steps = 0.1, 3
    xs = random_array(np.float32, (8, 5), "fit-x", rank)
    ys = random_array(np.float32, (8, 3), "fit-y", rank)

    def build():
        keras.utils.set_random_seed(11)
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(9, activation="tanh"),
                                 keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(3)])

    reference = build()
    weights = [w.numpy().astype(np.float64) for w in reference.trainable_weights]
    for _ in range(steps):
        for w, value in zip(reference.trainable_weights, weights):
            w.assign(value.astype(np.float32))
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(reference(xs) - ys))
        local = [g.numpy() for g in tape.gradient(loss, reference.trainable_weights)]
        weights = [w - lr * g for w, g in zip(weights, _gather_mean(local, range(size)))]

    model = build()
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(lr)), loss="mse", jit_compile=False)
    before = len(overlap.submissions)
    model.fit(xs, ys, batch_size=8, epochs=steps, shuffle=False, verbose=0)
    assert len({name for name, _ in overlap.submissions[before:]}) > 1
    for i, (got, want) in enumerate(zip(model.trainable_weights, weights)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5, err_msg=f"weight {i}")


def _marked(value, record, sleep=0.0):
    """``value`` whose gradient passes through a (stateless) numpy_function that calls ``record()``
    when the backward pass gets there, after sleeping ``sleep`` seconds."""
    @tf.custom_gradient
    def identity(x):
        def grad(dy):
            def mark(a):
                time.sleep(sleep)
                record()
                return a
            out = tf.numpy_function(mark, [dy], dy.dtype, stateful=False)
            out.set_shape(dy.shape)
            return out
        return tf.identity(x), grad
    return identity(value)


def test_first_bucket_is_submitted_before_the_backward_ends():
    """Layers 0..5, buckets of one layer each: the last layer's bucket must be submitted while
    the backward is still in layer 0 (held there 0.3 s by a marker on layer 1's input gradient),
    i.e. before layer 0's gradient is computed; layer 0's bucket only afterwards."""
    rank = hvd.rank()
    rng = np.random.default_rng(5)
    weights = [tf.Variable(rng.standard_normal((64, 64)).astype(np.float32) * 0.1, name=f"layer{i}")
               for i in range(6)]
    x = tf.constant(random_array(np.float32, (32, 64), "overlap-x", rank))
    times: dict = {}
    lock = threading.Lock()

    def record(what):
        def now():
            with lock:
                times.setdefault(what, time.monotonic())
        return now

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = tf.tanh(tf.matmul(x, _marked(weights[0], record("layer0 gradient"))))
            h = _marked(h, record("layer1 input gradient"), sleep=0.3)
            for w in weights[1:]:
                h = tf.tanh(tf.matmul(h, w))
            loss = tf.reduce_sum(h)
        return hvd.DistributedGradientTape(tape, name="overlap.proof").gradient(loss, weights)

    for attempt in range(2):  # the first call traces
        times.clear()
        before = len(overlap.submissions)
        grads = step(x)
        submitted = overlap.submissions[before:]
    assert [g.shape for g in grads] == [w.shape for w in weights]
    names = [name for name, _ in submitted]
    assert len(names) == 6, names  # 16 KiB per layer, 64-byte buckets: one per layer, last first
    first_submitted = submitted[0][1]
    last_submitted = submitted[-1][1]
    assert first_submitted < times["layer1 input gradient"] < times["layer0 gradient"], (submitted, times)
    assert last_submitted >= times["layer0 gradient"], (submitted, times)


@pytest.mark.parametrize("mode", MODES)
def test_mismatched_shapes_name_the_variables(mode):
    """Rank 0's variable is longer: every rank gets an HvpsError naming the bucket and its variable
    (not a hang), nothing stays pending, and the next step works."""
    rank = hvd.rank()
    var = tf.Variable(np.ones(5 if rank == 0 else 4, np.float32), name="mismatched_variable")

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(var * var)
        return hvd.DistributedGradientTape(tape, name=f"overlap.mismatch.{mode}").gradient(loss, [var])

    start = time.monotonic()
    with pytest.raises((hvd.HvpsError, tf.errors.OpError), match="mismatched_variable") as info:
        _run(mode, step)
    assert "HvpsError" in str(info.value) or isinstance(info.value, hvd.HvpsError)
    assert time.monotonic() - start < float(os.environ.get("HVPS_STALL_CHECK_TIME_SECONDS", "60")) * 1.5 + 5
    good = tf.Variable(np.full(3, float(rank), np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(good) * float(rank + 1)
    (g,) = hvd.DistributedGradientTape(tape).gradient(loss, [good])
    np.testing.assert_allclose(g.numpy(), np.full(3, np.mean(np.arange(hvd.size()) + 1.0)))


def test_failed_step_between_start_and_finish_leaves_nothing_behind():
    """Every rank fails in the backward after the first buckets started (a marker on the first
    layer's gradient raises): the step raises, the started buckets wait in the registry, and the
    next step drains them (no DuplicateNameError, no leak) and averages correctly."""
    size, rank = hvd.size(), hvd.rank()
    variables = _variables("float32", "abandoned")
    x = tf.constant(random_array("float32", (4, 3), "abandoned-x", rank))
    fail = {"now": True, "seen": None}

    def check():
        # the first variable is alone in the last of 3 buckets: fail once the other 2 started on this
        # rank (the same buckets on every rank, so they complete), not before
        if fail["now"]:
            deadline = time.monotonic() + 10
            while overlap.pending_count() < 2 and time.monotonic() < deadline:
                time.sleep(0.005)
            fail["seen"] = overlap.pending_count()
            raise RuntimeError("injected failure in the backward pass")

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            first = _marked(variables[0], check)
            loss = _loss([first] + variables[1:], x)
        local = tape.gradient(loss, variables[1:])
        with tf.GradientTape() as tape:
            first = _marked(variables[0], check)
            loss = _loss([first] + variables[1:], x)
        return local, hvd.DistributedGradientTape(tape, name="overlap.abandoned").gradient(loss, variables)

    fail["now"] = True
    before = len(overlap.submissions)
    with pytest.raises(tf.errors.OpError, match="injected failure"):
        step(x)
    assert fail["seen"] == 2 and len(overlap.submissions) == before + 2, (fail, overlap.submissions[before:])
    assert overlap.pending_count() == 2  # started, never finished: left for the next step to drain
    hvd.barrier()  # every rank failed its step
    fail["now"] = False
    local, averaged = step(x)
    expected = _gather_mean([g.numpy() for g in local], range(size))
    for i, (got, want) in enumerate(zip(averaged[1:], expected)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5, err_msg=f"w{i + 1}")
    assert overlap.pending_count() == 0
