"""Moving tf.Tensors to the numpy buffers the core works on, eagerly or inside ``tf.function``.

Eagerly, a collective calls the core directly on ``tensor.numpy()``. Inside a
graph (``tf.function``, ``model.fit``), it becomes one ``tf.numpy_function``
op: a stateful op, so TensorFlow's automatic control dependencies run every
collective of a function in program order, which is what keeps the ranks'
submission orders (and therefore the core's negotiated names) identical.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

#: TensorFlow dtypes the core can move (bfloat16 numpy arrays are ml_dtypes', as the core's).
SUPPORTED = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.int16, tf.int32, tf.int64, tf.uint8,
             tf.bool)


def check_dtype(tensor: Any, what: str = "tensor") -> None:
    """Raise TypeError for tensors the core cannot move (strings, complex, uint16, ...)."""
    dtype = tensor.dtype
    if dtype not in SUPPORTED:
        names = ", ".join(d.name for d in SUPPORTED)
        raise TypeError(f"hvps cannot move {what} of dtype {dtype.name}; supported: {names}")


def as_tensor(value: Any) -> tf.Tensor:
    """``value`` as a dense tf.Tensor (IndexedSlices and Variables are converted)."""
    if isinstance(value, tf.Tensor):
        return value
    return tf.convert_to_tensor(value)


class _CommClock:
    """Seconds spent inside the core's collectives called from TensorFlow (eager or graph), this process."""

    seconds = 0.0


comm_clock = _CommClock()


def _timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*arrays):
        start = time.perf_counter()
        try:
            return [np.asarray(r) for r in fn(*arrays)]
        finally:
            comm_clock.seconds += time.perf_counter() - start
    return timed


def run(fn: Callable[..., Any], inputs: Sequence[tf.Tensor], out_dtypes: Sequence[tf.DType],
        name: str = "hvps") -> list:
    """Run ``fn(*numpy_arrays) -> list of numpy arrays`` on ``inputs``; return tensors.

    Eagerly ``fn`` runs at once; in a graph it runs as one stateful
    ``tf.numpy_function`` (ordered with the function's other stateful ops).
    The outputs' static shapes are the caller's job (``set_shape``).
    """
    fn = _timed(fn)
    if tf.executing_eagerly():
        results = fn(*[t.numpy() for t in inputs])
        return [tf.convert_to_tensor(r, dtype=d) for r, d in zip(results, out_dtypes)]
    outs = tf.numpy_function(fn, list(inputs),
                             list(out_dtypes), stateful=True, name=name)
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]
