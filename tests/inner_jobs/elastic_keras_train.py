"""Run by tests/test_elastic_launch.py under hvpsrun's elastic mode: a Keras 3 custom training loop (a
``tf.function`` step: GradientTape, then the Keras ``hvd.DistributedOptimizer``'s ``apply``) in
``hvd.elastic.run`` with a ``TensorFlowKerasState``, killed in the middle of a step.

The model is exact in float64, as ``elastic_train.py``'s is (dyadic data, weights and learning rate, a
Sum allreduce of each rank's share of a global batch of 8): the final weights are bit-exact those of
:func:`reference` (plain numpy, no TensorFlow) when every step is applied once. ``HVPS_TF_BUCKET_BYTES=0``
gives the kernel and the bias a gradient bucket each, started while the backward runs.

``VICTIM=r KILL_AT=epoch`` (at the job size ``KILL_SIZE``): in batch 1 of that epoch rank r dies
(SIGKILL) inside the ``tf.function`` step, after the backward and before ``apply``; the survivors' step
starts both buckets, and the first finish fails: the restore finds the second bucket still registered.
"""

import json
import os
import signal
import sys

import numpy as np

EPOCHS, BATCHES, GLOBAL_BATCH, LR, MOMENTUM = 4, 3, 8, 2.0 ** -4, 0.5


def batch_data(epoch: int, batch: int) -> np.ndarray:
    return np.random.default_rng(1000 * epoch + batch).integers(-4, 5, (GLOBAL_BATCH, 4)).astype(np.float64)


def initial() -> tuple:
    rng = np.random.default_rng(7)
    return np.round(rng.uniform(-1, 1, (4, 1)) * 64) / 64, np.round(rng.uniform(-1, 1, (1,)) * 64) / 64


def reference() -> list:
    """The uninterrupted run: SGD with momentum on the whole global batch, loss = sum of the outputs."""
    kernel, bias = initial()
    velocity = [np.zeros_like(kernel), np.zeros_like(bias)]
    for epoch in range(EPOCHS):
        for batch in range(BATCHES):
            x = batch_data(epoch, batch)
            grads = [x.sum(axis=0).reshape(4, 1), np.array([float(GLOBAL_BATCH)])]
            for i, (param, grad) in enumerate(zip((kernel, bias), grads)):
                velocity[i] = MOMENTUM * velocity[i] - LR * grad
                param += velocity[i]
    return [kernel.ravel().tolist(), bias.ravel().tolist()]


def main() -> None:
    import keras
    import tensorflow as tf

    import hvps.adapters.tensorflow.keras as hvd

    from hvps.adapters.tensorflow import overlap
    from hvps.runtime.bootstrap import elastic_session

    hvd.init()
    start_rank = hvd.rank()
    keras.config.set_floatx("float64")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.set_weights(list(initial()))
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=MOMENTUM), op=hvd.Sum)
    optimizer.build(model.trainable_variables)
    class State(hvd.elastic.TensorFlowKerasState):
        def restore(self) -> None:
            """Says how many gradient buckets the interrupted step left registered, and the restore."""
            before = overlap.pending_count()
            super().restore()
            after = overlap.pending_count()
            print(json.dumps({"restored": hvd.rank(), "buckets_before": before, "buckets_after": after}), flush=True)

    state = State(model, optimizer, epoch=0, batch=0)
    victim, kill_at, kill_size = (int(os.environ.get(k, "-1")) for k in ("VICTIM", "KILL_AT", "KILL_SIZE"))

    def die() -> np.ndarray:
        print(json.dumps({"failing": hvd.rank()}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        return np.zeros((), np.int32)

    @tf.function
    def step(x, doomed):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        if doomed:  # a Python bool: traced apart
            tf.numpy_function(die, [], tf.int32)
        optimizer.apply(grads, model.trainable_variables)

    @hvd.elastic.run
    def train(state):
        while state.epoch < EPOCHS:
            while state.batch < BATCHES:
                doomed = (hvd.rank() == victim and state.epoch == kill_at and state.batch == 1
                          and hvd.size() == kill_size)
                step(tf.constant(batch_data(state.epoch, state.batch)[hvd.rank()::hvd.size()]), doomed)
                state.batch += 1
                state.commit()
            print(json.dumps({"epoch": state.epoch, "rank": hvd.rank(), "size": hvd.size(), "start_rank": start_rank,
                              "host": os.environ.get("HOROVOD_HOSTNAME"), "rendezvous": elastic_session.round}),
                  flush=True)
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()

    train(state)
    if hvd.rank() == 0:
        with open(os.path.join(os.environ["OUT_DIR"], "final.json"), "w") as f:
            json.dump([w.ravel().tolist() for w in model.get_weights()], f)
    hvd.shutdown()


if __name__ == "__main__":
    if sys.argv[1:] == ["reference"]:
        print(json.dumps(reference()))
    else:
        main()
