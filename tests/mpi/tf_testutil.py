"""Helpers shared by the inner TensorFlow/Keras multi-rank tests (imports TensorFlow)."""

import keras
import numpy as np
from hvps_testutil import random_array

import hvps.adapters.tensorflow.keras as hvd


def make_model(seed, hidden=8):
    """A small MLP (4 -> hidden -> 2) with weights fixed by ``seed``."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(hidden, activation="tanh"),
                             keras.layers.Dense(2)])


def data(key, rank, n=8):
    """Rank ``rank``'s reproducible batch of ``n`` samples for test ``key``."""
    return random_array(np.float32, (n, 4), f"{key}-x", rank), random_array(np.float32, (n, 2), f"{key}-y", rank)


def flat_weights(model):
    return np.concatenate([np.asarray(v.numpy()).ravel() for v in model.weights])


def assert_identical_across_ranks(array, what):
    everyone = hvd.allgather_object(np.asarray(array))
    for r, other in enumerate(everyone):
        assert np.array_equal(other, everyone[0]), f"{what}: rank {r} differs from rank 0"
