"""GPU memory and utilisation for the benchmark JSON.

NVML is read through ``pynvml`` (PyPI ``nvidia-ml-py``, hvps's ``gpu`` extra),
imported lazily. Nothing here raises: when pynvml is missing, NVML finds no
driver, or the GPU cannot be matched, the NVML fields are None and
``nvml_reason`` says why. PyTorch's own peak allocation is reported beside
NVML's view (which counts every process on the GPU and the CUDA context).
"""
from __future__ import annotations

import statistics
import threading
from typing import Any

from hvps.metrics.nvml import MiB, close_nvml, device_handle, open_nvml, text


class NvmlSampler:
    """Samples one GPU's memory use and utilisation every ``interval_s`` in a
    background thread between ``start()`` and ``stop()`` (NVML's utilisation is the
    share of the last sample period in which a kernel ran, so one reading at the
    end would miss the run). ``stop()`` returns the summary fields."""

    def __init__(self, cuda_index: int, interval_s: float = 0.5) -> None:
        self.cuda_index, self.interval_s = cuda_index, interval_s
        self.reason: str | None = None
        self.mem_used: list[float] = []
        self.util: list[float] = []
        self.total_mib: float | None = None
        self.name: str | None = None
        self._nvml = self._handle = self._thread = None
        self._stop = threading.Event()
        pynvml, self.reason = open_nvml()
        if pynvml is None:
            return
        self._nvml = pynvml
        try:
            self._handle = device_handle(pynvml, cuda_index)
            self.name = text(pynvml.nvmlDeviceGetName(self._handle))
            self.total_mib = pynvml.nvmlDeviceGetMemoryInfo(self._handle).total / MiB
        except Exception as exc:  # pynvml.NVMLError and its subclasses, IndexError
            self.reason = f"NVML: {type(exc).__name__}: {exc}"
            self._handle = None

    def _sample(self) -> None:
        try:
            self.mem_used.append(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / MiB)
            self.util.append(float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))
        except Exception as exc:
            self.reason = self.reason or f"NVML sample: {type(exc).__name__}: {exc}"

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> NvmlSampler:
        if self._handle is not None and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._sample()  # the last period, just before the run's end
        close_nvml(self._nvml)
        self._nvml = None
        ok = bool(self.util)
        return {"nvml_name": self.name,
                "memory_used_mib": max(self.mem_used) if self.mem_used else None,
                "memory_total_mib": self.total_mib,
                "utilization_pct": statistics.fmean(self.util) if ok else None,
                "utilization_pct_max": max(self.util) if ok else None,
                "nvml_samples": len(self.util),
                "nvml_reason": None if ok else (self.reason or "no NVML sample taken (run shorter than one interval)")}


def cuda_report(device: Any, sampler: NvmlSampler | None) -> dict[str, Any]:
    """PyTorch's view of ``device`` (name, peak allocated and reserved MiB) plus the
    sampler's NVML summary: memory used (peak over samples) and total, utilisation
    (mean and peak over samples)."""
    import torch

    out: dict[str, Any] = {"device": str(device), "name": torch.cuda.get_device_name(device),
                           "torch_max_memory_allocated_mib": torch.cuda.max_memory_allocated(device) / MiB,
                           "torch_max_memory_reserved_mib": torch.cuda.max_memory_reserved(device) / MiB}
    out.update(sampler.stop() if sampler is not None else {"nvml_reason": "not sampled"})
    return out
