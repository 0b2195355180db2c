"""Network checks: the interface the control plane and MPI use, RDMA devices, and whether NCCL
and hvps were told the same interface."""
from __future__ import annotations

from typing import Optional

from .base import Check, Context, check
from .host import Host

SPEED_WARN_MBPS = 10_000


def control_interface(host: Host) -> tuple:
    """``(name, address, how)``: the interface hvps's control plane will use, by the rule of
    :func:`hvps.control.candidate_addresses` (HVPS_NETWORK_INTERFACE, else the lowest
    non-loopback address, loopback last)."""
    addrs = host.interface_addresses()
    wanted = host.env.get("HVPS_NETWORK_INTERFACE")
    if wanted:
        return wanted, addrs.get(wanted), "HVPS_NETWORK_INTERFACE"
    if not addrs:
        return None, None, "no interface has an IPv4 address"
    name = min(addrs, key=lambda n: (addrs[n].startswith("127."), addrs[n]))
    return name, addrs[name], "first non-loopback address (control plane's rule)"


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
