"""NVML (the NVIDIA driver's management library) through ``pynvml``, imported lazily.

``pynvml`` is PyPI's ``nvidia-ml-py`` (hvps's ``gpu`` extra). Nothing here raises on a
machine without a GPU: :func:`open_nvml` returns ``(None, reason)`` and callers report the
reason. Shared by the benchmark's GPU sampler, the Prometheus exporter, the energy meter and
``hvps doctor``.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Tuple

MiB = 1 << 20


def open_nvml() -> Tuple[Optional[Any], Optional[str]]:
    """``(pynvml, None)`` with NVML initialised, or ``(None, why not)``.

    Pair with :func:`close_nvml`; NVML counts its inits, so nested opens are fine.
    """
    try:
        import pynvml
    except ImportError as exc:
        return None, f"pynvml not importable ({exc}); install nvidia-ml-py (hvps's gpu extra)"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        return None, f"NVML: {type(exc).__name__}: {exc}"
    return pynvml, None


def close_nvml(pynvml: Optional[Any]) -> None:
    """Undo one :func:`open_nvml` (ignores errors and ``None``)."""
    if pynvml is None:
        return
    try:
        pynvml.nvmlShutdown()
    except Exception:
        pass


def text(value: Any) -> str:
    """NVML strings come back as bytes from older bindings and str from newer ones."""
    return value.decode() if isinstance(value, bytes) else str(value)


def device_handle(pynvml: Any, cuda_index: int) -> Any:
    """NVML handle of CUDA device ``cuda_index``.

    NVML numbers all GPUs and ignores ``CUDA_VISIBLE_DEVICES``, so match torch's UUID first,
    then the visible-devices entry, then the bare index.
    """
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
    except Exception:  # no torch, no uuid attribute, or NVML does not know it
        pass
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return pynvml.nvmlDeviceGetHandleByIndex(cuda_index)
    entry = visible[cuda_index]
    if entry.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    return pynvml.nvmlDeviceGetHandleByUUID(entry)


def maybe(func: Any, *args: Any) -> Any:
    """``func(*args)``, or None when this GPU or driver does not support the query (NVML raises
    NVMLError_NotSupported and kin; a pynvml without the function passes None). The one "call or None"
    of the exporter's readings and ``hvps doctor``'s GPU facts."""
    if func is None:
        return None
    try:
        return func(*args)
    except Exception:
        return None


def read_device(pynvml: Any, handle: Any) -> dict:
    """One reading of a GPU: utilisation %, memory used/total MiB, temperature C, power W and
    the energy counter in joules since the driver loaded (None where unsupported)."""
    util = maybe(pynvml.nvmlDeviceGetUtilizationRates, handle)
    mem = maybe(pynvml.nvmlDeviceGetMemoryInfo, handle)
    power_mw = maybe(pynvml.nvmlDeviceGetPowerUsage, handle)
    energy_mj = maybe(pynvml.nvmlDeviceGetTotalEnergyConsumption, handle)
    temp = maybe(pynvml.nvmlDeviceGetTemperature, handle, getattr(pynvml, "NVML_TEMPERATURE_GPU", 0))
    return {"utilization_pct": None if util is None else float(util.gpu),
            "memory_used_mib": None if mem is None else mem.used / MiB,
            "memory_total_mib": None if mem is None else mem.total / MiB,
            "temperature_c": None if temp is None else float(temp),
            "power_w": None if power_mw is None else power_mw / 1000.0,
            "energy_j": None if energy_mj is None else energy_mj / 1000.0}
