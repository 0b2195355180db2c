"""Run the registered checks on this node, and under ``--all-ranks`` gather every rank's rows to rank 0."""
from __future__ import annotations

import socket
from typing import Optional

from . import checks_container, checks_cpu, checks_crypto, checks_gpu, checks_network, checks_software  # noqa: F401,E501 (register)
from .base import REGISTRY, Check, Context
from .checks_container import detect_container
from .host import Host
from .report import merge


def selected(only: Optional[str]) -> list:
    """Registered checks, filtered by ``--only`` (comma-separated groups or check names)."""
    if not only:
        return list(REGISTRY.values())
    wanted = {w.strip() for w in only.split(",") if w.strip()}
    unknown = wanted - {s.group for s in REGISTRY.values()} - set(REGISTRY)
    if unknown:
        groups = sorted({s.group for s in REGISTRY.values()})
        raise ValueError(f"--only {','.join(sorted(unknown))}: no such group or check; groups: {', '.join(groups)}; "
                         f"checks: {', '.join(REGISTRY)}")
    return [s for s in REGISTRY.values() if s.group in wanted or s.name in wanted]


def collect(host: Host, ctx: Context, only: Optional[str] = None) -> list:
    """Every selected check's result; a check that raises becomes a "warn" row saying so."""
    results = []
    for spec in selected(only):
        try:
            results.append(spec.func(host, ctx))
        except Exception as exc:  # a broken probe must not hide the other rows
            results.append(Check(spec.name, "warn", f"check crashed: {type(exc).__name__}: {exc}",
                                 "the check could not read what it needs", "report this as an hvps bug"))
    return results


def hostname(host: Host) -> str:
    return host.fact("hostname", socket.gethostname) or "?"


def local_report(root: str, ranks_per_node: Optional[int], only: Optional[str]) -> dict:
    host = Host(root)
    ctx = Context(ranks_per_node=ranks_per_node or 1, container=detect_container(host))
    return merge([rank_result(0, host, ctx, only)])


def rank_result(rank: int, host: Host, ctx: Context, only: Optional[str]) -> dict:
    return {"rank": rank, "host": hostname(host), "context": {"ranks_per_node": ctx.ranks_per_node,
            "world_size": ctx.world_size, "multi_host": ctx.multi_host, "container": ctx.container},
            "checks": [c.as_json() for c in collect(host, ctx, only)]}


def all_ranks_report(root: str, ranks_per_node: Optional[int], only: Optional[str]) -> Optional[dict]:
    """Run on every rank of MPI_COMM_WORLD; rank 0 returns the merged report, the others None.
    ``root`` may contain ``{rank}`` (a different prepared tree per rank)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    host = Host(root.replace("{rank}", str(rank)))
    names = comm.allgather(hostname(host))
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    ctx = Context(ranks_per_node=ranks_per_node or node.Get_size(), world_size=comm.Get_size(),
                  multi_host=len(set(names)) > 1, container=detect_container(host))
    node.Free()
    gathered = comm.gather(rank_result(rank, host, ctx, only), root=0)
    return merge(gathered) if rank == 0 else None
