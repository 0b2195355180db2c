"""``hvd.elastic``: not implemented by hvps yet.

Elastic training (ranks joining and leaving a running job) needs the engine to rebuild its
communicators while training continues. Until hvps does, restart the job instead: save
versioned checkpoints (``hvd.CheckpointManager``) and let the launcher restart it
(``hvpsrun --max-restarts N``, or a Slurm requeue), resuming from the last epoch.
"""

from __future__ import annotations

from hvps.core.unavailable import Unavailable, refusing

MESSAGE = ("hvps does not implement elastic training (hvd.elastic) yet; restart the job instead: save "
           "checkpoints with hvd.CheckpointManager each epoch and resume from the latest after a restart "
           "(hvpsrun --max-restarts N, or a Slurm requeue)")


class _Unavailable(Unavailable):
    """Any use raises NotImplementedError naming the restart alternative."""

    message = MESSAGE


run = refusing(MESSAGE)


class State(_Unavailable):
    """Horovod's elastic state base class (unavailable)."""


class ObjectState(_Unavailable):
    """Horovod's elastic object state (unavailable)."""


class TorchState(_Unavailable):
    """Horovod's elastic model/optimizer state (unavailable)."""


class ElasticSampler(_Unavailable):
    """Horovod's elastic data sampler (unavailable)."""


__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "MESSAGE"]
