"""A TensorFlow 2 custom training loop with hvps: ``tf.GradientTape`` wrapped in ``hvd.DistributedGradientTape``.

What it shows: ``hvd.init()``, each rank reading its own shard of a ``tf.data`` pipeline, a
``tf.function`` training step whose gradients ``hvd.DistributedGradientTape`` averages over the
ranks, the model's and the optimizer's variables broadcast from rank 0 before the first step, and the
loss averaged over ranks for rank 0's log.

Launch it from the repository root with::

    hvpsrun -np 2 python examples/tf_gradient_tape.py --steps 20
    mpirun -np 2 python examples/tf_gradient_tape.py
    python examples/tf_gradient_tape.py          # one process
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported: no start-up chatter

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvps.adapters.tensorflow as hvd  # noqa: E402

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
    parser.add_argument("--steps", type=int, default=100, help="training steps (on every rank)")
    parser.add_argument("--log-every", type=int, default=5, help="rank 0 logs the averaged loss every this many steps")
    parser.add_argument("--samples", type=int, default=1024, help="size of the synthetic training set")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step on each rank")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate of one rank; the job uses lr * number of ranks")
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


def synthetic_digits(samples: int, seed: int) -> tf.data.Dataset:
    """MNIST-shaped data: 28x28 images of 10 classes, each a fixed random pattern plus noise.

    Args:
        samples: how many images.
        seed: the generator's seed (the same on every rank, so that every rank sees the same dataset).

    Returns:
        A dataset of (image, label) pairs.
    """
    rng = np.random.default_rng(seed)
    patterns = rng.random((CLASSES, IMAGE_SIDE, IMAGE_SIDE), dtype=np.float32)
    labels = rng.integers(0, CLASSES, samples).astype(np.int32)
    noise = rng.standard_normal((samples, IMAGE_SIDE, IMAGE_SIDE)).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((patterns[labels] + noise, labels))


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Train for ``--steps`` steps and print rank 0's log.

    Args:
        argv: the command line's arguments (default: ``sys.argv[1:]``).
    """
    args = parse_args(argv)
    hvd.init()
    pin_device(args.cuda)
    keras.utils.set_random_seed(args.seed + hvd.rank())  # different on purpose: the broadcast makes them equal

    batches = (synthetic_digits(args.samples, args.seed)
               .shard(hvd.size(), hvd.rank())  # this rank's part of the data
               .repeat().shuffle(256, seed=args.seed).batch(args.batch_size))
    model = keras.Sequential([keras.Input((IMAGE_SIDE, IMAGE_SIDE)), keras.layers.Flatten(),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(CLASSES)])
    optimizer = keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)
    optimizer.build(model.trainable_variables)  # its variables exist now, so they can be broadcast
    hvd.broadcast_variables(model.variables + list(optimizer.variables), root_rank=0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def training_step(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)  # gradient() returns the average over all ranks
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    if hvd.rank() == 0:
        print(f"tf_gradient_tape: {hvd.size()} rank(s), {args.steps} steps of {args.batch_size} samples per rank, "
              f"lr {args.lr * hvd.size():g}", flush=True)
    running = []
    for step, (images, labels) in enumerate(batches.take(args.steps)):
        running.append(float(training_step(images, labels)))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            mean_loss = hvd.allreduce(tf.constant(np.mean(running)), op=hvd.Average, name="logged_loss")
            running = []
            if hvd.rank() == 0:
                print(f"step {step + 1}: loss {float(mean_loss):.4f}", flush=True)
    if hvd.rank() == 0:
        print(f"done: {args.steps} steps trained", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
