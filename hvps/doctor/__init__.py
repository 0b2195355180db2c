"""``hvps doctor``: a preflight check of a node (and, under mpirun, of every node) for distributed
training. Checks are pure functions of what a :class:`~hvps.doctor.host.Host` reads, registered by
name in :data:`~hvps.doctor.base.REGISTRY`; ``--root`` points the reader at a prepared tree."""
from .base import REGISTRY, Check, Context
from .host import Host
from .runner import collect

__all__ = ["Check", "Context", "Host", "REGISTRY", "collect"]
