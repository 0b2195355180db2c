"""``hvd.elastic`` for TensorFlow and Keras: not implemented by hvps.

Elastic training (ranks joining and leaving a running job) needs the engine to rebuild its
communicators while training continues. hvps restarts the job instead: save checkpoints every
epoch (``hvd.callbacks.CheckpointCallback`` with Keras, or your own) and let the launcher
restart the job (``hvpsrun --max-restarts N``, or a Slurm requeue), resuming from the latest.
Every name Horovod's ``horovod.tensorflow.elastic`` and ``horovod.tensorflow.keras.elastic``
export is here; using any of them raises NotImplementedError saying so.
"""

from __future__ import annotations

from hvps.core.unavailable import Unavailable, refusing

MESSAGE = ("hvps does not implement elastic training (hvd.elastic); restart the job instead: save checkpoints "
           "each epoch (hvd.callbacks.CheckpointCallback with Keras) and resume from the latest after a restart "
           "(hvpsrun --max-restarts N, or a Slurm requeue)")


#: Horovod's elastic ``run`` decorator (unavailable)
run = refusing(MESSAGE)


class _Unavailable(Unavailable):
    """Any use raises NotImplementedError naming the restart alternative."""

    message = MESSAGE


class State(_Unavailable):
    """Horovod's elastic state base class (unavailable)."""


class ObjectState(_Unavailable):
    """Horovod's elastic object state (unavailable)."""


class TensorFlowState(_Unavailable):
    """Horovod's elastic TensorFlow variables state (unavailable)."""


class TensorFlowKerasState(_Unavailable):
    """Horovod's elastic Keras model/optimizer state (unavailable)."""


class KerasState(_Unavailable):
    """Horovod's ``horovod.tensorflow.keras.elastic.KerasState`` (unavailable)."""


class CommitStateCallback(_Unavailable):
    """Horovod's elastic Keras callback (unavailable)."""


class UpdateBatchStateCallback(_Unavailable):
    """Horovod's elastic Keras callback (unavailable)."""


class UpdateEpochStateCallback(_Unavailable):
    """Horovod's elastic Keras callback (unavailable)."""


__all__ = ["run", "State", "ObjectState", "TensorFlowState", "TensorFlowKerasState", "KerasState",
           "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "MESSAGE"]
