"""Elastic Keras 3 ``model.fit`` with hvps: the job keeps going when workers join, leave or fail.

What it shows: Horovod's elastic Keras pattern. ``hvd.elastic.KerasState`` holds the model, its
optimizer and the epoch; three callbacks keep it current (``UpdateBatchStateCallback``,
``UpdateEpochStateCallback``) and commit it in memory every few batches (``CommitStateCallback``);
``@hvd.elastic.run`` catches a membership change or a failed rank, re-initializes hvps with the new
ranks, restores the last commit, broadcasts it from rank 0 and calls ``fit`` again from the committed
epoch. Each call fits this rank's shard for the current number of ranks, and a reset callback
rescales the learning rate.

Launch it from the repository root under hvpsrun's elastic mode (no MPI needed)::

    hvpsrun -np 2 --min-np 1 --max-np 3 --host-discovery-script examples/discover_hosts.sh \\
        python examples/keras_elastic.py --epochs 3

``examples/discover_hosts.sh`` prints ``localhost:2``, or the lines of the file named by
``EXAMPLE_HOSTS_FILE``: edit that file while the job runs and the job grows or shrinks at its next
commit. Under plain ``hvpsrun -np 2`` or ``mpirun`` it runs as a fixed job.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported: no start-up chatter

import keras  # noqa: E402
import numpy as np  # noqa: E402

import hvps.adapters.tensorflow.keras as hvd  # noqa: E402

FEATURES, CLASSES = 64, 4


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Read the command line.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The parsed flags.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3, help="epochs to train")
    parser.add_argument("--samples", type=int, default=512,
                        help="size of the synthetic training set (split over however many ranks there are)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step on each rank")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate of one rank; the job uses lr * current number of ranks")
    parser.add_argument("--batches-per-commit", type=int, default=2,
                        help="commit the state (in memory) every this many batches; a failure loses at most "
                        "the steps since the last commit")
    parser.add_argument("--seed", type=int, default=7, help="seed of the data and the initial weights")
    return parser.parse_args(argv)


def synthetic_classes(samples: int, seed: int) -> tuple:
    """Points around 4 random centres in 64 dimensions, labelled by their centre.

    Args:
        samples: how many points.
        seed: the generator's seed (the same on every rank).

    Returns:
        (features [samples, 64] float32, labels [samples] int32).
    """
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((CLASSES, FEATURES)).astype(np.float32)
    labels = rng.integers(0, CLASSES, samples).astype(np.int32)
    return centres[labels] + 2.0 * rng.standard_normal((samples, FEATURES)).astype(np.float32), labels


class RankZeroLog(keras.callbacks.Callback):
    """Prints one line per epoch on rank 0 (put it after ``MetricAverageCallback``: it prints the means)."""

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if hvd.rank() == 0:
            logs = logs or {}
            print(f"epoch {epoch}: loss {logs.get('loss', float('nan')):.4f} "
                  f"accuracy {logs.get('accuracy', float('nan')):.3f} on {hvd.size()} rank(s)", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Fit under ``hvd.elastic.run`` and print rank 0's log.

    Args:
        argv: the command line's arguments (default: ``sys.argv[1:]``).
    """
    args = parse_args(argv)
    hvd.init()  # once, at the top: a worker that joins later runs the script from here
    keras.utils.set_random_seed(args.seed)
    features, labels = synthetic_classes(args.samples, args.seed)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(CLASSES)])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    # no broadcast callback: state.sync() broadcasts the model and optimizer from rank 0 when train() starts
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    def on_reset() -> None:
        """After every membership change: the learning rate follows the number of ranks."""
        model.optimizer.learning_rate.assign(args.lr * hvd.size())
        if hvd.rank() == 0:
            print(f"reset: now {hvd.size()} rank(s), lr {args.lr * hvd.size():g}", flush=True)

    state.register_reset_callbacks([on_reset])
    callbacks = [hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=args.batches_per_commit),
                 hvd.callbacks.MetricAverageCallback(), RankZeroLog()]

    @hvd.elastic.run
    def train(state: hvd.elastic.KerasState) -> None:
        """``fit`` from the committed epoch on this rank's shard, called again after each reset."""
        if hvd.rank() == 0:
            print(f"training on {hvd.size()} rank(s) from epoch {state.epoch}", flush=True)
        shard = slice(hvd.rank(), None, hvd.size())
        model.fit(features[shard], labels[shard], batch_size=args.batch_size, initial_epoch=state.epoch,
                  epochs=args.epochs, callbacks=callbacks, verbose=0)

    train(state)
    if hvd.rank() == 0:
        print(f"done: {args.epochs} epoch(s) trained, ending on {hvd.size()} rank(s)", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
