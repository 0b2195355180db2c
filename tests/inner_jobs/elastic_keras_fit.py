"""Run by tests/test_elastic_launch.py under hvpsrun's elastic mode: Horovod's elastic Keras pattern.

``model.fit`` inside ``@hvd.elastic.run``, driven by ``KerasState`` and Horovod's three callbacks,
on a small separable classification task (each rank its shard of every epoch, a learning rate scaled
by ``hvd.size()`` in a reset callback). ``VICTIM=r KILL_AT=epoch,batch``: rank r kills itself
(SIGKILL) at that batch, once per job. ``SHARD=1``: the optimizer is sharded (``shard=True``), so a
lost rank's shard of the momentum is rebuilt from a neighbour's copy and the survivors re-shard. Rank 0
prints the final accuracy on the whole dataset as JSON, with the sizes the job trained at.
"""

import json
import os
import signal

import keras
import numpy as np

import hvps.adapters.tensorflow.keras as hvd

EPOCHS, BATCH, SAMPLES, LR, MOMENTUM = 5, 16, 768, 0.05, 0.5


def dataset():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((SAMPLES, 8)).astype(np.float32)
    y = (x @ rng.standard_normal(8) > 0).astype(np.int32)
    return x, y


class KillOnce(keras.callbacks.Callback):
    """Kills this process at (epoch, batch) when it is the victim rank, once per job (a marker file)."""

    def __init__(self, state, marker):
        super().__init__()
        self.state, self.marker = state, marker
        self.victim = int(os.environ.get("VICTIM", "-1"))
        self.at = tuple(int(v) for v in os.environ.get("KILL_AT", "-1,-1").split(","))

    def on_train_batch_end(self, batch, logs=None):
        if hvd.rank() == self.victim and (self.state.epoch, batch) == self.at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    hvd.init()
    keras.utils.set_random_seed(3)
    x, y = dataset()
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(2)])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(LR * hvd.size(), momentum=MOMENTUM),
                                         shard=os.environ.get("SHARD") == "1")
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    sizes = []

    def on_reset():
        model.optimizer.learning_rate.assign(LR * hvd.size())

    state.register_reset_callbacks([on_reset])
    callbacks = [hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=4),
                 KillOnce(state, os.path.join(os.environ["OUT_DIR"], "killed"))]

    @hvd.elastic.run
    def train(state):
        sizes.append(hvd.size())
        shard = slice(hvd.rank(), None, hvd.size())
        model.fit(x[shard], y[shard], batch_size=BATCH, epochs=EPOCHS - state.epoch, shuffle=False, verbose=0,
                  callbacks=callbacks)  # Horovod's pattern: Keras counts from 0, the callback from state.epoch

    train(state)
    _, accuracy = model.evaluate(x, y, verbose=0)
    if hvd.rank() == 0:
        print(json.dumps({"accuracy": float(accuracy), "sizes": sizes, "epoch": state.epoch}), flush=True)


if __name__ == "__main__":
    main()
