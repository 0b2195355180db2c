"""Inner multi-rank training tests for the TensorFlow/Keras 3 adapter.

DistributedGradientTape training keeps identical weights on every rank and
matches single-process training on the global batch; ``model.fit`` with the
Keras DistributedOptimizer and the broadcast / metric-average / warm-up
callbacks ends with identical weights and averaged metrics; gradient
accumulation; HDF5 checkpoints through CheckpointCallback.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from tf_testutil import assert_identical_across_ranks, data, flat_weights, make_model  # noqa: E402

import hvps.adapters.tensorflow as hvd_tf  # noqa: E402
import hvps.adapters.tensorflow.keras as hvd  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.set_threads(1)
    hvd.init()
    yield


@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_gradient_tape_training_matches_global_batch(compression):
    size, rank = hvd.size(), hvd.rank()
    model = make_model(seed=100 + rank)  # different on purpose: broadcast_variables must fix it
    hvd.broadcast_variables(model.variables, root_rank=0)
    reference = make_model(seed=0)
    reference.set_weights(model.get_weights())
    opt, ref_opt = keras.optimizers.SGD(0.1, momentum=0.5), keras.optimizers.SGD(0.1, momentum=0.5)
    comp = getattr(hvd.Compression, compression)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        tape = hvd_tf.DistributedGradientTape(tape, compression=comp)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def ref_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(reference(x) - y))
        grads = tape.gradient(loss, reference.trainable_variables)
        ref_opt.apply_gradients(zip(grads, reference.trainable_variables))

    start = flat_weights(model)
    for s in range(4):
        x, y = data(f"tape-{s}", rank)
        step(tf.constant(x), tf.constant(y))
        everyone = [data(f"tape-{s}", r) for r in range(size)]
        ref_step(tf.constant(np.concatenate([e[0] for e in everyone])),
                 tf.constant(np.concatenate([e[1] for e in everyone])))
    final = flat_weights(model)
    assert not np.allclose(final, start), "training did not change the weights"
    assert_identical_across_ranks(final, "weights after DistributedGradientTape training")
    tol = 1e-5 if compression == "none" else 5e-3
    np.testing.assert_allclose(final, flat_weights(reference), rtol=tol, atol=tol)


def _compiled(seed, **opt_kwargs):
    model = make_model(seed)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), **opt_kwargs)
    model.compile(optimizer=opt, loss="mse", metrics=["mae"], jit_compile=False)
    return model, opt


class Recorder(keras.callbacks.Callback):
    """Keeps the per-rank logs before MetricAverageCallback rewrites them."""

    def __init__(self):
        super().__init__()
        self.raw = []

    def on_epoch_end(self, epoch, logs=None):
        self.raw.append(dict(logs))


def test_model_fit_with_distributed_optimizer_and_callbacks():
    size, rank = hvd.size(), hvd.rank()
    model, opt = _compiled(seed=rank)  # different initial weights on every rank
    x, y = data("fit", rank, n=32)
    vx, vy = data("fit-val", rank, n=16)
    recorder = Recorder()
    warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.05, warmup_epochs=2, momentum_correction=False)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), warmup, recorder,
                 hvd.callbacks.MetricAverageCallback()]
    history = model.fit(x, y, batch_size=8, epochs=3, validation_data=(vx, vy), callbacks=callbacks, verbose=0)
    assert int(opt.iterations.numpy()) == 3 * 4
    assert_identical_across_ranks(flat_weights(model), "weights after model.fit")
    assert_identical_across_ranks(np.concatenate([np.ravel(v.numpy()) for v in opt.variables]), "optimizer state")
    everyone = hvd.allgather_object(recorder.raw)
    for epoch in range(3):
        for key in ("loss", "mae", "val_loss", "val_mae"):
            per_rank = [everyone[r][epoch][key] for r in range(size)]
            assert history.history[key][epoch] == pytest.approx(np.mean(per_rank), rel=1e-12), key
    if size > 1:
        assert len({everyone[r][-1]["loss"] for r in range(size)}) > 1, "ranks saw the same data"
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.05)  # warm-up finished at the target


def test_backward_passes_per_step_accumulates():
    size, rank = hvd.size(), hvd.rank()
    model, opt = _compiled(seed=0, backward_passes_per_step=2, average_aggregated_gradients=True)
    reference = make_model(seed=0)
    reference.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse", jit_compile=False)
    x, y = data("bpps", rank, n=16)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(opt.iterations.numpy()) == 1  # two passes, one update
    assert_identical_across_ranks(flat_weights(model), "weights with backward_passes_per_step=2")
    everyone = [data("bpps", r, n=16) for r in range(size)]
    # one update with the mean gradient of all ranks' two batches == one step on everything
    reference.fit(np.concatenate([e[0] for e in everyone]), np.concatenate([e[1] for e in everyone]),
                  batch_size=16 * size, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(flat_weights(model), flat_weights(reference), rtol=1e-5, atol=1e-6)


def test_checkpoint_callback_round_trip(shared_dir):
    rank = hvd.rank()
    directory = shared_dir / "tf-ckpt"
    model, _ = _compiled(seed=0)
    x, y = data("ckpt", rank, n=16)
    ckpt = hvd.callbacks.CheckpointCallback(directory, keep_last=2, fsync=False)
    model.fit(x, y, batch_size=8, epochs=3, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), ckpt],
              verbose=0)
    hvd.barrier()
    saved = sorted(p.name for p in directory.glob("*.h5"))
    assert len(saved) == 2, saved  # keep_last=2 of epochs 0..2
    fresh, _ = _compiled(seed=123)
    fresh.build((None, 4))
    fresh.optimizer.build(fresh.trainable_variables)
    start = hvd.callbacks.CheckpointCallback(directory, fsync=False).restore(fresh)
    assert start == 3
    np.testing.assert_array_equal(flat_weights(fresh), flat_weights(model))
