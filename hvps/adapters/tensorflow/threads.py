"""Per-rank TensorFlow thread pools, so ranks sharing a node do not oversubscribe its cores."""

from __future__ import annotations

import os

import tensorflow as tf

#: TensorFlow's inter-op threads when nobody chose a number (see ``ensure_inter_op_threads``)
INTER_OP_FLOOR = 64


def set_threads(threads_per_rank: int) -> None:
    """Give TensorFlow ``threads_per_rank`` intra-op and inter-op threads.

    Call it before TensorFlow runs its first op (the pools are created then);
    afterwards TensorFlow refuses and this raises RuntimeError. With one inter-op thread the
    gradient buckets of a ``tf.function`` start only after the whole backward pass (hvps warns once);
    ``tf.config.threading.set_inter_op_parallelism_threads(2)`` after it (still before the first op) lets
    them overlap it.

    Args:
        threads_per_rank: threads of each pool, at least 1.

    Raises:
        ValueError: ``threads_per_rank`` below 1.
        RuntimeError: TensorFlow has already created its pools.
    """
    if threads_per_rank < 1:
        raise ValueError("threads_per_rank must be >= 1")
    tf.config.threading.set_intra_op_parallelism_threads(threads_per_rank)
    tf.config.threading.set_inter_op_parallelism_threads(threads_per_rank)


def chosen_inter_op_threads() -> int:
    """The inter-op threads the user chose.

    Returns:
        TensorFlow's setting (``set_threads``, ``tf.config.threading``), else ``TF_NUM_INTEROP_THREADS``'s
        number; 0 when neither chose one (TensorFlow's default: one per core).
    """
    configured = tf.config.threading.get_inter_op_parallelism_threads()
    if configured:
        return configured
    value = os.environ.get("TF_NUM_INTEROP_THREADS", "").strip()
    return int(value) if value.isdigit() else 0


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
