"""``hvpsrun --check-build``: what this installation can use, in horovodrun's layout."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
from typing import Callable, Optional

from .errors import LaunchError
from .mpi_discovery import find_mpirun


def _version(distributions: tuple) -> Optional[str]:
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _mpi4py_library() -> Optional[str]:
    if not _present("mpi4py"):
        return None
    try:
        import mpi4py

        mpi4py.rc.initialize = False  # Get_library_version needs no MPI_Init (which needs HOME on Open MPI 5)
        from mpi4py import MPI

        return MPI.Get_library_version().strip().splitlines()[0]
    except Exception as exc:  # noqa: BLE001 - reported, never fatal
        return f"unusable ({exc})"


def _nccl() -> Optional[str]:
    if not _present("torch"):
        return None
    try:
        import torch

        if torch.cuda.is_available() and torch.distributed.is_nccl_available():
            return ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001
        return None
    return None


def _gloo() -> Optional[str]:
    if not _present("torch"):
        return None
    try:
        import torch.distributed as dist

        return f"torch.distributed {_version(('torch',))}" if dist.is_available() and dist.is_gloo_available() else None
    except Exception:  # noqa: BLE001
        return None


def _mpirun(mpirun: Optional[str], find: Callable) -> Optional[str]:
    """e.g. ``Open MPI 5.0.11 (/w/.venv/bin/mpirun, from the running Python's directory)``; None when absent."""
    try:
        found = find(mpirun)
    except LaunchError:
        return None
    if not found.impl.spec.known:
        return None
    return found.describe()


def collect(mpirun: Optional[str] = None, find: Callable = find_mpirun) -> dict:
    """Facts about this installation (a dict, so it can be tested and printed)."""
    from ..version import __version__

    return {
        "hvps": __version__,
        "frameworks": {
            "PyTorch": _version(("torch",)) if _present("torch") else None,
            "TensorFlow": _version(("tensorflow", "tensorflow-cpu")) if _present("tensorflow") else None,
        },
        "controllers": {
            "MPI": _mpi4py_library(),
        },
        "tensor_operations": {
            "NCCL": _nccl(),
            "Gloo": _gloo(),
            "MPI": _mpi4py_library(),
            "Horovod": _version(("horovod",)) if _present("horovod") else None,
        },
        "launchers": {
            "mpirun": _mpirun(mpirun, find),
            "srun": shutil.which("srun"),
        },
    }


def render(facts: dict) -> str:
    lines = [f"hvps v{facts['hvps']}:", ""]
    titles = {
        "frameworks": "Available Frameworks",
        "controllers": "Available Controllers",
        "tensor_operations": "Available Tensor Operations",
        "launchers": "Available Launchers",
    }
    for key, title in titles.items():
        lines.append(f"{title}:")
        for name, detail in facts[key].items():
            mark = "X" if detail else " "
            lines.append(f"    [{mark}] {name}" + (f" ({detail})" if detail else ""))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def check_build(mpirun: Optional[str] = None) -> str:
    return render(collect(mpirun))
