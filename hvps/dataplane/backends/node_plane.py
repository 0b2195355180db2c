"""Whether the ranks of a node run their collectives through shared memory (``HVPS_SHM``), and how.

``auto`` (the default) puts the ranks of each node on one shared-memory segment (``shm.py``) whenever
two ranks of the job share a host, whatever the flat data plane under it: MPI's, or torch.distributed's
in the jobs started without MPI (``hvpsrun --gloo``, torchrun, elastic jobs). Across nodes the segment
is composed with the flat plane as ``HierarchicalBackend`` does. CUDA tensors stay on the flat plane
(NCCL); point-to-point transfers and process sets run there too, and alltoall when the job spans nodes.

When shared memory cannot be used (another architecture than x86-64, ranks that cannot see each
other's processes, nodes with different numbers of ranks, no room in ``/dev/shm``), ``auto`` logs one
warning on rank 0, only when ranks do share a host, and keeps the flat plane; ``1`` raises the same
``HvpsError`` on every rank at ``init``; ``0`` never tries. A job of one rank has nothing to share.
Every decision is agreed over the job's communicator, so every rank takes the same branch.
"""

from __future__ import annotations

import logging
import os
import platform
from typing import Callable, Optional

from ...core.errors import HvpsError
from ..shm_segment import process_alive
from .base import Backend
from .hierarchical import HierarchicalBackend
from .router import DeviceRouter
from .shm import ShmBackend, open_segment

log = logging.getLogger("hvps")

#: the machines whose store order the segment's counters rely on (x86-64's total store order)
STORE_ORDERED_MACHINES = ("x86_64", "AMD64")


class NodeFirst(DeviceRouter):
    """Host buffers through the node's shared-memory plane ``node``, device (CUDA) buffers on ``flat``.

    ``node`` owns ``flat`` (it falls back on it and closes it), so closing and failure reports go
    through ``node`` only; process sets are ``flat``'s.
    """

    def __init__(self, node: Backend, flat: Backend) -> None:
        super().__init__(node, flat)
        self.name = node.name

    @property
    def supports_process_sets(self) -> bool:
        return self.device.supports_process_sets

    def takes(self, device, dtype):
        return self.host.takes(device, dtype) if device == "cpu" else self.device.takes(device, dtype)

    def interrupt_on(self, event):
        self.host.interrupt_on(event)

    def report_failures_to(self, failed):
        self.host.report_failures_to(failed)

    def subset(self, ranks):
        return self.device.subset(ranks)

    def close(self, failed=False):
        self.host.close(failed)


def _host_reason(local) -> Optional[str]:
    """Why this rank cannot share memory with the other ranks of its node, as seen from here (None: it can).

    Collective over ``local``. A peer whose process this rank cannot see (another PID namespace: separate
    containers sharing ``/dev/shm``) could not be told apart from a dead one while waiting on it.
    """
    pids = local.allgather(os.getpid())
    machine = platform.machine()
    if machine not in STORE_ORDERED_MACHINES:
        return f"{machine} may reorder stores (only x86-64's total store order is relied on)"
    hidden = [r for r, pid in enumerate(pids) if not process_alive(pid)]
    if hidden:
        return (f"local rank {local.Get_rank()} cannot see the processes of local ranks {hidden} (another PID "
                "namespace, as in separate containers), so it could not tell a dead peer from a slow one")
    return None


def _agreed_reason(comm, local) -> tuple:
    """``(why, shared)``: why shared memory cannot be used on this job (None: it can), the same on every
    rank, and whether any two ranks share a host at all."""
    views = comm.allgather((local.Get_size(), _host_reason(local)))
    sizes = sorted({size for size, _ in views})
    shared = sizes[-1] > 1
    if not shared:
        return "no two ranks of this job share a host", shared
    why = next((reason for _, reason in views if reason), None)
    if why is None and len(sizes) > 1:
        why = f"nodes have different numbers of ranks ({sizes})"
    return why, shared


def _decline(setting: str, comm, flat: Backend, why: str, shared: bool) -> None:
    """``HVPS_SHM=1``: raise on every rank (after closing ``flat``); ``auto``: warn once where ranks share a host."""
    if setting == "1":
        flat.close()
        raise HvpsError(f"HVPS_SHM=1, but the node's shared-memory data plane cannot be used: {why}. Set "
                        f"HVPS_SHM=0 (or auto, which falls back by itself) to run on the {flat.name} data plane")
    if shared and comm.Get_rank() == 0:
        log.warning("hvps: shared memory not used within the node: %s; collectives run on the %s data plane "
                    "(HVPS_SHM=0 says so without this warning)", why, flat.name)


def node_backend(settings, comm, local, cross, flat: Backend,
                 create: Callable[[str, object, object], Backend]) -> Optional[Backend]:
    """The shared-memory data plane over ``flat`` when ``settings.shm`` allows it and it applies, else None.

    Collective over ``comm`` (every rank returns the same kind of plane, or raises the same error).

    Args:
        settings: the job's settings (``shm``, ``backend``, ``ring_chunk_bytes``, the stall time).
        comm: the job's communicator (MPI's, or a store communicator without MPI).
        local: this node's ranks; ``cross``: the ranks with this local rank on every node.
        flat: the data plane already built on ``comm``; the returned plane owns it.
        create: ``create(name, comm, settings)`` builds a data plane (the cross-node one here).

    Returns:
        The plane to use (``shm``, ``hierarchical-shm``), or None to keep ``flat``.

    Raises:
        HvpsError: ``HVPS_SHM=1`` and shared memory cannot be used; the error says why.
    """
    if settings.shm == "0" or comm.Get_size() == 1:
        return None
    why, shared = _agreed_reason(comm, local)
    segment = None
    if why is None:
        buffer_bytes = max(4096, settings.ring_chunk_bytes // 64 * 64)
        segment, reason = open_segment(local, buffer_bytes, settings.stall_fail_seconds)
        try:
            why = next((r for r in comm.allgather(reason) if r), None)
        except BaseException:
            if segment is not None:
                segment.close()
            raise
        if why is not None and segment is not None:  # another node could not open its segment
            segment.close()
    if why is not None:
        _decline(settings.shm, comm, flat, why, shared)
        return None
    if local.Get_size() == comm.Get_size():
        node: Backend = ShmBackend(segment, flat)
    else:
        try:
            across = create(settings.backend, cross, settings)
        except BaseException:
            segment.close()
            raise
        node = HierarchicalBackend(flat, ShmBackend(segment, None), across, local.Get_rank(), local.Get_size())
        node.name = "hierarchical-shm"
    if not flat.takes("cuda", "float32"):
        return node
    return NodeFirst(node, flat)
