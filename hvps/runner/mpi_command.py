"""The mpirun command line, as a pure function of the settings and the environment.

Per MPI implementation (detected from ``mpirun --version``, as horovodrun does):

* Open MPI 4.1 and 5.x: ``--bind-to none --map-by slot``, ``-H host:slots`` (a
  hostfile for IPv6 literals, which only 5.x can address), ``-x VAR`` forwards the environment,
  ``--tag-output``; ``--allow-run-as-root`` for root and ``--oversubscribe`` when a
  localhost-only run has more ranks than cores. 5.x's prterun rejects the single-dash
  ``-bind-to`` that 4.1 also took, so only the double-dash forms are used. On one host the
  TCP BTL is off (shared memory and self only); across hosts it is bound to
  ``--network-interface`` (:mod:`hvps.runner.mpi_transport`).
* MPICH (Hydra): ``-bind-to none -map-by slot``, ``-hosts host:slots``,
  ``-genvlist``, ``-l`` to label output. ``-iface`` covers Hydra's own connections; the ch4:ofi
  netmod's listener follows ``FI_TCP_IFACE``/``FI_SOCKETS_IFACE``, set from ``--network-interface``.
* Intel MPI (Hydra): ``-hosts host1,host2 -ppn N`` (equal slots per host), ``-genvlist``.
"""

from __future__ import annotations

import os
import shlex
from typing import Mapping, Optional

from ..core.mpi_env import mpi_defaults
from . import hosts as hostlib
from .errors import LaunchError
from .mpi_discovery import MpiImpl, MpiLauncher
from .mpi_transport import open_mpi_transport_args, single_node_allocation
from .settings import LaunchSettings

#: what build_mpirun_command assumes when not told (unit tests, docs)
DEFAULT_LAUNCHER = MpiLauncher("mpirun", "PATH", MpiImpl.OPEN_MPI, (5, 0))

#: variables forwarded to every rank when set: exact names and prefixes
FORWARD_PREFIXES = ("HVPS_", "NCCL_")
FORWARD_NAMES = ("OMP_NUM_THREADS", "PATH", "PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER",
                 "LD_LIBRARY_PATH", "VIRTUAL_ENV")
#: libfabric's interface choice for its tcp and sockets providers (one interface each)
LIBFABRIC_IFACE = ("FI_TCP_IFACE", "FI_SOCKETS_IFACE")
#: Open MPI 4.1 and 5.0 (prterun) both take the double-dash forms; 5.0 rejects '-bind-to'.
OPEN_MPI_NO_BINDING = ["--bind-to", "none", "--map-by", "slot"]
HYDRA_NO_BINDING = ["-bind-to", "none", "-map-by", "slot"]


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
    for name in LIBFABRIC_IFACE:  # MPICH's ch4:ofi netmod (and Open MPI's ofi parts) listen there, not everywhere
        if settings.network_interfaces and name not in env:
            own[name] = settings.network_interfaces[0]
    return own


def launch_environment(settings: LaunchSettings, env: Mapping[str, str], num_proc: int, hosts: list,
                       cpu_count: int) -> dict:
    """The full environment to run the launcher with."""
    full = dict(env)
    full.update(rank_environment(settings, env, num_proc, hosts, cpu_count))
    return dict(mpi_defaults(full))


def default_num_proc(settings: LaunchSettings, hosts: list) -> int:
    if settings.num_proc is not None:
        return settings.num_proc
    if hosts:
        return sum(h.slots for h in hosts)
    raise LaunchError("-np is required when no -H/--hostfile is given; e.g. hvpsrun -np 2 python train.py")


def split_mpi_args(text: str) -> list:
    """``--mpi-args`` as argv; a one-line LaunchError when its quoting is broken."""
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise LaunchError(f"--mpi-args {text!r}: {str(exc).lower()}; quote it once as a whole, "
                          "e.g. --mpi-args='--mca btl tcp,self'") from None


def _check_launcher(mpi: MpiLauncher) -> None:
    if mpi.impl is MpiImpl.MISSING:
        raise LaunchError(f"{mpi.path} --version failed: that mpirun cannot run here; check its installation, "
                          "or name another with --mpirun PATH")
    if mpi.impl is MpiImpl.UNKNOWN:
        raise LaunchError(f"'{mpi.path} --version' names no MPI hvpsrun knows (Open MPI, MPICH, Intel MPI); "
                          "run mpirun yourself, or use --launcher srun inside Slurm")


def build_mpirun_command(settings: LaunchSettings, env: Mapping[str, str], *,
                         mpi: MpiLauncher = DEFAULT_LAUNCHER, hosts: Optional[list] = None,
                         cpu_count: Optional[int] = None, euid: Optional[int] = None,
                         local_names: Optional[set] = None, hostfile: Optional[str] = None,
                         in_allocation: bool = False) -> list:
    """The mpirun argv for ``settings`` (pure: no process is started, nothing is resolved).

    ``env`` is the caller's environment. Variables are forwarded by name only
    (``-x VAR`` / ``-genvlist``), never with their values on the command line,
    so values with spaces, quotes or commas reach the ranks unchanged: the
    launcher must run with :func:`launch_environment`. ``hosts`` defaults to the
    parsed -H/--hostfile. Open MPI's ``-H`` cannot carry an IPv6 literal, so for
    such hosts the caller writes :func:`hvps.runner.hosts.hostfile_text` to a
    file and passes its path as ``hostfile``. ``in_allocation``: inside a Slurm job,
    where mpirun takes nodes and slots from the allocation (never oversubscribed).
    """
    _check_launcher(mpi)
    if not settings.command:
        raise LaunchError("no command given; e.g. hvpsrun -np 2 python train.py")
    hosts = hostlib.resolve_hosts(settings.hosts, settings.hostfile) if hosts is None else hosts
    num_proc = default_num_proc(settings, hosts)
    if hosts:
        hostlib.check_slots(hosts, num_proc)
    cpu_count = (os.cpu_count() or 1) if cpu_count is None else cpu_count
    euid = os.geteuid() if euid is None else euid
    local_only = hostlib.is_local_only(hosts, local_names)
    one_host = single_node_allocation(env) if in_allocation else local_only

    own = rank_environment(settings, env, num_proc, hosts, cpu_count)
    forwarded = sorted(set(own) | {k for k in env if is_forwarded(k)})
    mpi_args = split_mpi_args(settings.mpi_args)
    nics = ",".join(settings.network_interfaces)

    cmd = [mpi.path, "-np", str(num_proc)]
    if mpi.impl is MpiImpl.OPEN_MPI:
        if euid == 0:
            cmd.append("--allow-run-as-root")
        if local_only and not in_allocation and num_proc > cpu_count:
            cmd.append("--oversubscribe")
        cmd.append("--tag-output")
        if any(h.is_ipv6 for h in hosts) and mpi.version[:1] < (5,):
            raise LaunchError(f"Open MPI {mpi.version_text} cannot address hosts by IPv6 address (its runtime takes "
                              "only host names); name them in /etc/hosts or DNS, or use Open MPI 5")
        if hostfile:
            cmd += ["--hostfile", hostfile]
        elif hosts:
            if any(h.is_ipv6 for h in hosts):
                raise LaunchError("Open MPI's -H cannot carry IPv6 addresses; hvpsrun passes them in a hostfile")
            cmd += ["-H", hostlib.hosts_arg(hosts)]
        cmd += OPEN_MPI_NO_BINDING
        cmd += open_mpi_transport_args(mpi.version, one_host, settings.network_interfaces, mpi_args, env)
        for key in forwarded:
            cmd += ["-x", key]
    else:
        cmd.append("-l")
        if hosts and any(h.is_ipv6 for h in hosts):
            raise LaunchError(f"{mpi.impl.value} takes no IPv6 literals in -hosts; name the hosts "
                              "(add them to /etc/hosts) instead")
        if hosts and mpi.impl is MpiImpl.MPICH:
            cmd += ["-hosts", hostlib.hosts_arg(hosts)]
        elif hosts:
            slots = {h.slots for h in hosts}
            if len(slots) != 1:
                raise LaunchError("Intel MPI needs the same slots on every host with -H; give a machinefile "
                                  "through --mpi-args='-machinefile FILE' instead")
            cmd += ["-hosts", ",".join(h.name for h in hosts), "-ppn", str(slots.pop())]
        if mpi.impl is MpiImpl.MPICH:
            cmd += HYDRA_NO_BINDING
        if nics:
            cmd += ["-iface", settings.network_interfaces[0]]
        if forwarded:
            cmd += ["-genvlist", ",".join(forwarded)]
    return cmd + mpi_args + list(settings.command)
