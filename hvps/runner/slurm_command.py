"""Inside a Slurm allocation: an ``srun --mpi=pmix`` line from the allocation (pure)."""

from __future__ import annotations

import shlex
from typing import Mapping, Optional

from . import hosts as hostlib
from .errors import LaunchError
from .mpi_command import rank_environment
from .settings import LaunchSettings


def in_slurm_allocation(env: Mapping[str, str]) -> bool:
    """Whether we run inside a Slurm job (batch script or salloc shell)."""
    return bool(env.get("SLURM_JOB_ID"))


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    raw = env.get(name, "")
    head = raw.split("(")[0].split(",")[0]  # SLURM_TASKS_PER_NODE looks like '2(x3),1'
    return int(head) if head.isdigit() else None


def allocation_num_proc(env: Mapping[str, str]) -> Optional[int]:
    return _int(env, "SLURM_NTASKS") or _int(env, "SLURM_NPROCS")


def build_srun_command(settings: LaunchSettings, env: Mapping[str, str], *, cpu_count: int = 1,
                       srun: str = "srun") -> list:
    """``srun --mpi=pmix -n N ...`` for the current allocation.

    ``--kill-on-bad-exit=1`` makes Slurm end the other ranks when one fails, as
    mpirun does; ``--cpu-bind=none`` matches mpirun's ``-bind-to none``. srun
    exports the whole environment by default, so the HVPS_* variables reach the
    ranks without flags; hvpsrun runs srun with :func:`srun_environment`.
    """
    if not settings.command:
        raise LaunchError("no command given; e.g. hvpsrun -np 2 python train.py")
    hosts = hostlib.resolve_hosts(settings.hosts, settings.hostfile)
    num_proc = settings.num_proc or allocation_num_proc(env) or (sum(h.slots for h in hosts) if hosts else None)
    if num_proc is None:
        raise LaunchError("-np is required: the allocation does not say how many tasks (SLURM_NTASKS is unset)")
    allocated = allocation_num_proc(env)
    if allocated is not None and num_proc > allocated and not hosts:
        raise LaunchError(f"-np {num_proc} is more than the {allocated} tasks of Slurm job {env.get('SLURM_JOB_ID')};"
                          " lower -np or submit with more tasks (sbatch -n)")
    cmd = [srun, "--mpi=pmix", "-n", str(num_proc), "--cpu-bind=none", "--kill-on-bad-exit=1"]
    if hosts:
        hostlib.check_slots(hosts, num_proc)
        per_host = [n for n in hostlib.ranks_per_host(hosts, num_proc) if n]
        used = hosts[: len(per_host)]
        cmd += ["--nodes", str(len(used)), "--nodelist", ",".join(h.name for h in used)]
        if len(set(per_host)) == 1:
            cmd += ["--ntasks-per-node", str(per_host[0])]
    return cmd + shlex.split(settings.mpi_args) + list(settings.command)


def srun_environment(settings: LaunchSettings, env: Mapping[str, str], num_proc: int, cpu_count: int) -> dict:
    """The environment srun runs with: the caller's plus HVPS_*, OMP_NUM_THREADS and NIC selection."""
    full = dict(env)
    tasks_per_node = _int(env, "SLURM_TASKS_PER_NODE") or num_proc
    cpus_per_task = _int(env, "SLURM_CPUS_PER_TASK")
    if not env.get("OMP_NUM_THREADS") and cpus_per_task:
        full["OMP_NUM_THREADS"] = str(cpus_per_task)
    own = rank_environment(settings, full, tasks_per_node, [], cpu_count)
    full.update(own)
    if settings.network_interfaces:
        nics = ",".join(settings.network_interfaces)
        full.setdefault("OMPI_MCA_btl_tcp_if_include", nics)
        full.setdefault("OMPI_MCA_oob_tcp_if_include", nics)
    return full
