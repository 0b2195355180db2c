"""Data planes behind one small interface; ``build(settings, ...)`` picks and composes them.

- ``mpi``: mpi4py (MPI's collectives, or hvps's ring for allreduce);
- ``tdist``: torch.distributed process groups, gloo on CPU and NCCL on CUDA;
- ``auto``: MPI, plus NCCL for CUDA tensors when torch is loaded and a GPU with NCCL is present.

``HVPS_SHM`` (auto by default) puts a node's ranks on one shared-memory segment under either plane
(``node_plane.py``, ``shm.py``);
``HVPS_HIERARCHICAL_ALLREDUCE=1`` wraps the chosen one in ``HierarchicalBackend``; ``HVPS_ENCRYPT``
wraps the MPI data plane in ``SealedBackend`` (``sealed_setup.py``; it takes precedence over ``HVPS_SHM``).
"""

from __future__ import annotations

import sys

from .base import Backend

__all__ = ["Backend", "build", "create"]


def _mpi(comm, settings):
    from .mpi import MPIBackend

    return MPIBackend(comm, settings)


def _tdist(comm, settings):
    from .tdist import TorchDistBackend

    return TorchDistBackend(comm, settings)


def _gpu_ready() -> bool:
    torch = sys.modules.get("torch")  # never import torch for numpy or TensorFlow users
    if torch is None or not torch.cuda.is_available():
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()


def _auto(comm, settings):
    host = _mpi(comm, settings)
    if not _gpu_ready():
        return host
    from .router import DeviceRouter

    return DeviceRouter(host, _tdist(comm, settings))


#: name -> constructor on one communicator
REGISTRY = {"mpi": _mpi, "tdist": _tdist, "auto": _auto}


def create(name: str, comm, settings) -> Backend:
    """Build the backend called ``name`` on ``comm``."""
    try:
        factory = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown hvps backend {name!r}; available: {', '.join(REGISTRY)}") from None
    return factory(comm, settings)


def build(settings, comm, local, cross, secret=None) -> Backend:
    """The engine's backend: ``settings.backend`` on ``comm``, hierarchical when asked and useful,
    sealed when ``HVPS_ENCRYPT`` says (``secret``: the job's, which authenticates the key exchange).

    ``local`` spans this node's ranks, ``cross`` the ranks with this local rank
    on every node (both collective to build, as every backend here is).
    """
    from .sealed_setup import plan

    seal = plan(settings, comm, local, secret)
    if seal is not None:  # CUDA tensors are staged through host memory (SealedBackend takes none)
        name = "mpi" if settings.backend == "auto" else settings.backend
        backend = seal(create(name, comm, settings), comm)
        if not settings.hierarchical:
            return backend
        same_host = seal if settings.encrypt == "all" else (lambda inner, _comm: inner)
        return _hierarchical(settings, comm, local, backend, lambda: same_host(create(name, local, settings), local),
                             lambda: seal(create(name, cross, settings), cross))
    backend = create(settings.backend, comm, settings)
    from .node_plane import node_backend  # HVPS_SHM: shared memory within the node

    node = node_backend(settings, comm, local, cross, backend, create)
    if node is not None:
        return node
    if not settings.hierarchical:
        return backend
    return _hierarchical(settings, comm, local, backend, lambda: create(settings.backend, local, settings),
                         lambda: create(settings.backend, cross, settings))


def _hierarchical(settings, comm, local, backend, make_local, make_cross) -> Backend:
    sizes = set(comm.allgather(local.Get_size()))
    if len(sizes) > 1 or local.Get_size() in (1, comm.Get_size()):
        if comm.Get_rank() == 0:
            import logging

            logging.getLogger("hvps").warning(
                "HVPS_HIERARCHICAL_ALLREDUCE=1 ignored: it needs several nodes with the same number of ranks "
                "each (ranks per node: %s)", sorted(sizes))
        return backend
    from .hierarchical import HierarchicalBackend

    return HierarchicalBackend(backend, make_local(), make_cross(), local.Get_rank(), local.Get_size())
