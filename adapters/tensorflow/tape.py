"""``DistributedGradientTape``: a tf.GradientTape whose ``gradient()`` averages over ranks."""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

import hvps

from .compression import Compression
from .gradients import allreduce_gradients, scale_factors
from .mpi_ops import Average, _check_process_set, _resolve_op


class _DistributedGradientTape(tf.GradientTape):
    """Shares the recorded tape of the wrapped one; only ``gradient`` differs."""

    def __init__(self, tape: tf.GradientTape, compression, sparse_as_dense: bool, op,
                 gradient_predivide_factor: float, name: Optional[str]) -> None:
        # Take over the wrapped tape's state (recorded operations, watched variables,
        # persistence), whether it is still recording or already closed.
        self.__dict__.update(tape.__dict__)
        self._hvps_compression = compression
        self._hvps_sparse_as_dense = sparse_as_dense
        self._hvps_op = op
        self._hvps_predivide = gradient_predivide_factor
        self._hvps_name = name

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE) -> Any:
        """Gradients of ``target`` w.r.t. ``sources``, reduced (by default averaged) over all ranks."""
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads)
        reduced = allreduce_gradients(flat, self._hvps_op, self._hvps_compression, self._hvps_sparse_as_dense,
                                      self._hvps_predivide, self._hvps_name)
        return tf.nest.pack_sequence_as(grads, reduced)


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                            compression=Compression.none, sparse_as_dense: bool = False, op=Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                            process_set: Any = None, name: Optional[str] = None) -> tf.GradientTape:
    """Wrap ``gradtape`` so that ``gradient()`` returns gradients reduced over all ranks.

    Use it around a tape that has recorded the forward pass (or wrap a fresh
    tape and use it in ``with``). Dense gradients go in one grouped allreduce;
    ``tf.IndexedSlices`` are allgathered unless ``sparse_as_dense``. Works
    eagerly and inside ``tf.function``. ``device_*``, ``num_groups`` and
    ``groups`` are accepted for Horovod compatibility: hvps always fuses all
    dense gradients of one call.
    """
    _check_process_set(process_set)
    op = _resolve_op(None, op)
    scale_factors(op, gradient_predivide_factor)  # validates the combination
    hvps.size()  # raises HvpsError before hvps.init()
    return _DistributedGradientTape(gradtape, compression, sparse_as_dense, op, gradient_predivide_factor, name)
