"""Data planes behind one small interface; ``create(name, comm)`` picks one by name."""

from __future__ import annotations

from .base import Backend

__all__ = ["Backend", "create"]


def _mpi(comm, settings):
    from .mpi import MPIBackend

    return MPIBackend(comm, settings)


#: name -> constructor; further data planes (torch.distributed, Horovod) register here.
REGISTRY = {"mpi": _mpi}


def create(name: str, comm, settings) -> Backend:
    """Build the backend called ``name`` on ``comm``."""
    try:
        factory = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown hvps backend {name!r}; available: {', '.join(REGISTRY)}") from None
    return factory(comm, settings)
