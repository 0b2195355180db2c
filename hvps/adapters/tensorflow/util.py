"""``horovod.tensorflow.util``'s helper that scripts (and Horovod's own tests) call on the module."""

import tensorflow as tf


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs eagerly here (False while building a graph or tracing a ``tf.function``)."""
    return tf.executing_eagerly()
