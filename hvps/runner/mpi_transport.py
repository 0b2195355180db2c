"""Where Open MPI's TCP transport listens: the launcher chooses it.

Open MPI's TCP BTL opens a listening socket in every rank on every interface (0.0.0.0 and
[::]); its accept handler reads the peer's handshake with a blocking read inside the progress
engine, so one stray connection that sends 3 bytes and stays open freezes every collective of
that rank for as long as it is held (benchmarks/RESULTS.md, "Open MPI's TCP port"). hvpsrun
therefore:

* keeps the TCP BTL off when every rank is on this host: shared memory and self only
  (``self,sm`` on Open MPI 5; ``self,vader`` on 4.1, whose ``sm`` is only a stub that names
  vader); no rank then listens for MPI traffic at all;
* binds it to the training interface across hosts (``btl_tcp_if_include``, from
  ``--network-interface``, as the control plane binds to ``HVPS_NETWORK_INTERFACE``), and
  warns when it was given no interface. That keeps MPI's traffic on the interface; the
  listening socket itself still binds every address (Open MPI 5.0.11, measured), so the
  training network must be isolated (SECURITY.md).
* binds the runtime's out-of-band wiring (mpirun to its daemons, ``oob_tcp_if_include``) to the
  same interfaces, loopback ones left out: PRRTE (Open MPI 5) refuses a loopback interface named
  there on a host that has any other ("No network interfaces were found for out-of-band
  communications", measured with 5.0.11), and neither version needs one (on a host with loopback
  only, both wire their daemons over it unasked: measured in a network namespace).

The user's own choice wins: an MCA parameter already named in ``--mpi-args`` or set as
``OMPI_MCA_<name>`` in the environment is never given a second value (prterun refuses a
command line that sets one parameter twice, and a flag would override the environment).
"""

from __future__ import annotations

import sys
from typing import Mapping, Optional, Sequence

#: mpirun flags that set an MCA parameter (Open MPI 4.1's and 5's spellings)
MCA_FLAGS = ("--mca", "-mca", "--gmca", "-gmca", "--omca", "-omca", "--prtemca", "-prtemca")
#: mpirun flags that name hosts (so "no -H given" does not mean "this host only")
HOST_FLAGS = ("-H", "--host", "-host", "--hostfile", "-hostfile", "--machinefile", "-machinefile",
              "--default-hostfile", "-default-hostfile")
#: environment variables that give Open MPI a default hostfile
HOSTFILE_ENV = ("OMPI_MCA_orte_default_hostfile", "OMPI_MCA_prte_default_hostfile", "PRTE_MCA_prte_default_hostfile")
#: Linux's IFF_LOOPBACK bit of /sys/class/net/<name>/flags
IFF_LOOPBACK = 0x8


def is_loopback(name: str) -> bool:
    """Whether network interface ``name`` is a loopback interface (by its flags when this host has it, else
    by the name ``lo``)."""
    try:
        with open(f"/sys/class/net/{name}/flags") as flags:
            return bool(int(flags.read(), 16) & IFF_LOOPBACK)
    except (OSError, ValueError):
        return name == "lo"


def shared_memory_btls(version: tuple) -> str:
    """The ``btl`` value for ranks that all share one host: self and shared memory."""
    return "self,sm" if tuple(version[:1]) >= (5,) else "self,vader"


def mca_value(name: str, mpi_args: Sequence[str], env: Mapping[str, str]) -> Optional[str]:
    """MCA parameter ``name`` as set by ``--mpi-args`` (which wins) or ``OMPI_MCA_<name>``; None if unset."""
    for i, flag in enumerate(mpi_args[:-2]):
        if flag in MCA_FLAGS and mpi_args[i + 1] == name:
            return mpi_args[i + 2]
    return env.get(f"OMPI_MCA_{name}")


def tcp_btl_on(btl: Optional[str]) -> bool:
    """Whether a ``btl`` value (None: Open MPI's default, every component) includes the TCP BTL."""
    if btl is None:
        return True
    names = btl.lstrip("^").split(",")
    return ("tcp" not in names) if btl.startswith("^") else ("tcp" in names)


def names_hosts(mpi_args: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether hosts come from somewhere other than hvpsrun's -H/--hostfile (mpirun flags, a default hostfile)."""
    long_forms = tuple(f + "=" for f in HOST_FLAGS if f.startswith("--"))
    return any(a in HOST_FLAGS or a.startswith(long_forms) for a in mpi_args) or any(env.get(k) for k in HOSTFILE_ENV)


def single_node_allocation(env: Mapping[str, str]) -> bool:
    """Inside a Slurm allocation of exactly one node."""
    return (env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")) == "1"


def open_mpi_transport_args(version: tuple, one_host: bool, nics: Sequence[str], mpi_args: Sequence[str],
                            env: Mapping[str, str]) -> list:
    """The ``--mca`` flags that decide where Open MPI listens (see the module docstring)."""
    args: list = []
    if one_host and not names_hosts(mpi_args, env) and mca_value("btl", mpi_args, env) is None:
        args += ["--mca", "btl", shared_memory_btls(version)]
    wanted = {"btl_tcp_if_include": list(nics), "oob_tcp_if_include": [n for n in nics if not is_loopback(n)]}
    for name, names in wanted.items():
        if names and mca_value(name, mpi_args, env) is None:
            args += ["--mca", name, ",".join(names)]
    return args


def exposure_warning(one_host: bool, nics: Sequence[str], mpi_args: Sequence[str],
                     env: Mapping[str, str]) -> Optional[str]:
    """A one-line warning when the ranks' TCP BTL will listen on every interface of their hosts."""
    if (one_host and not names_hosts(mpi_args, env)) or nics or not tcp_btl_on(mca_value("btl", mpi_args, env)):
        return None
    if any(mca_value(n, mpi_args, env) is not None for n in ("btl_tcp_if_include", "btl_tcp_if_exclude")):
        return None
    return ("Open MPI's TCP transport will listen on and use every interface of every host, and one stray "
            "connection to it freezes the job (SECURITY.md); name the training interface (hvpsrun "
            "--network-interface NIC; NIC=... for the jobs/ recipes) and keep that network isolated")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m hvps.runner.mpi_transport``: print the transport flags for a plain ``mpirun`` line
    (the jobs/mpirun recipes), by the rule hvpsrun uses; nothing for an MPI other than Open MPI."""
    import argparse
    import os
    import shlex

    from .mpi_discovery import find_mpirun

    p = argparse.ArgumentParser(prog="python -m hvps.runner.mpi_transport", description=main.__doc__)
    p.add_argument("--mpirun", help="the mpirun the line starts (default: hvpsrun's choice)")
    p.add_argument("--one-host", action="store_true", help="every rank runs on this host")
    p.add_argument("--nic", default="", help="training interface(s) across hosts, comma-separated")
    p.add_argument("--mpi-args", default="", help="the line's other mpirun flags (a parameter they set is left alone)")
    args = p.parse_args(argv)
    mpi = find_mpirun(args.mpirun)
    if not mpi.impl.spec.mca_transport:
        return 0
    nics = [n for n in args.nic.split(",") if n]
    mpi_args = shlex.split(args.mpi_args)
    warning = exposure_warning(args.one_host, nics, mpi_args, os.environ)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    print(shlex.join(open_mpi_transport_args(mpi.version, args.one_host, nics, mpi_args, os.environ)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
