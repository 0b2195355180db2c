"""``hvd.elastic``: not implemented by hvps yet.

Elastic training (ranks joining and leaving a running job) needs the engine to rebuild its
communicators while training continues. Until hvps does, restart the job instead: save
versioned checkpoints (``hvd.CheckpointManager``) and let the launcher restart it
(``hvpsrun --max-restarts N``, or a Slurm requeue), resuming from the last epoch.
"""

from __future__ import annotations

from typing import Any

MESSAGE = ("hvps does not implement elastic training (hvd.elastic) yet; restart the job instead: save "
           "checkpoints with hvd.CheckpointManager each epoch and resume from the latest after a restart "
           "(hvpsrun --max-restarts N, or a Slurm requeue)")


def _unavailable(*_: Any, **__: Any) -> Any:
    raise NotImplementedError(MESSAGE)


class _Unavailable:
    """Any use raises NotImplementedError naming the restart alternative."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _unavailable()


run = _unavailable


class State(_Unavailable):
    """Horovod's elastic state base class (unavailable)."""


class ObjectState(_Unavailable):
    """Horovod's elastic object state (unavailable)."""


class TorchState(_Unavailable):
    """Horovod's elastic model/optimizer state (unavailable)."""


class ElasticSampler(_Unavailable):
    """Horovod's elastic data sampler (unavailable)."""


__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "MESSAGE"]
