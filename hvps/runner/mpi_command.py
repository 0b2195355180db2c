"""The mpirun command line, as a pure function of the settings and the environment.

What differs between MPI implementations (detected from ``mpirun --version``, as horovodrun does)
is data in their table, :class:`hvps.core.launchers.MpiImpl`; this module only assembles it:

* the launcher, ``-np N`` (its spelling), output labelled by rank (``--tag-output``/``-l``) and no core
  binding (``--bind-to none --map-by slot``; Hydra's single-dash forms);
* Open MPI: ``--allow-run-as-root`` for root and ``--oversubscribe`` when a localhost-only run has more
  ranks than cores;
* hosts with their slots (``-H``/``-hosts host:slots``), or names and one ``-ppn`` where the
  implementation takes no slots; IPv6 literals only through a hostfile (Open MPI 5);
* the environment forwarded by name: ``-x VAR`` each, or one ``-genvlist`` list;
* where the ranks listen: Open MPI's TCP BTL off on one host and bound to ``--network-interface``
  across hosts (:mod:`hvps.runner.mpi_transport`); Hydra's ``-iface`` for its own connections, while the
  ch4:ofi netmod's listener follows ``FI_TCP_IFACE``/``FI_SOCKETS_IFACE``, set from ``--network-interface``.
"""

from __future__ import annotations

import os
import shlex
from typing import Mapping, Optional

from ..core.mpi_env import mpi_defaults
from . import hosts as hostlib
from .errors import LaunchError
from ..core.launchers import MpiImpl, MpiSpec
from .mpi_discovery import MpiLauncher
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
    if not mpi.impl.spec.known:
        known = ", ".join(impl.label for impl in MpiImpl if impl.spec.known)
        raise LaunchError(f"'{mpi.path} --version' names no MPI hvpsrun knows ({known}); "
                          "run mpirun yourself, or use --launcher srun inside Slurm")


def _hosts_args(spec: MpiSpec, mpi: MpiLauncher, hosts: list, hostfile: Optional[str]) -> list:
    """How ``hosts`` (or the hostfile written for them) reach this implementation's launcher."""
    ipv6 = any(h.is_ipv6 for h in hosts)
    if ipv6 and (spec.ipv6_since is None or mpi.version[:len(spec.ipv6_since)] < spec.ipv6_since):
        if spec.ipv6_since is None:
            raise LaunchError(f"{spec.name} takes no IPv6 literals in its host list; name the hosts "
                              "(add them to /etc/hosts) instead")
        raise LaunchError(f"{spec.name} {mpi.version_text} cannot address hosts by IPv6 address (its runtime takes "
                          f"only host names); name them in /etc/hosts or DNS, or use {spec.name} "
                          f"{'.'.join(map(str, spec.ipv6_since))}")
    if hostfile and spec.hostfile_flag:
        return [spec.hostfile_flag, hostfile]
    if not hosts:
        return []
    if ipv6:
        raise LaunchError(f"{spec.name}'s {spec.hosts_flag} cannot carry IPv6 addresses; hvpsrun passes them in a "
                          "hostfile")
    if spec.hosts_flag:
        return [spec.hosts_flag, hostlib.hosts_arg(hosts)]
    slots = {h.slots for h in hosts}
    if len(slots) != 1:
        raise LaunchError(f"{spec.name} needs the same slots on every host with -H; give a machinefile "
                          "through --mpi-args='-machinefile FILE' instead")
    return [spec.hostnames_flag, ",".join(h.name for h in hosts), spec.ppn_flag, str(slots.pop())]


def _forward_args(spec: MpiSpec, names: list) -> list:
    """Variables forwarded to the ranks by name, never with their values on the command line."""
    if spec.env_each:
        return [arg for name in names for arg in (spec.env_each, name)]
    return [spec.env_list, ",".join(names)] if names else []


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

    spec = mpi.impl.spec
    cmd = [mpi.path, spec.np_flag, str(num_proc)]
    if euid == 0:
        cmd += spec.run_as_root
    if local_only and not in_allocation and num_proc > cpu_count:
        cmd += spec.oversubscribe
    cmd += spec.label_output
    cmd += _hosts_args(spec, mpi, hosts, hostfile)
    cmd += spec.no_binding
    if spec.mca_transport:
        cmd += open_mpi_transport_args(mpi.version, one_host, settings.network_interfaces, mpi_args, env)
    if settings.network_interfaces and spec.iface_flag:
        cmd += [spec.iface_flag, settings.network_interfaces[0]]
    cmd += _forward_args(spec, forwarded)
    return cmd + mpi_args + list(settings.command)
