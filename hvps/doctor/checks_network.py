"""Network checks: the interface the control plane and MPI use, RDMA devices, whether NCCL
and hvps were told the same interface, and where Open MPI's TCP transport listens."""
from __future__ import annotations

from typing import Optional

from ..core.launchers import MPI_LAUNCH_VARIABLES
from ..core.settings import env_text
from ..runner.mpi_transport import mca_value, tcp_btl_on
from .base import Check, Context, check
from .host import Host

SPEED_WARN_MBPS = 10_000


def control_interface(host: Host) -> tuple:
    """``(name, address, how)``: the interface hvps's control plane will use, as the control plane itself
    chooses it (:func:`hvps.control.plane.candidate_addresses`, through :meth:`Host.control_addresses`):
    HVPS_CONTROL_ADDR, else HVPS_NETWORK_INTERFACE's address, else the lowest non-loopback address,
    loopback last. ``name`` is None when no interface here holds the address."""
    addrs = host.interface_addresses()
    control = host.control_addresses()
    explicit = env_text("HVPS_CONTROL_ADDR", env=host.env)
    wanted = env_text("HVPS_NETWORK_INTERFACE", env=host.env)
    if "error" in control:
        return wanted, None, "HVPS_NETWORK_INTERFACE"
    chosen = (control.get("addresses") or [None])[0]
    if chosen is None:
        return None, None, "no interface has an IPv4 address"
    name = next((n for n in sorted(addrs) if addrs[n] == chosen), None)
    if explicit:
        return name, chosen, "HVPS_CONTROL_ADDR"
    if wanted:
        return wanted, chosen, "HVPS_NETWORK_INTERFACE"
    return name, chosen, "first non-loopback address (control plane's rule)"


def nccl_matches(spec: str, name: str) -> bool:
    """Whether NCCL_SOCKET_IFNAME ``spec`` selects interface ``name`` (prefixes; ``=`` exact; ``^`` excludes)."""
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    items = [s for s in spec.lstrip("=").split(",") if s]
    hit = any(name == s if exact else name.startswith(s) for s in items)
    return hit != exclude


@check("net.interface", "network")
def interface(host: Host, ctx: Context) -> Check:
    why = ("the control plane and MPI's TCP transport run over this interface; a 1 GbE link moves a 100 MB "
           "gradient set in about a second, and a wrong MTU between hosts drops large packets")
    name, addr, how = control_interface(host)
    if name is None and addr is not None:  # HVPS_CONTROL_ADDR names an address no interface here holds
        return Check("net.interface", "warn", f"{addr} ({how}): no interface of this host holds it", why + "; "
                     "the other ranks connect to it, so it must lead here (a NAT or a name that resolves here)",
                     "unset HVPS_CONTROL_ADDR, or set it to this host's address on the training network",
                     {"name": None, "address": addr})
    if name is None:
        return Check("net.interface", "fail", how, why, "bring up a network interface with an IPv4 address")
    if addr is None:
        return Check("net.interface", "fail", f"{name}: no IPv4 address ({how})", why,
                     "set HVPS_NETWORK_INTERFACE (hvpsrun --network-interface) to an interface that exists here")
    base = f"/sys/class/net/{name}"
    mtu, speed = host.read_int(base + "/mtu"), host.read_int(base + "/speed")
    state = host.read(base + "/operstate")
    value = (f"{name} {addr} mtu {mtu if mtu is not None else '?'} speed "
             f"{f'{speed} Mb/s' if speed and speed > 0 else 'unknown'} ({how})")
    data = {"name": name, "address": addr, "mtu": mtu, "speed_mbps": speed}
    if addr.startswith("127."):
        if ctx.multi_host:
            return Check("net.interface", "fail", value, why + "; other hosts cannot reach a loopback address",
                         "hvpsrun --network-interface NIC with an interface every host can reach", data)
        return Check("net.interface", "ok", value, why + " (loopback: fine on one host)", data=data)
    if state == "down":
        return Check("net.interface", "fail", value + " DOWN", why, f"ip link set {name} up", data)
    if (speed and 0 < speed < SPEED_WARN_MBPS) or (mtu is not None and mtu < 1500):
        return Check("net.interface", "warn", value, why, "use a faster interface for training traffic "
                     "(hvpsrun --network-interface NIC); MTU at least 1500, the same on every host", data)
    return Check("net.interface", "ok", value, why, data=data)


@check("net.rdma", "network")
def rdma(host: Host, ctx: Context) -> Check:
    why = "InfiniBand or RoCE lets NCCL and MPI bypass TCP; a device whose ports are down is silently unused"
    devices = [p.rsplit("/", 1)[1] for p in host.glob("/sys/class/infiniband/*")]
    if not devices:
        return Check("net.rdma", "ok", "none (MPI and NCCL use TCP sockets)", why)
    ports, active = [], 0
    for dev in devices:
        for port in host.glob(f"/sys/class/infiniband/{dev}/ports/*"):
            state = (host.read(port + "/state") or "?").split(":")[-1].strip()
            layer = host.read(port + "/link_layer") or "?"
            rate = host.read(port + "/rate") or "?"
            active += state == "ACTIVE"
            ports.append(f"{dev}/{port.rsplit('/', 1)[1]} {'RoCE' if layer == 'Ethernet' else layer} {state} {rate}")
    value = "; ".join(ports) or ", ".join(devices) + " (no ports)"
    if active:
        return Check("net.rdma", "ok", value, why, data={"active_ports": active})
    return Check("net.rdma", "warn", value, why, "check cabling and the subnet manager (ibstat); "
                 "NCCL_IB_DISABLE=1 states the TCP fallback explicitly", {"active_ports": 0})


@check("net.ifname", "network")
def ifname(host: Host, ctx: Context) -> Check:
    why = ("NCCL (NCCL_SOCKET_IFNAME) and hvps's control plane (HVPS_NETWORK_INTERFACE) pick interfaces "
           "independently; when they disagree, or name one that is missing, ranks wait on each other forever")
    nccl: Optional[str] = host.env.get("NCCL_SOCKET_IFNAME")
    hvps_nic: Optional[str] = host.env.get("HVPS_NETWORK_INTERFACE")
    value = f"NCCL_SOCKET_IFNAME={nccl or '(unset)'} HVPS_NETWORK_INTERFACE={hvps_nic or '(unset)'}"
    fix = "hvpsrun --network-interface NIC sets both consistently"
    present = [p.rsplit("/", 1)[1] for p in host.glob("/sys/class/net/*")]
    if hvps_nic and present and hvps_nic not in present:
        return Check("net.ifname", "fail", value, why + f"; {hvps_nic} does not exist here", fix)
    if nccl and present and not nccl.startswith("^") and not any(nccl_matches(nccl, n) for n in present):
        return Check("net.ifname", "fail", value, why + "; NCCL_SOCKET_IFNAME matches no interface here", fix)
    if nccl and hvps_nic and not nccl_matches(nccl, hvps_nic):
        return Check("net.ifname", "fail", value, why + f"; NCCL_SOCKET_IFNAME does not select {hvps_nic}", fix)
    if bool(nccl) != bool(hvps_nic):
        return Check("net.ifname", "warn", value, why + "; only one of them is set", fix)
    return Check("net.ifname", "ok", value, why)


#: what marks a process started by an MPI launcher (the table's rank variables, and PMIx's)
MPI_JOB_ENV = MPI_LAUNCH_VARIABLES


def open_mpi_param(host: Host, name: str) -> Optional[str]:
    """An Open MPI MCA parameter as its processes read it: ``OMPI_MCA_<name>`` (mpirun passes its
    ``--mca`` flags to the ranks this way), else ``$HOME/.openmpi/mca-params.conf``; None if unset."""
    value = mca_value(name, [], host.env)
    if value is not None or not host.env.get("HOME"):
        return value
    for line in (host.read(f"{host.env['HOME']}/.openmpi/mca-params.conf") or "").splitlines():
        key, sep, rest = line.split("#", 1)[0].partition("=")
        if sep and key.strip() == name:
            value = rest.strip()
    return value


@check("net.mpi_tcp", "network")
def mpi_tcp(host: Host, ctx: Context) -> Check:
    why = ("Open MPI's TCP BTL listens in every rank on every interface (0.0.0.0 and [::]); one connection that "
           "sends a few bytes and stays open freezes every collective of the job for as long as it is held "
           "(SECURITY.md)")
    fix = ("one host: start the job with hvpsrun (it passes --mca btl self,sm) or set OMPI_MCA_btl=self,sm "
           "(Open MPI 4.1: self,vader); across hosts: hvpsrun --network-interface NIC (btl_tcp_if_include) on a "
           "training network that only the job's hosts can reach")
    mpi = host.software().get("mpi") or ""
    if mpi and "Open MPI" not in mpi:
        return Check("net.mpi_tcp", "skip", f"{mpi}: not Open MPI", why + "; MPICH's ch4:ofi netmod binds one "
                     "interface's address, chosen by libfabric (FI_TCP_IFACE, FI_SOCKETS_IFACE: hvpsrun "
                     "--network-interface sets them)")
    btl, include = open_mpi_param(host, "btl"), open_mpi_param(host, "btl_tcp_if_include")
    data = {"btl": btl, "btl_tcp_if_include": include}
    if not tcp_btl_on(btl):
        return Check("net.mpi_tcp", "ok", f"TCP BTL off (btl={btl})", why, data=data)
    shown = f"btl={btl or '(default: every component)'}"
    if include:
        return Check("net.mpi_tcp", "ok", f"{shown}, btl_tcp_if_include={include}", why + "; its traffic stays on "
                     f"{include}, but the listening socket still binds every address (Open MPI 5.0.11): keep the "
                     "training network isolated", data=data)
    if ctx.world_size > 1 or ctx.multi_host or btl is not None or any(k in host.env for k in MPI_JOB_ENV):
        return Check("net.mpi_tcp", "warn", f"{shown}, btl_tcp_if_include unset: listens on every interface",
                     why, fix, data)
    return Check("net.mpi_tcp", "ok", "not in an MPI job (hvpsrun keeps the TCP BTL off on one host and binds it to "
                 "--network-interface across hosts)", why, data=data)
