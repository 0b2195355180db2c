"""Software versions: one row locally; across ranks the report flags any component that differs
(mismatched torch, MPI or NCCL between ranks is a classic cause of hangs)."""
from __future__ import annotations

import platform
import re
import sys
from importlib import metadata
from typing import Optional

from .base import Check, Context, check
from .host import Host

#: component -> distributions that provide it, first installed wins
DISTRIBUTIONS = {"torch": ("torch",), "tensorflow": ("tensorflow", "tensorflow-cpu"), "mpi4py": ("mpi4py",),
                 "numpy": ("numpy",)}


def _dist_version(names: tuple) -> Optional[str]:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def mpi_library() -> Optional[str]:
    """The MPI library: from mpi4py when MPI is already initialised (under --all-ranks), else from the
    mpirun hvpsrun would use (``mpirun --version``); importing mpi4py.MPI here would start MPI."""
    if "mpi4py.MPI" in sys.modules:
        text = sys.modules["mpi4py.MPI"].Get_library_version().strip(" \n\x00")
        m = re.match(r"(Open MPI|MPICH|Intel\(R\) MPI Library)\D*?([0-9][0-9.]*)", text)
        if m:
            return f"{'Intel MPI' if m.group(1).startswith('Intel') else m.group(1)} {m.group(2).rstrip('.')}"
        return text.splitlines()[0][:60] if text else None
    try:
        from ..runner.mpi_discovery import find_mpirun

        found = find_mpirun(None)
        return f"{found.impl.value} {found.version_text}"
    except Exception:
        return None


def probe_software() -> dict:
    """Versions of what a training rank loads (no framework is imported)."""
    from ..version import __version__

    facts = {"python": platform.python_version(), "hvps": __version__}
    facts.update({k: _dist_version(v) for k, v in DISTRIBUTIONS.items()})
    facts["mpi"] = mpi_library()
    return facts


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
