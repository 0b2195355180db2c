"""Horovod's build and capability queries (``hvd.nccl_built()``, ``hvd.mpi_enabled()``, ...).

Horovod answers what it was compiled with; hvps answers what this process can
use now, which is what scripts that branch on these calls want to know.
"""

from __future__ import annotations

import sys

from . import state as runtime


def _torch_distributed():
    if "torch" not in sys.modules:  # never import torch on behalf of numpy or TensorFlow users
        return None
    import torch.distributed as dist

    return dist if dist.is_available() else None


def mpi_built() -> bool:
    """Whether hvps was built with MPI (Horovod's query).

    Returns:
        Always True: MPI (mpi4py) is hvps's bootstrap and control plane.
    """
    return True


def mpi_enabled() -> bool:
    """Whether collectives may run over MPI.

    Returns:
        True for ``HVPS_BACKEND`` ``mpi`` and ``auto``, False for ``tdist``.
    """
    return runtime.settings().backend in ("mpi", "auto")


def mpi_threads_supported() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE.

    Returns:
        True when ``MPI.Query_thread()`` is ``MPI_THREAD_MULTIPLE``.
    """
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built() -> bool:
    """Whether torch.distributed's gloo is available (for ``HVPS_BACKEND=tdist``).

    Returns:
        True when torch is installed and its gloo backend is available.
    """
    dist = _torch_distributed()
    return bool(dist and dist.is_gloo_available())


def gloo_enabled() -> bool:
    """Whether host buffers go over gloo.

    Returns:
        True for ``HVPS_BACKEND=tdist``.
    """
    return runtime.settings().backend == "tdist"


def nccl_built() -> int:
    """NCCL's version, as Horovod reports it.

    Returns:
        e.g. 22703 for 2.27.3; 0 without CUDA and NCCL.
    """
    dist = _torch_distributed()
    if not dist or not dist.is_nccl_available():
        return 0
    import torch

    if not torch.cuda.is_available():
        return 0
    major, minor, patch = torch.cuda.nccl.version()[:3]
    return major * 10000 + minor * 100 + patch


def cuda_built() -> bool:
    """Whether the loaded PyTorch has CUDA and sees a GPU.

    Returns:
        False when torch is not imported, has no CUDA, or sees no GPU.
    """
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Horovod's ``gpu_available('tensorflow' | 'torch' | 'mxnet')``: whether that framework, already
    imported by this process, sees a GPU (hvps has no compiled extensions to ask; a framework that is
    not imported is never imported here, and answers False).

    Args:
        ext_base_name: the framework, as Horovod names its extension.
        verbose: ignored (Horovod prints why an extension is missing).

    Returns:
        Whether that framework sees a GPU.
    """
    if ext_base_name == "tensorflow" and "tensorflow" in sys.modules:
        return bool(sys.modules["tensorflow"].config.list_physical_devices("GPU"))
    if ext_base_name == "torch":
        return cuda_built()
    return False


def rocm_built() -> bool:
    """Horovod's query whether it was built with ROCm (AMD GPUs).

    Returns:
        False: hvps has no ROCm (AMD GPUs) data plane.
    """
    return False


def ddl_built() -> bool:
    """Horovod's query whether it was built with IBM's DDL.

    Returns:
        False: hvps has no IBM's DDL data plane.
    """
    return False


def ccl_built() -> bool:
    """Horovod's query whether it was built with Intel's oneCCL.

    Returns:
        False: hvps has no Intel's oneCCL data plane.
    """
    return False


__all__ = ["mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
           "cuda_built", "rocm_built", "ddl_built", "ccl_built", "gpu_available"]
