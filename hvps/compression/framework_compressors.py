"""Framework compressors (Horovod's interface, on a framework's tensors) in the core pipeline, and what
every framework adapter needs around ``GradientCompression``:

- ``TensorCompressor`` runs a Horovod-style compressor (an object or class with
  ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)`` on the
  framework's tensors) inside the core pipeline, as a summable transform;
- ``as_gradient_compression`` turns what a user passed as ``compression=`` into
  a ``GradientCompression`` (or raises TypeError);
- ``from_name`` rebuilds a compression from its ``name`` (``"topk(0.01)"``), for
  configs that store the name.

The adapter only supplies the tensor <-> numpy conversions.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from ..core import dtypes
from .base import Compressor
from .pipeline import GradientCompression
from .registry import REGISTRY, none


class TensorCompressor(Compressor):
    """A Horovod-style tensor compressor inside the core's pipeline (summable payloads).

    ``to_tensor(array)`` and ``to_array(tensor)`` convert between numpy arrays and
    the framework's tensors.
    """

    summable = True

    def __init__(self, horovod_compressor: Any, to_tensor: Callable[[Any], Any],
                 to_array: Callable[[Any], Any]) -> None:
        self.horovod = horovod_compressor
        self.to_tensor = to_tensor
        self.to_array = to_array

    def compress(self, array, name):
        compressed, ctx = self.horovod.compress(self.to_tensor(array))
        return [self.to_array(compressed)], (ctx, array.shape)

    def decompress(self, payloads, ctx):
        tensor = self.horovod.decompress(self.to_tensor(payloads[0]), ctx[0])
        return self.to_array(tensor).reshape(ctx[1])

    def check(self, array):
        dtypes.check_dtype(array.dtype)


def is_horovod_compressor(obj: Any) -> bool:
    """Whether ``obj`` has Horovod's ``compress`` / ``decompress`` (an instance or a class of static methods)."""
    return callable(getattr(obj, "compress", None)) and callable(getattr(obj, "decompress", None))


def as_gradient_compression(compression: Any, to_tensor: Callable[[Any], Any], to_array: Callable[[Any], Any],
                            namespace: str = "hvd") -> GradientCompression:
    """The core pipeline for ``compression``: a GradientCompression as it is, None as ``none``, a
    Horovod-style compressor wrapped in a ``TensorCompressor``; anything else raises TypeError."""
    if isinstance(compression, GradientCompression):
        return compression
    if compression is None:
        return none()
    if is_horovod_compressor(compression) and not isinstance(compression, (str, bytes)):
        name = getattr(compression, "__name__", type(compression).__name__)
        return GradientCompression(f"horovod:{name}", TensorCompressor(compression, to_tensor, to_array))
    raise TypeError(
        f"compression must be one of {namespace}.Compression.none/fp16/bf16/int8/topk(...)/dgc(...) or a "
        f"Horovod-style compressor with compress/decompress; got {compression!r}"
    )


_CALL = re.compile(r"^(\w+)(?:\(([^()]*)\))?$")


def from_name(name: str) -> GradientCompression:
    """The compression whose ``GradientCompression.name`` is ``name``: ``"none"``, ``"fp16"``, ``"bf16"``,
    ``"int8"``, ``"topk(0.01)"``, ``"dgc(0.001)"`` (other hyper-parameters take their defaults).
    Raises ValueError for anything else (``"horovod:..."`` names cannot be rebuilt)."""
    match = _CALL.match(name.strip())
    if match is None or match.group(1) not in REGISTRY:
        raise ValueError(f"cannot rebuild a compression from the name {name!r}")
    factory, argument = REGISTRY[match.group(1)], match.group(2)
    if not argument:
        return factory()
    try:
        return factory(float(argument))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot rebuild a compression from the name {name!r}: {exc}") from None


__all__ = ["TensorCompressor", "as_gradient_compression", "from_name", "is_horovod_compressor"]
