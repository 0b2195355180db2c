"""``DistributedGradientTape``: a tf.GradientTape whose ``gradient()`` averages over ranks."""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

import hvps
from hvps import ProcessSet, global_process_set
from hvps.adapters.common.controls import CompressionControls

from .compression import is_fusable
from .gradients import allreduce_gradients, gradient_options, reduce_shared_gradients, variable_key, variable_name
from .mpi_ops import Average, _check_process_set


class _DistributedGradientTape(CompressionControls, tf.GradientTape):
    """Shares the recorded tape of the wrapped one; only ``gradient`` differs."""

    def __init__(self, tape: tf.GradientTape, compression, sparse_as_dense: bool, op,
                 gradient_predivide_factor: float, name: Optional[str], process_set: Any = None,
                 scale_local_gradients: bool = True) -> None:
        # Take over the wrapped tape's state (recorded operations, watched variables,
        # persistence), whether it is still recording or already closed.
        self.__dict__.update(tape.__dict__)
        self.compression = compression
        self._hvps_sparse_as_dense = sparse_as_dense
        self._hvps_op = op
        self._hvps_predivide = gradient_predivide_factor
        self._hvps_name = name
        self._hvps_process_set = process_set
        self._hvps_scale_local = scale_local_gradients
        self._hvps_local_sources: set = set()

    def register_local_source(self, source: tf.Variable) -> None:
        """Keep ``source``'s gradient on this rank: never reduced (only scaled by 1/set size when
        ``scale_local_gradients``, as Horovod does, so a local layer learns at the global rate)."""
        self._hvps_local_sources.add(variable_key(source))

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE) -> Any:
        """Gradients of ``target`` w.r.t. ``sources``, reduced (by default averaged) over all ranks."""
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads)
        flat_sources = tf.nest.flatten(sources)
        if len(flat_sources) != len(flat):
            flat_sources = [None] * len(flat)

        def reduce(gs: list, vs: list) -> list:
            names = None if any(v is None for v in vs) else [variable_name(v) for v in vs]
            return allreduce_gradients(gs, self._hvps_op, self.compression, self._hvps_sparse_as_dense,
                                       self._hvps_predivide, self._hvps_name, names, self._hvps_process_set)

        reduced = reduce_shared_gradients(flat, flat_sources, self._hvps_local_sources, reduce,
                                          self._hvps_scale_local, self._hvps_process_set)
        return tf.nest.pack_sequence_as(grads, reduced)


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                            compression: Any = None, sparse_as_dense: bool = False, op=Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                            process_set: Any = global_process_set, scale_local_gradients: bool = True,
                            name: Optional[str] = None) -> tf.GradientTape:
    """Wrap ``gradtape`` so that ``gradient()`` returns gradients reduced over all ranks.

    Use it around a tape that has recorded the forward pass (or wrap a fresh
    tape and use it in ``with``). Works eagerly and inside ``tf.function``.

    ``compression``: ``hvd.Compression.none`` (default), ``.fp16``, ``.bf16``
    or a Horovod-style compressor put all dense gradients in one fused
    allreduce; ``.int8``, ``.topk(density)`` and ``.dgc(density)`` compress
    every gradient through the core pipeline (exchanges overlapping). Top-k
    and DGC keep error feedback in the compression object, keyed by variable
    path (``name`` prefixes it): build it once, outside the training step, and
    pass the same object every step. Its ``stats`` (``tape.compression_stats()``)
    count the bytes on the wire; ``compression.set_epoch(epoch)`` drives DGC's
    warm-up. ``tf.IndexedSlices`` are allgathered uncompressed unless
    ``sparse_as_dense``. ``device_*``, ``num_groups`` and ``groups`` are
    accepted for Horovod compatibility: hvps always fuses all dense gradients
    of one call. ``process_set``: gradients are averaged over its members
    (summable compressions only); other ranks get their own gradients back.
    ``scale_local_gradients``: gradients of sources given to ``register_local_source`` (see
    :func:`PartialDistributedGradientTape`) are divided by the set size.
    """
    op, pipeline, _, _ = gradient_options(op, gradient_predivide_factor, compression)
    hvps.size()  # raises HvpsError before hvps.init()
    if process_set is global_process_set:
        process_set = None
    if process_set is not None:
        if not isinstance(process_set, ProcessSet):
            raise TypeError(f"process_set must be a ProcessSet, not {type(process_set).__name__}")
        if not is_fusable(pipeline):
            _check_process_set(process_set)
    return _DistributedGradientTape(gradtape, pipeline, sparse_as_dense, op, gradient_predivide_factor, name,
                                    process_set, scale_local_gradients)


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                                   compression: Any = None, sparse_as_dense: bool = False, op=Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                                   process_set: Any = global_process_set, local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """A DistributedGradientTape that leaves the gradients of ``local_layers`` (Keras layers) on this
    rank: they are not reduced, only divided by the set size when ``scale_local_gradients``."""
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, tf.keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, tf.keras.layers.Layer) for layer in local_layers):
        raise ValueError("local_layers must be Keras layers (tf.keras.layers.Layer)")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape

