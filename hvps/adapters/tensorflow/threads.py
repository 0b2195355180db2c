"""Per-rank TensorFlow thread pools, so ranks sharing a node do not oversubscribe its cores."""

from __future__ import annotations

import os

import tensorflow as tf

#: TensorFlow's inter-op threads when nobody chose a number (see ``ensure_inter_op_threads``)
INTER_OP_FLOOR = 64


def set_threads(threads_per_rank: int) -> None:
    """Give TensorFlow ``threads_per_rank`` intra-op and inter-op threads.

    Call it before TensorFlow runs its first op (the pools are created then);
    afterwards TensorFlow refuses and this raises RuntimeError.
    """
    if threads_per_rank < 1:
        raise ValueError("threads_per_rank must be >= 1")
    tf.config.threading.set_intra_op_parallelism_threads(threads_per_rank)
    tf.config.threading.set_inter_op_parallelism_threads(threads_per_rank)


def ensure_inter_op_threads() -> None:
    """Give TensorFlow at least ``INTER_OP_FLOOR`` inter-op threads, unless the user chose a number.

    In a graph (a TF1 session, a ``tf.function``) each hvps collective runs as an op that holds one
    of those threads until every rank has submitted it. TensorFlow picks among ready ops in an order
    of its own, different on each rank: with few threads (one per core by default), each rank can
    fill them with collectives the others have not reached, and all wait for the stall check.
    Idle threads cost nothing; ``set_threads`` (or TF_NUM_INTEROP_THREADS) still decides.
    """
    if os.environ.get("TF_NUM_INTEROP_THREADS") or tf.config.threading.get_inter_op_parallelism_threads():
        return
    try:
        tf.config.threading.set_inter_op_parallelism_threads(INTER_OP_FLOOR)
    except RuntimeError:  # TensorFlow has started: its pools are made
        pass
