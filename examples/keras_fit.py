"""Data-parallel Keras 3 ``model.fit`` with hvps's callbacks, on MNIST-like synthetic digits.

What it shows: ``hvd.init()``, each rank fitting its own shard of the data, ``hvd.DistributedOptimizer``
averaging the gradients, and hvps's Keras callbacks: ``BroadcastGlobalVariablesCallback`` (every rank
starts from rank 0's weights), ``MetricAverageCallback`` (the logged metrics are the mean over ranks),
``LearningRateWarmupCallback`` (the scaled learning rate is reached gradually) and ``CheckpointCallback``
(a versioned HDF5 checkpoint each epoch, which ``--resume`` continues from). Only rank 0 logs.

Launch it from the repository root with::

    hvpsrun -np 2 python examples/keras_fit.py --epochs 3
    mpirun -np 2 python examples/keras_fit.py
    python examples/keras_fit.py                 # one process

Keras runs on TensorFlow here (``KERAS_BACKEND=tensorflow``, Keras's default).
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported: no start-up chatter

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvps.adapters.tensorflow.keras as hvd  # noqa: E402

IMAGE_SIDE, CLASSES = 28, 10


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Read the command line.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The parsed flags.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3, help="epochs to train in all (a resumed run counts the "
                        "epochs already done)")
    parser.add_argument("--samples", type=int, default=1024, help="size of the synthetic training set")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step on each rank")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate of one rank; the job warms up to lr * number of ranks")
    parser.add_argument("--warmup-epochs", type=int, default=1, help="epochs of learning-rate warm-up")
    parser.add_argument("--checkpoint-dir", default="checkpoints/keras_fit",
                        help="directory of the versioned checkpoints (rank 0 writes it)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest good checkpoint in --checkpoint-dir (if any)")
    parser.add_argument("--cuda", action="store_true", help="train on the GPU of this rank's local rank")
    parser.add_argument("--seed", type=int, default=42, help="seed of the data and the model's initial weights")
    return parser.parse_args(argv)


def pin_device(use_cuda: bool) -> None:
    """Give TensorFlow this rank's GPU (by local rank) with ``--cuda``, no GPU otherwise.

    Args:
        use_cuda: whether ``--cuda`` was given.

    Raises:
        SystemExit: ``--cuda`` was given but TensorFlow sees no GPU.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if not use_cuda:
        tf.config.set_visible_devices([], "GPU")
        return
    if not gpus:
        raise SystemExit("--cuda was given but TensorFlow sees no GPU; leave --cuda out to train on the CPU")
    gpu = gpus[hvd.local_rank() % len(gpus)]
    tf.config.experimental.set_memory_growth(gpu, True)
    tf.config.set_visible_devices(gpu, "GPU")


def synthetic_digits(samples: int, seed: int) -> tuple:
    """MNIST-shaped data: 28x28 images of 10 classes, each a fixed random pattern plus noise.

    Args:
        samples: how many images.
        seed: the generator's seed (the same on every rank, so that every rank sees the same dataset).

    Returns:
        (images [samples, 28, 28] float32, labels [samples] int32).
    """
    rng = np.random.default_rng(seed)
    patterns = rng.random((CLASSES, IMAGE_SIDE, IMAGE_SIDE), dtype=np.float32)
    labels = rng.integers(0, CLASSES, samples).astype(np.int32)
    noise = rng.standard_normal((samples, IMAGE_SIDE, IMAGE_SIDE)).astype(np.float32)
    return patterns[labels] + noise, labels


class RankZeroLog(keras.callbacks.Callback):
    """Prints one line per epoch on rank 0 (put it after ``MetricAverageCallback``: it prints the means)."""

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if hvd.rank() == 0:
            logs = logs or {}
            lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
            print(f"epoch {epoch}: loss {logs.get('loss', float('nan')):.4f} "
                  f"accuracy {logs.get('accuracy', float('nan')):.3f} lr {lr:.4g}", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Fit, checkpoint every epoch, and print rank 0's log.

    Args:
        argv: the command line's arguments (default: ``sys.argv[1:]``).
    """
    args = parse_args(argv)
    hvd.init()
    pin_device(args.cuda)
    keras.utils.set_random_seed(args.seed + hvd.rank())  # different on purpose: the broadcast makes them equal

    images, labels = synthetic_digits(args.samples, args.seed)
    images, labels = images[hvd.rank()::hvd.size()], labels[hvd.rank()::hvd.size()]  # this rank's shard
    steps_per_epoch = -(-len(images) // args.batch_size)

    model = keras.Sequential([keras.Input((IMAGE_SIDE, IMAGE_SIDE)), keras.layers.Flatten(),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(CLASSES)])
    scaled_lr = args.lr * hvd.size()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(scaled_lr, momentum=0.9))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    checkpoint = hvd.callbacks.CheckpointCallback(args.checkpoint_dir, keep_last=3)
    initial_epoch = 0
    if args.resume:  # collective: rank 0 reads the newest good version, every rank gets it
        model.optimizer.build(model.trainable_variables)
        initial_epoch = checkpoint.restore(model)
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=args.warmup_epochs,
                                                 steps_per_epoch=steps_per_epoch, momentum_correction=False),
        RankZeroLog(),
        checkpoint,  # after MetricAverageCallback: the saved logs are the averaged ones
    ]
    if hvd.rank() == 0:
        where = f"resuming at epoch {initial_epoch}" if initial_epoch else "starting from scratch"
        print(f"keras_fit: {hvd.size()} rank(s), {where}, {len(images)} samples per rank, "
              f"lr warms up to {scaled_lr:g}", flush=True)
    model.fit(images, labels, batch_size=args.batch_size, epochs=args.epochs, initial_epoch=initial_epoch,
              callbacks=callbacks, verbose=0)
    if hvd.rank() == 0:
        print(f"done: {args.epochs} epoch(s) trained, newest checkpoint in {args.checkpoint_dir}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
