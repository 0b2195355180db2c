"""Moving tf.Tensors to the numpy buffers the core works on, eagerly or inside ``tf.function``.

Eagerly, a collective calls the core directly on ``tensor.numpy()``. Inside a
graph (``tf.function``, ``model.fit``, a TF1 session), it becomes one stateful
``tf.numpy_function`` op, whose unnamed collectives are named after the op (see :func:`run`).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from hvps.api import collectives
from hvps.api.collectives import names_from
from hvps.core.errors import HvpsError

def _exclude_from_autograph() -> None:
    """Keep AutoGraph from rewriting hvps when a ``tf.function`` calls it: hvps's Python branches decide
    how to build ops at trace time (never on tensor values), and AutoGraph's rewrite of them can break
    them (it mis-binds some helpers' arguments). TensorFlow excludes its own packages the same way."""
    try:
        from tensorflow.python.autograph.core import config
    except ImportError:  # a TensorFlow without this module converts nothing of ours to begin with
        return
    rule = config.DoNotConvert("hvps")
    if not any(str(r) == str(rule) for r in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (rule, *config.CONVERSION_RULES)


_exclude_from_autograph()

#: TensorFlow dtypes the core can move (bfloat16 numpy arrays are ml_dtypes', as the core's).
SUPPORTED = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.int16, tf.int32, tf.int64, tf.uint8,
             tf.uint16, tf.bool)


def check_dtype(tensor: Any, what: str = "tensor") -> None:
    """Raise TypeError for tensors the core cannot move (strings, complex, uint32, ...)."""
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


class CollectiveError(HvpsError, tf.errors.FailedPreconditionError):
    """A collective failed on every rank (mismatched submissions, a stall, a lost rank): an HvpsError,
    and the ``tf.errors.FailedPreconditionError`` that Horovod's TensorFlow ops raise for it."""

    def __init__(self, message: str) -> None:
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)
        self.args = (message,)


class ArgumentError(ValueError, tf.errors.InvalidArgumentError):
    """An argument the collective refused (alltoall's dim 0 and splits when it ran; a process set this rank
    is not a member of, or that is not registered, when the op is built): a ValueError, and the
    ``tf.errors.InvalidArgumentError`` that TensorFlow (and Horovod's ops) raise for it.

    Built as ``ArgumentError(message)``, or with an OpError's arguments ``(node_def, op, message, ...)``, as
    AutoGraph rebuilds an OpError raised while it traces a tf.function (it then stays this class).
    """

    def __init__(self, node_def: Any, op: Any = None, message: Optional[str] = None, *payloads: Any) -> None:
        if op is None and message is None:  # ArgumentError(message)
            node_def, message = None, node_def
        tf.errors.InvalidArgumentError.__init__(self, node_def, op, message)
        self.args = (message,)


def _as_tensorflow_error(err: Exception) -> Exception:
    """``err``, raised by a collective run eagerly, as a TensorFlow op would raise it (and as the op
    raises it in a graph): a failed collective as FailedPreconditionError, a bad argument as
    InvalidArgumentError, each still the HvpsError or ValueError it was."""
    if isinstance(err, tf.errors.OpError):
        return err
    if isinstance(err, HvpsError):
        return err if isinstance(err, ValueError) else CollectiveError(str(err))
    return ArgumentError(str(err)) if type(err) is ValueError else err


def _timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*arrays):
        start = time.perf_counter()
        try:
            return [np.asarray(r) for r in fn(*arrays)]
        finally:
            comm_clock.seconds += time.perf_counter() - start
    return timed


def fails_everywhere(kind: str) -> Callable:
    """``hvps.api.collectives.fails_everywhere`` for a TensorFlow collective run eagerly: a refused
    argument fails the others at once (while a graph is built, TensorFlow runs nothing yet)."""
    announcing = collectives.fails_everywhere(kind)

    def decorate(fn: Callable) -> Callable:
        announced = announcing(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            return (announced if tf.executing_eagerly() else fn)(*args, **kwargs)

        return call

    return decorate


def _library_dirs() -> tuple:
    """Directories whose frames are not the user's: hvps, its adapters, TensorFlow, Keras, the standard library."""
    import sysconfig

    import hvps
    import hvps.adapters

    dirs = [os.path.dirname(hvps.__file__), os.path.dirname(hvps.adapters.__file__),
            os.path.dirname(tf.__file__), sysconfig.get_paths()["stdlib"]]
    for name in ("keras", "tf_keras", "absl"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            dirs.append(os.path.dirname(module.__file__))
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


def call_site() -> str:
    """``file:line`` of the innermost frame outside hvps, TensorFlow, Keras and the standard library:
    the line of the user's code that built the op (the same on every rank that runs the same script)."""
    global _LIBRARY_DIRS
    if _LIBRARY_DIRS is None:
        _LIBRARY_DIRS = _library_dirs()
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.realpath(frame.f_code.co_filename)
        # AutoGraph's rewrite of a tf.function runs from a temporary file whose name differs by rank
        generated = os.path.basename(path).startswith("__autograph_generated_file")
        if not path.startswith(_LIBRARY_DIRS) and not path.startswith("<") and not generated:
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "unknown"


_LIBRARY_DIRS: Optional[tuple] = None


def run(fn: Callable[..., Any], inputs: Sequence[tf.Tensor], out_dtypes: Sequence[tf.DType],
        name: str = "hvps") -> list:
    """Run ``fn(*numpy_arrays) -> list of numpy arrays`` on ``inputs``; return tensors.

    Eagerly ``fn`` runs at once; in a graph it runs as one stateful ``tf.numpy_function``. The
    outputs' static shapes are the caller's job (``set_shape``).

    In a graph, TensorFlow may run independent ops in any order, on any of its threads: a TF1
    session runs them concurrently, and so may a ``tf.function`` when nothing orders them. So the
    collectives ``fn`` submits unnamed are named after the op itself, not numbered in submission
    order: ``<op name>@<file:line that built it>``, unique within its graph and the same on every
    rank that builds the same graph (as Horovod names graph ops after the graph's tensors).
    """
    fn = _timed(fn)
    if tf.executing_eagerly():
        try:
            results = fn(*[t.numpy() for t in inputs])
        except (HvpsError, ValueError) as err:
            converted = _as_tensorflow_error(err)
            if converted is err:
                raise
            raise converted from err
        return [tf.convert_to_tensor(r, dtype=d) for r, d in zip(results, out_dtypes)]
    identity: list = []

    def named(*arrays):
        with names_from(identity[0]):
            return fn(*arrays)

    outs = tf.numpy_function(named, list(inputs), list(out_dtypes), stateful=True, name=name)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    identity.append(f"{outs[0].op.name}@{call_site()}")
    return outs
