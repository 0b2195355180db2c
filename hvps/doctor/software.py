"""What software a training rank loads, read without importing any framework or starting MPI
(the facts behind ``checks_software``; ``Host.software()`` records them)."""
from __future__ import annotations

import platform
import sys
from importlib import metadata
from typing import Optional

from ..core.launchers import parse_mpi_version, version_text
from ..runner.mpi_discovery import find_mpirun
from ..version import __version__

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
        impl, version = parse_mpi_version(text)
        if impl.spec.known:
            return f"{impl.label} {version_text(version)}"
        return text.splitlines()[0][:60] if text else None
    try:
        found = find_mpirun(None)
        return f"{found.impl.label} {found.version_text}"
    except Exception:
        return None


def probe_software() -> dict:
    """Versions of what a training rank loads (no framework is imported)."""
    facts = {"python": platform.python_version(), "hvps": __version__}
    facts.update({k: _dist_version(v) for k, v in DISTRIBUTIONS.items()})
    facts["mpi"] = mpi_library()
    return facts
