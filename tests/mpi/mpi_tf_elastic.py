"""Inner test: ``hvd.elastic`` for TensorFlow 2 and Keras 3 on every rank of a real job (2 and 3 ranks).

The Keras state (model and optimizer variables) is synced from rank 0, restored bit-exactly, and
kept through a real reset (``hvps.shutdown()`` then ``hvps.init()``) after a real failed collective
in elastic mode (``HVPS_ELASTIC=1``, set per test); ``model.fit`` drives a state through Horovod's
three callbacks.
"""

import zlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import hvps
import hvps.adapters.tensorflow.keras as hvd

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _initialized():
    hvps.init()
    yield


def _rng(key):
    return np.random.default_rng(zlib.crc32(f"{key}#{hvps.rank()}".encode()))


def _model(key):
    """A built model with different weights on every rank, and an Adam that has taken one step."""
    keras.utils.set_random_seed(zlib.crc32(f"{key}#{hvps.rank()}".encode()) % (1 << 31))
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    _step(model, key + "-warm")
    return model


def _step(model, key):
    rng = _rng(key)
    x, y = rng.standard_normal((8, 5)).astype(np.float32), rng.standard_normal((8, 2)).astype(np.float32)
    model.train_on_batch(x, y)


def _values(state):
    return [np.array(v.numpy()) for v in list(state.model.variables) + list(state.optimizer.variables)]


def _same_everywhere(values):
    flat = np.concatenate([v.astype(np.float64).ravel() for v in values])
    for other in hvps.allgather_object(flat):
        np.testing.assert_array_equal(other, flat)


def test_sync_makes_every_rank_rank_zeros_and_restore_is_exact():
    state = hvd.elastic.KerasState(_model("sync"), epoch=hvps.rank())
    state.sync()
    _same_everywhere(_values(state))
    assert state.epoch == 0  # plain attributes come from rank 0 too
    committed = _values(state)
    _step(state.model, "sync-lost")  # the ranks diverge, and nothing is committed
    assert any(not np.array_equal(a, b) for a, b in zip(committed, _values(state)))
    state.restore()
    for a, b in zip(committed, _values(state)):
        np.testing.assert_array_equal(a, b)


def test_elastic_mode_restores_the_commit_and_retries_after_a_failed_collective(monkeypatch):
    monkeypatch.setenv("HVPS_ELASTIC", "1")
    state = hvd.elastic.TensorFlowKerasState(_model("retry"), batch=0, epoch=0)
    tries, committed = [], []

    @hvd.elastic.run
    def train(state):
        tries.append(_values(state))
        if len(tries) == 1:
            _step(state.model, "retry-1")
            state.epoch = 5
            state.commit()
            committed.append(_values(state))
            _step(state.model, "retry-2")  # lost: not committed
            state.epoch = 6
            hvd.allreduce(tf.ones(3 if hvps.rank() == 0 else 2), name="elastic.tf_fail")  # every rank raises
        return state.epoch

    assert train(state) == 5 and len(tries) == 2
    if hvps.rank() == 0:  # the second try starts from the commit, restored bit-exactly, then synced
        for a, b in zip(committed[0], tries[1]):
            np.testing.assert_array_equal(a, b)
    _same_everywhere(tries[1])
    assert hvps.is_initialized() and hvps.allreduce(np.ones(2), op=hvps.Sum).tolist() == [hvps.size()] * 2


def test_keras_callbacks_keep_the_state_up_to_date_during_fit():
    model = _model("fit")
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    state.sync()
    rng = _rng("fit-data")
    x, y = rng.standard_normal((24, 5)).astype(np.float32), rng.standard_normal((24, 2)).astype(np.float32)
    # the updates before the commit, so that the commit at an epoch's end holds the new epoch and batch
    callbacks = [hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=2)]
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callbacks)
    assert (state.epoch, state.batch) == (2, 0)  # two epochs finished
    at_the_end = _values(state)
    _step(model, "fit-lost")
    state.epoch, state.batch = 9, 9
    state.restore()  # the commit at the last epoch's end holds the weights and counters fit ended with
    assert (state.epoch, state.batch) == (2, 0)
    for a, b in zip(at_the_end, _values(state)):
        np.testing.assert_array_equal(a, b)
    # resumed at the committed epoch, both ways, for 4 in all: each epoch counted once
    model.fit(x, y, batch_size=8, epochs=4 - state.epoch, verbose=0, callbacks=callbacks)  # Horovod's
    assert state.epoch == 4
    state.epoch = 2
    model.fit(x, y, batch_size=8, initial_epoch=state.epoch, epochs=4, verbose=0, callbacks=callbacks)  # Keras's
    assert state.epoch == 4


def test_tensorflow_state_syncs_and_restores_plain_variables():
    variables = [tf.Variable(_rng("vars").standard_normal((3, 2)).astype(np.float32)), tf.Variable(hvps.rank() + 1.0)]
    state = hvd.elastic.TensorFlowState(variables=variables, step=hvps.rank())
    state.sync()
    assert float(variables[1].numpy()) == 1.0 and state.step == 0
    _same_everywhere([np.array(v.numpy()) for v in variables])
    saved = [np.array(v.numpy()) for v in variables]
    variables[0].assign_add(tf.ones((3, 2)))
    state.restore()
    np.testing.assert_array_equal(variables[0].numpy(), saved[0])


def test_bad_states_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match="needs a Keras model"):
        hvd.elastic.KerasState(None)
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="must be built first"):
        hvd.elastic.KerasState(unbuilt)
    with pytest.raises(ValueError, match="needs variables="):
        hvd.elastic.TensorFlowState()
    with pytest.raises(TypeError, match="needs an elastic state"):
        hvd.elastic.CommitStateCallback(object())


def test_a_step_lost_to_a_failure_leaves_no_trace_of_its_error_feedback(monkeypatch):
    """Top-k with error feedback: a step that ran (its residuals updated) and then was lost to a failed
    collective before the commit is undone entirely by the restore, residuals included, so the run is
    bit-exact the uninterrupted one (kept, the lost step's residual would be sent once more)."""
    monkeypatch.setenv("HVPS_ELASTIC", "1")

    def build():
        keras.utils.set_random_seed(5)  # the same start on every rank
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(2)])
        optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hvd.Compression.topk(0.5))
        optimizer.build(model.trainable_variables)
        return model, optimizer

    def step(model, optimizer, key):
        x = tf.constant(_rng(key).standard_normal((8, 5)).astype(np.float32))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    model, optimizer = build()
    for key in ("a", "b", "c"):
        step(model, optimizer, key)
    expected = [np.array(v.numpy()) for v in model.variables]

    model, optimizer = build()
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, done=0)
    tries = []

    @hvd.elastic.run
    def train(state):
        tries.append(state.done)
        for key in ("a", "b", "c")[state.done:]:
            step(model, optimizer, key)
            if key == "b" and len(tries) == 1:  # lost before its commit, once
                hvd.allreduce(tf.ones(3 if hvps.rank() == 0 else 2), name="elastic.tf_lost_step")
            state.done += 1
            state.commit()

    train(state)
    assert tries == [0, 1]
    for a, b in zip(expected, model.variables):
        np.testing.assert_array_equal(a, b.numpy())
