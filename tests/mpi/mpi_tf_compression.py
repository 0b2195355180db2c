"""Inner multi-rank tests of gradient compression in the TensorFlow/Keras 3 adapter.

``model.fit`` with the Keras DistributedOptimizer and ``Compression.topk(0.05)``,
``Compression.int8`` or ``Compression.powersgd(rank=1)`` keeps identical weights on every rank and counts the
bytes on the wire; one DistributedGradientTape step with exact top-k (eagerly
and in a tf.function) equals the dense average of every rank's top-k gradient
(selected by numpy, not by hvps's compressor); two DistributedGradientTape steps with
``Compression.powersgd`` equal PowerSGD written out in numpy (``powersgd_reference``); bad
``compression`` arguments raise TypeError / ValueError.
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


@pytest.mark.parametrize("kind", ["topk", "int8", "powersgd"])
def test_fit_with_compression_keeps_ranks_identical(kind):
    rank = hvd.rank()
    compression = {"topk": lambda: hvd.Compression.topk(0.05), "int8": lambda: hvd.Compression.int8,
                   "powersgd": lambda: hvd.Compression.powersgd(rank=1, start_iter=2)}[kind]()
    model = make_model(seed=rank, hidden=16)  # different on every rank: the broadcast callback fixes that
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), compression=compression)
    assert opt.compression is compression
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    x, y = data(f"fit-{kind}", rank, n=32)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.CompressionEpochCallback()]
    model.fit(x, y, batch_size=8, epochs=2, callbacks=callbacks, verbose=0)
    start = flat_weights(model)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert not np.array_equal(flat_weights(model), start), "training did not change the weights"
    assert_identical_across_ranks(flat_weights(model), f"weights after model.fit with {kind}")
    stats = opt.compression_stats()
    assert stats["exchanges"] == 3 * 4 * len(model.trainable_variables)
    assert stats["bytes_sent"] > 0 and stats["bytes_received"] > 0
    if kind == "topk":
        assert stats["ratio"] > 4, stats
        # error feedback keyed "grad.<index>.<variable path>"
        residuals = compression.state_dict()
        assert {key.split(".", 2)[2] for key in residuals} == {v.path for v in model.trainable_variables}


def topk_reference(gradient, density):
    """Numpy's own exact top-k: the ``max(1, floor(n * density))`` largest-magnitude entries of
    ``gradient`` kept, every other entry zero (a stable sort by magnitude; random gradients have no ties)."""
    flat = np.asarray(gradient).reshape(-1)
    k = max(1, int(flat.size * density))
    keep = np.argsort(-np.abs(flat), kind="stable")[:k]
    dense = np.zeros_like(flat)
    dense[keep] = flat[keep]
    return dense.reshape(np.shape(gradient))


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_topk_step_equals_dense_average_of_decompressed(mode):
    size, rank = hvd.size(), hvd.rank()
    model = make_model(seed=0, hidden=16)
    x, y = data(f"topk-step-{mode}", rank)
    x, y = tf.constant(x), tf.constant(y)
    compression = hvd.Compression.topk(0.1, selection="exact")

    def step(x, y, distributed):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        if distributed:
            tape = hvd_tf.DistributedGradientTape(tape, compression=compression)
        return tape.gradient(loss, model.trainable_variables)

    run = step if mode == "eager" else tf.function(step)
    reduced = [g.numpy() for g in run(x, y, True)]
    local = [g.numpy() for g in run(x, y, False)]
    everyone = hvd.allgather_object(local)
    for i, out in enumerate(reduced):
        decompressed = [topk_reference(everyone[r][i], 0.1) for r in range(size)]
        expected = np.mean(decompressed, axis=0)
        assert np.count_nonzero(decompressed[rank]) == max(1, int(out.size * 0.1))
        np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7, err_msg=f"gradient {i}")
    assert compression.stats.exchanges == len(reduced)


def test_powersgd_tape_steps_equal_numpy_reference():
    from powersgd_reference import Reference

    size, rank = hvd.size(), hvd.rank()
    model = make_model(seed=0, hidden=32)
    compression = hvd.Compression.powersgd(rank=1, start_iter=1, min_compression_rate=1)
    refs = None
    for step in range(3):
        x, y = (tf.constant(a) for a in data(f"powersgd-{step}", rank))
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        local_tape = tape
        tape = hvd_tf.DistributedGradientTape(local_tape, compression=compression)
        with tf.GradientTape() as again:
            loss_again = tf.reduce_mean(tf.square(model(x) - y))
        local = [g.numpy() for g in again.gradient(loss_again, model.trainable_variables)]
        reduced = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
        everyone = hvd.allgather_object(local)
        names = list(compression.state.steps)  # the labels the tape gave the gradients, in order
        if refs is None:
            refs = [Reference(n, size, 1, start_iter=1, dense=len(v.shape) < 2)
                    for n, v in zip(names, model.trainable_variables)]
        for i, out in enumerate(reduced):
            expected = refs[i].step([everyone[r][i] for r in range(size)])
            np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5 * np.abs(expected).max(),
                                       err_msg=f"gradient {i} step {step}")
    assert_identical_across_ranks(np.concatenate([g.ravel() for g in reduced]), "powersgd gradients")
    assert len(compression.state.qs) == 2 and compression.stats.ratio > 1


def test_bad_compression_arguments():
    opt = keras.optimizers.SGD(0.1)
    for bad in ("topk", 3, object()):
        with pytest.raises(TypeError, match="Compression"):
            hvd_tf.DistributedGradientTape(tf.GradientTape(), compression=bad)
        with pytest.raises(TypeError, match="Compression"):
            hvd.DistributedOptimizer(opt, compression=bad)
    with pytest.raises(ValueError, match="Average or Sum"):
        hvd_tf.DistributedGradientTape(tf.GradientTape(), compression=hvd.Compression.topk(0.1), op=hvd.Max)
    with pytest.raises(ValueError, match="density"):
        hvd.Compression.topk(1.5)
    with pytest.raises(ValueError, match="not a summable"):
        hvd_tf.allreduce(tf.ones(3), compression=hvd.Compression.int8)
