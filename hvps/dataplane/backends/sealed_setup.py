"""``HVPS_ENCRYPT`` at ``init``: check that every rank agrees, refuse what cannot be sealed, exchange keys,
and wrap the MPI data plane in ``SealedBackend`` (``backends.build`` calls :func:`plan`)."""

from __future__ import annotations

import logging
from typing import Callable, Optional

from ...core.errors import HvpsError

log = logging.getLogger("hvps")


def _agree(settings, comm) -> None:
    modes = comm.allgather(settings.encrypt)
    if len(set(modes)) > 1:
        on = [r for r, m in enumerate(modes) if m != "0"]
        off = [r for r, m in enumerate(modes) if m == "0"]
        each = ", ".join(f"rank {r}={m}" for r, m in enumerate(modes))
        raise HvpsError(f"HVPS_ENCRYPT differs between ranks ({each}): "
                        f"ranks {off} would send in clear what ranks {on} seal; start every rank with the same "
                        "HVPS_ENCRYPT (hvpsrun --encrypt does)")


def plan(settings, comm, local, secret: Optional[bytes]) -> Optional[Callable]:
    """None when encryption is off; else ``wrap(backend, sub_comm)`` (collective over ``sub_comm``).

    Always collective over ``comm`` (every rank checks that the others have the same setting)."""
    _agree(settings, comm)
    if settings.encrypt == "0":
        return None
    if settings.backend not in ("mpi", "auto"):
        raise HvpsError(f"HVPS_ENCRYPT cannot seal HVPS_BACKEND={settings.backend}: "
                        "torch.distributed's gloo and NCCL send in clear; start the job with an MPI launcher "
                        "(mpirun, srun, hvpsrun without --gloo) and HVPS_BACKEND=mpi or auto (CUDA tensors are then "
                        "staged through host memory)")
    from . import sealed
    from .. import sealed_crypto

    me = comm.Get_rank()
    node = local.bcast(me, root=0)  # a node is named by its first rank
    hosts = comm.allgather(node)
    if settings.encrypt == "1" and len(set(hosts)) == 1:
        if me == 0:
            log.info("HVPS_ENCRYPT=1: every rank is on one host, nothing to seal (HVPS_ENCRYPT=all seals it anyway)")
        return None
    keyring = sealed_crypto.agree(comm, secret)

    def wrap(backend, sub_comm):
        members = sub_comm.allgather(me)
        if len(members) == 1:
            return backend
        return sealed.SealedBackend(backend, members, keyring, [hosts[m] for m in members],
                                          settings.encrypt == "all", settings.ring_chunk_bytes,
                                          settings.stall_fail_seconds)

    return wrap
