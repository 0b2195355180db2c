"""Software versions: one row locally; across ranks the report flags any component that differs
(mismatched torch, MPI or NCCL between ranks is a classic cause of hangs)."""
from __future__ import annotations

from .base import Check, Context, check
from .host import Host


@check("software", "software", mismatch="fail")
def software(host: Host, ctx: Context) -> Check:
    why = ("every rank must run the same hvps, framework, MPI and NCCL: a mismatch changes wire formats or "
           "collective algorithms and shows up as a hang, not an error")
    facts = dict(host.software())
    nccl = (host.gpus() or {}).get("nccl")
    if nccl:
        facts["nccl"] = nccl
    if not facts:
        return Check("software", "skip", "unknown", why)
    value = ", ".join(f"{k} {v}" for k, v in facts.items() if v)
    if not facts.get("torch") and not facts.get("tensorflow"):
        return Check("software", "warn", value, why + "; neither torch nor tensorflow is installed",
                     "pip install 'hvps[torch]' (or [tensorflow])", facts)
    return Check("software", "ok", value, why, data=facts)


@check("os", "software")
def operating_system(host: Host, ctx: Context) -> Check:
    why = "the distribution and kernel; under --all-ranks a node that differs from the rest stands out"
    pretty = None
    for line in (host.read("/etc/os-release") or "").splitlines():
        key, _, val = line.partition("=")
        if key == "PRETTY_NAME":
            pretty = val.strip().strip('"')
    kernel = host.read("/proc/sys/kernel/osrelease")
    if not pretty and not kernel:
        return Check("os", "skip", "unknown", why + " (no /etc/os-release or /proc/sys/kernel/osrelease here)")
    return Check("os", "ok", f"{pretty or '?'}, kernel {kernel or '?'}", why)
