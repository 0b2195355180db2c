"""Per-rank TensorFlow thread pools, so ranks sharing a node do not oversubscribe its cores."""

from __future__ import annotations

import tensorflow as tf


def set_threads(threads_per_rank: int) -> None:
    """Give TensorFlow ``threads_per_rank`` intra-op and inter-op threads.

    Call it before TensorFlow runs its first op (the pools are created then);
    afterwards TensorFlow refuses and this raises RuntimeError.
    """
    if threads_per_rank < 1:
        raise ValueError("threads_per_rank must be >= 1")
    tf.config.threading.set_intra_op_parallelism_threads(threads_per_rank)
    tf.config.threading.set_inter_op_parallelism_threads(threads_per_rank)
