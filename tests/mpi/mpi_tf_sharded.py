"""Inner multi-rank tests of the Keras 3 ``ShardedOptimizer`` (ZeRO stage 1-2, issue 39 item 6): against
single-process training on the global batch, computed in-process on every rank without hvps.

Bit-exactness needs gradients whose average is exact (as ``mpi_sharded_optimizer.py`` does for torch): three
linear heads on integer inputs, a loss linear in the outputs (``sum(head * target)``) with dyadic weights, so
the gradients do not depend on the weights and are small multiples of 1/64, exact in float32 in any order.
Each rank's loss is its part of the global loss times N, so the Average reduce-scatter divides an exact
multiple of N by N and yields the reference's gradient bit for bit. The model has 56 variables' elements
(18 + 35 + 3, not a multiple of 3); a bucket cap of 16 floats gives buckets of 15, 3, 28 and 7+3 elements
(padded at 2 ranks and at 3).
"""

import functools
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvps.adapters.tensorflow.keras as hvd  # noqa: E402
from hvps import HvpsError  # noqa: E402
from hvps.adapters.tensorflow.keras_sharded_optimizer import ShardedOptimizer  # noqa: E402

pytestmark = pytest.mark.timeout(180)

GLOBAL_BATCH = 12  # divisible by 1, 2 and 3
STEPS = 3
SCALE = 2.0 ** -6
HEADS = [(5, 3, True), (4, 7, True), (3, 1, False)]  # (inputs, outputs, bias)
TINY_BUCKETS = 16 * 4  # bytes: 16 float32 elements


@pytest.fixture(scope="module", autouse=True)
def _init():
    try:
        hvd.set_threads(1)
    except RuntimeError:  # a module before this one in the job has started TensorFlow: its pools stand
        pass
    hvd.init()
    yield


def _model():
    keras.utils.set_random_seed(11)
    inputs = [keras.Input((i,)) for i, _, _ in HEADS]
    outputs = [keras.layers.Dense(o, use_bias=b)(x) for x, (_, o, b) in zip(inputs, HEADS)]
    model = keras.Model(inputs, outputs)
    model.set_weights([np.round(w * 8) / 8 for w in model.get_weights()])
    return model


def _data(step):
    rng = np.random.default_rng(500 + step)
    xs = [rng.integers(-4, 5, (GLOBAL_BATCH, i)).astype(np.float32) for i, _, _ in HEADS]
    ts = [rng.integers(-4, 5, (GLOBAL_BATCH, o)).astype(np.float32) for _, o, _ in HEADS]
    return xs, ts


def _local(arrays):
    per = GLOBAL_BATCH // hvd.size()
    return [a[hvd.rank() * per : (hvd.rank() + 1) * per] for a in arrays]


def _optimizer(kind):
    if kind == "sgd":
        return keras.optimizers.SGD(2.0 ** -4, momentum=0.5)
    return keras.optimizers.Adam(2.0 ** -4)


def _step(model, opt, xs, ts, factor):
    """One eager training step of ``opt`` on ``factor * sum(head * target)``."""
    with tf.GradientTape() as tape:
        loss = tf.add_n([tf.reduce_sum(y * t) for y, t in zip(model(xs), ts)]) * factor
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))


@functools.lru_cache(maxsize=None)
def _reference(kind):
    """The single-process run on the global batches, after each step (computed once per kind: the tests only
    read it)."""
    ref, opt = _model(), _optimizer(kind)
    weights = []
    for s in range(STEPS):
        _step(ref, opt, *_data(s), SCALE)
        weights.append([v.numpy() for v in ref.weights])
    return weights


def _assert_equal(model, expected, what):
    for v, b in zip(model.weights, expected):
        a = v.numpy()
        assert np.array_equal(a, b), f"{what}: {v.path} differs from the single-process run by {np.abs(a - b).max()}"


_RUNS: dict = {}


def _sharded_tape_run(kind, shared_dir):
    """Once per kind: ``STEPS`` eager steps of a sharded ``kind`` on this rank's part of the global batches,
    Adam's saved by ``CheckpointCallback`` after each step (epoch = step) in ``shared_dir``:
    ``(the weights after each step, the optimizer, the checkpoint directory)``."""
    if kind not in _RUNS:
        directory = shared_dir / f"keras-sharded-{kind}"
        model = _model()
        opt = hvd.DistributedOptimizer(_optimizer(kind), shard=True, bucket_bytes=TINY_BUCKETS)
        model.compile(optimizer=opt, loss="mse")
        callback = hvd.callbacks.CheckpointCallback(directory, fsync=False)
        callback.set_model(model)
        weights = []
        for s in range(STEPS):
            _local_step(model, opt, s, hvd.size())
            weights.append([v.numpy() for v in model.weights])
            if kind == "adam":
                callback.on_epoch_end(s)
        _RUNS[kind] = (weights, opt, directory)
    return _RUNS[kind]


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_gradient_tape_loop_is_bit_identical_to_one_process(kind, shared_dir):
    """Eagerly (``model.fit`` below runs the step inside its compiled train function)."""
    expected = _reference(kind)
    weights, opt, _ = _sharded_tape_run(kind, shared_dir)
    assert isinstance(opt, ShardedOptimizer)
    for s in range(STEPS):
        for name, a, b in zip(range(len(weights[s])), weights[s], expected[s]):
            assert np.array_equal(a, b), f"{kind}, step {s}: weight {name} differs from the single-process run"
    assert len(opt.shard_variables) == 4
    assert int(opt.iterations.numpy()) == STEPS


class _LinearLoss(keras.losses.Loss):
    """``factor * sum(y_pred * y_true)`` over the batch (no mean: the average over ranks does it)."""

    def __init__(self, factor):
        super().__init__(reduction="sum")
        self.factor = factor

    def call(self, y_true, y_pred):
        return keras.ops.sum(y_pred * y_true, axis=-1) * self.factor


def test_model_fit_is_bit_identical_to_one_process():
    """``model.fit``'s compiled train function (the collectives as ops in a graph), with Horovod's broadcast
    callback: with TensorFlow Keras builds the optimizer in the first batch, so the callback broadcasts the
    optimizer's variables after it, which must leave every rank's shard of the state alone."""
    size = hvd.size()
    expected = _reference("adam")[-1]
    model = _model()
    opt = hvd.DistributedOptimizer(_optimizer("adam"), shard=True, bucket_bytes=TINY_BUCKETS)
    model.compile(optimizer=opt, loss=[_LinearLoss(SCALE * size)] * len(HEADS), jit_compile=False)
    batches = [[_local(arrays) for arrays in _data(s)] for s in range(STEPS)]
    x = [np.concatenate([b[0][i] for b in batches]) for i in range(len(HEADS))]
    t = [np.concatenate([b[1][i] for b in batches]) for i in range(len(HEADS))]
    model.fit(x, t, batch_size=GLOBAL_BATCH // size, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    _assert_equal(model, expected, "model.fit")
    assert int(opt.iterations.numpy()) == STEPS


def _state_bytes(variables):
    return sum(int(np.prod(v.shape)) * v.dtype.size if hasattr(v.dtype, "size") else
               int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables if len(v.shape) > 0)


def test_optimizer_state_is_one_nth():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(97, activation="tanh"), keras.layers.Dense(31)])
    replicated = keras.optimizers.Adam()
    replicated.build(model.trainable_variables)
    opt = ShardedOptimizer(keras.optimizers.Adam(), bucket_bytes=10_000)
    opt.build(model.trainable_variables)
    numel = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    elements = sum(b.shard_numel for b in opt._buckets)
    assert elements * hvd.size() - numel < hvd.size() * len(opt._buckets)  # padding only
    mine, full = _state_bytes(opt.shard_state_variables), _state_bytes(replicated.variables)
    assert full == 2 * 4 * numel
    assert mine == 2 * 4 * elements
    assert mine <= full / hvd.size() * 1.02, (mine, full)
    # what a broadcast from the root would overwrite: the replicated scalars only, never a shard
    assert [tuple(v.shape) for v in opt.variables] == [()] * len(opt.variables)


def test_fp16_compression_is_close():
    keras.utils.set_random_seed(5)
    ref = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])
    model = keras.models.clone_model(ref)
    model.set_weights(ref.get_weights())
    ref_opt = keras.optimizers.SGD(0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), shard=True,
                                   compression=hvd.Compression.fp16)
    rng = np.random.default_rng(9)
    for _ in range(3):
        x = rng.standard_normal((GLOBAL_BATCH, 8)).astype(np.float32)
        for m, o, batch in ((ref, ref_opt, x), (model, opt, _local([x])[0])):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(m(batch)))
            o.apply_gradients(zip(tape.gradient(loss, m.trainable_variables), m.trainable_variables))
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)


def test_variables_that_differ_across_ranks_are_named():
    if hvd.size() == 1:
        pytest.skip("needs two ranks")
    last = hvd.size() - 1
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(3 if hvd.rank() != last else 2)])
    opt = ShardedOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(HvpsError) as caught:
        opt.build(model.trainable_variables)
    message = str(caught.value)
    assert "variable 2" in message and "kernel" in message and "rank 0" in message and f"rank {last}" in message, \
        message


def test_unsupported_combinations_are_refused():
    sgd = keras.optimizers.SGD
    refusals = [
        (lambda: ShardedOptimizer(sgd(0.1), op=hvd.Adasum), "Adasum"),
        (lambda: ShardedOptimizer(sgd(0.1), compression=hvd.Compression.topk(0.1)), "compression"),
        (lambda: ShardedOptimizer(sgd(0.1, clipnorm=1.0)), "clipnorm"),
        (lambda: ShardedOptimizer(sgd(0.1, global_clipnorm=1.0)), "global_clipnorm"),
        (lambda: ShardedOptimizer(sgd(0.1, use_ema=True)), "use_ema"),
        (lambda: ShardedOptimizer(keras.optimizers.LossScaleOptimizer(sgd(0.1))), "LossScaleOptimizer"),
        (lambda: hvd.DistributedOptimizer(sgd(0.1), shard=True, backward_passes_per_step=2),
         "backward_passes_per_step"),
        (lambda: ShardedOptimizer(hvd.DistributedOptimizer(sgd(0.1))), "already a wrapper"),
    ]
    built = sgd(0.1)
    built.build([keras.Variable(np.zeros(3, np.float32))])
    refusals.append((lambda: ShardedOptimizer(built), "already built"))
    for make, words in refusals:
        with pytest.raises(ValueError, match=words):
            make()
    embedding = keras.layers.Embedding(10, 4)
    embedding.build((None,))
    opt = ShardedOptimizer(sgd(0.1))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(embedding(tf.constant([1, 2])))
    grads = tape.gradient(loss, embedding.trainable_variables)
    assert isinstance(grads[0], tf.IndexedSlices)
    with pytest.raises(ValueError, match="sparse gradient"):
        opt.apply_gradients(zip(grads, embedding.trainable_variables))


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_elastic_state_restores_rebuilds_a_lost_shard_and_reshards_to_fewer_ranks(kind, monkeypatch):
    """Issue 39 items 5-6 on real ranks, without killing one: KerasState over a sharded optimizer. A restore
    undoes an uncommitted step; rank 1 then forgets its shard of the state and its save no longer matches the
    others' (a worker that replaced a dead one): the sync rebuilds it from its ring neighbour's copy. Then the
    last rank stops, as if dead, and the others re-shard to one rank fewer (a process set of the survivors
    stands for the smaller world), its block coming from a neighbour's copy. Each step is bit-exact the
    one-process run's."""
    import hvps
    from hvps.adapters.tensorflow.elastic import KerasShardsHandler

    expected = _reference(kind)
    model = _model()
    opt = hvd.DistributedOptimizer(_optimizer(kind), shard=True, bucket_bytes=TINY_BUCKETS)
    model.compile(optimizer=opt, loss="mse")
    state = hvd.elastic.KerasState(model, batch=0)
    assert isinstance(state._shards, KerasShardsHandler) and not state.same_on_every_rank
    state.sync()  # builds the optimizer; the same world as the save: nothing moves
    _local_step(model, opt, 0, hvd.size())
    state.batch = 1
    state.commit()
    _local_step(model, opt, 1, hvd.size())  # lost: not committed
    state.restore()
    _assert_equal(model, expected[0], f"{kind}: after a restore")
    saved, version = state._shards._saved, state._shards._saved.version
    if hvd.rank() == 1:
        saved.version = -1  # not the save the others hold: rank 1 contributes nothing
        saved.blocks = [block * 0 for block in saved.blocks]
        opt.load_shard_state([{key: value * 0 for key, value in entry.items()} for entry in opt.shard_state()])
    state.sync()
    saved.version = version  # the versions that a reset's new round would align
    assert state.batch == 1
    _local_step(model, opt, 1, hvd.size())
    _assert_equal(model, expected[1], f"{kind}: a step after the rebuild from a neighbour's copy")
    state.commit()
    xs, ts = (_local(arrays) for arrays in _data(2))
    traced = tf.function(lambda xs, ts: _step(model, opt, xs, ts, SCALE * hvd.size()))
    traced.get_concrete_function(xs, ts)  # traced at this size, not run
    fewer = hvd.size() - 1
    monkeypatch.setenv("HVPS_DYNAMIC_PROCESS_SETS", "1")  # read when a set is added or removed
    survivors = hvps.add_process_set(list(range(fewer)))
    try:
        if hvd.rank() < fewer:
            opt.process_set = survivors
            state._shards.sync()  # the survivors' part of state.sync(): the replicated variables are alike
            assert opt.world() == (fewer, hvd.rank())
            # the step traced before the re-shard holds the old shards: it fails naming why, before any collective
            with pytest.raises(tf.errors.OpError, match=f"laid out for {fewer + 1} ranks; an elastic reset has "
                                                        f"re-sharded them for {fewer}"):
                traced(xs, ts)
            _local_step(model, opt, 2, fewer)
            _assert_equal(model, expected[2], f"{kind}: a step at {fewer} rank(s) after the re-shard")
    finally:
        opt.process_set = hvps.global_process_set
        hvps.remove_process_set(survivors)


def _local_step(model, opt, step, ranks):
    """Step ``step`` of the dyadic loop on this rank's part of the global batch split over ``ranks`` ranks."""
    per = GLOBAL_BATCH // ranks
    rows = slice(hvd.rank() * per, (hvd.rank() + 1) * per)
    xs, ts = _data(step)
    _step(model, opt, [x[rows] for x in xs], [t[rows] for t in ts], SCALE * ranks)


def _assert_reads_at_any_rank_count(checkpoint, directory, layout):
    """Emulated at 1 to 4 ranks: rank q of M reads exactly its slice of the consolidated state (zero padded)."""
    from hvps.adapters.tensorflow.keras.sharded_checkpoint import FRAMEWORK, decode_scalar
    from hvps.checkpoint import sharded_optimizer_state as saved
    from hvps.checkpoint.resharding import shard_bounds

    manifest = saved.manifest_of(checkpoint.optimizer, checkpoint.path)
    with saved.open_shards(directory, manifest, checkpoint.epoch, FRAMEWORK) as shards:
        whole = saved.stage_consolidated(shards, manifest, decode_scalar)
        for size in range(1, 5):
            other = saved.relayout(layout, size)
            for q in range(hvd.rank(), size, hvd.size()):
                staged = saved.stage_sharded(shards, manifest, other, q, decode_scalar)
                for b, bucket in enumerate(other["buckets"]):
                    lo, hi = shard_bounds(bucket["numel"], size, q)
                    for key in ("momentum", "velocity"):
                        flat = np.concatenate([whole[i][key].reshape(-1) for i, _, _ in bucket["params"]])
                        expected = np.zeros(hi - lo, flat.dtype)
                        expected[: max(0, min(hi, flat.size) - lo)] = flat[lo:hi]
                        assert np.array_equal(staged[b][key], expected), (size, q, b, key)
                    assert int(staged[b]["iteration"]) == checkpoint.epoch + 1


def test_checkpoint_callback_reshards_and_restores_into_one_process(shared_dir, monkeypatch):
    """Issue 39, items 4 and 6: ``CheckpointCallback`` saved the sharded Adam state of the eager run as per-rank
    shards (1/N of the state per file); restored by a sharded optimizer over N - 1 ranks (another bucket layout:
    a real re-shard, N -> N - 1) while the rank left out restores it into a plain Keras Adam (consolidated, as
    one process would), both continue bit-identically to one process. Then a missing shard of the newest
    version: ``restore("latest")`` warns and falls back to the previous one."""
    import h5py

    import hvps
    from hvps.checkpoint.sharded_optimizer_state import shard_file_name

    size, fewer = hvd.size(), hvd.size() - 1
    expected = _reference("adam")
    _, opt, directory = _sharded_tape_run("adam", shared_dir)
    with h5py.File(directory / "optim-epoch-000001" / shard_file_name(hvd.rank(), size)) as f:
        stored = sum(f["optimizer"][b][k].size for b in f["optimizer"] for k in f["optimizer"][b])
    assert stored == 2 * sum(b.shard_numel for b in opt._buckets)

    monkeypatch.setenv("HVPS_DYNAMIC_PROCESS_SETS", "1")  # read when a set is added or removed
    subset = hvps.add_process_set(list(range(fewer)))
    try:
        inside = hvd.rank() < fewer
        model = _model()
        model.set_weights([w + 1 for w in model.get_weights()])
        opt2 = (ShardedOptimizer(keras.optimizers.Adam(1.0), bucket_bytes=TINY_BUCKETS * 2, process_set=subset)
                if inside else keras.optimizers.Adam(1.0))
        model.compile(optimizer=opt2, loss="mse")
        opt2.build(model.trainable_variables)
        callback = hvd.callbacks.CheckpointCallback(directory, fsync=False)
        assert callback.restore(model, version=1) == 2
        assert float(opt2.learning_rate.numpy()) == 2.0 ** -4 and int(opt2.iterations.numpy()) == 2
        if inside:
            _local_step(model, opt2, 2, fewer)
        else:
            _step(model, opt2, *_data(2), SCALE)
        _assert_equal(model, expected[2], f"{size} -> {fewer if inside else 'one process'}, step 2")
        _assert_reads_at_any_rank_count(callback.manager.loaded, directory, opt.shard_layout())

        if hvd.rank() == 0:
            (directory / "optim-epoch-000002" / shard_file_name(size - 1, size)).unlink()
        hvps.barrier()
        with pytest.warns(RuntimeWarning, match="skipping checkpoint epoch 2"):
            assert callback.restore(model) == 2
        _assert_equal(model, expected[1], "fallen back to epoch 1")
        assert int(opt2.iterations.numpy()) == 2
    finally:
        hvps.remove_process_set(subset)


def test_sharded_restore_refuses_another_model_and_a_replicated_optimizers_checkpoint(shared_dir):
    """A sharded checkpoint of another model raises CheckpointError naming the misfit (no fallback: every version
    is of that model); a replicated optimizer's checkpoint (variables by position) is refused by a sharded one."""
    from hvps.checkpoint.format import CheckpointError

    _, _, directory = _sharded_tape_run("adam", shared_dir)
    other = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4)])
    other.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.1), shard=True), loss="mse")
    with pytest.raises(CheckpointError, match="does not fit this model's optimizer") as caught:
        hvd.callbacks.CheckpointCallback(directory, fsync=False).restore(other)
    assert "another model" in str(caught.value)
    replicated = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4)])
    replicated.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    replicated.optimizer.build(replicated.trainable_variables)
    callback = hvd.callbacks.CheckpointCallback(shared_dir / "keras-replicated-ckpt", fsync=False)
    callback.set_model(replicated)
    callback.on_epoch_end(0)
    with pytest.raises(ValueError, match="a sharded optimizer restores the state of a sharded one"):
        callback.restore(other)
