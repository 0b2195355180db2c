"""Energy of a measured phase: joules, average watts and joules per image.

Energy-aware training (choosing batch sizes, clocks or placement by what they cost in energy) starts
with knowing what a step costs. Counters, not power samples, give it exactly: on a GPU, NVML's energy
counter (millijoules since the driver loaded); on a CPU, Intel/AMD RAPL through Linux's powercap
(``/sys/class/powercap/intel-rapl:N/energy_uj``, one counter per package, wrapping at
``max_energy_range_uj``). Where neither is readable (no GPU, a VM without RAPL, or
``energy_uj`` readable by root only as since Linux 5.10), the result is ``None`` with the
reason, never a guess.

RAPL counts a whole package, whichever process runs on it: with several ranks on a host, one
meter per host (local rank 0) reads it and :func:`combine` adds hosts and GPUs up.

    meter = EnergyMeter(cuda_index=None).start()
    ...                                  # the timed phase
    reading = meter.stop(images=n)       # {"joules", "watts", "joules_per_image", ...}
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, Optional

from . import nvml

POWERCAP = "/sys/class/powercap"
#: a top-level RAPL domain (a package, or psys): not a subdomain such as intel-rapl:0:1 (core,
#: uncore, dram), which its package already counts, nor intel-rapl-mmio, which repeats one
_TOP_LEVEL = re.compile(r"^intel-rapl:\d+$")


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read().strip())


def rapl_domains(root: str = POWERCAP) -> tuple:
    """``([(directory, name, max_energy_range_uj)], None)`` for the domains to add up, or
    ``([], reason)``.

    Packages are summed; a ``psys`` (platform) domain, which already includes them, is used
    only where no package domain exists.
    """
    try:
        entries = sorted(e for e in os.listdir(root) if _TOP_LEVEL.match(e))
    except FileNotFoundError:
        return [], f"no {root} (no RAPL powercap driver here, e.g. a VM or a non-x86 host)"
    except OSError as exc:
        return [], f"cannot list {root}: {exc}"
    if not entries:
        return [], f"{root} has no intel-rapl:N package domains"
    domains = []
    for entry in entries:
        path = os.path.join(root, entry)
        try:
            with open(os.path.join(path, "name")) as f:
                name = f.read().strip()
            domains.append((path, name, _read_int(os.path.join(path, "max_energy_range_uj"))))
        except (OSError, ValueError) as exc:
            return [], f"cannot read {path}: {exc}"
    packages = [d for d in domains if d[1].startswith("package")]
    return (packages or domains), None


def read_rapl(domains: list) -> tuple:
    """``([energy_uj per domain], None)`` or ``(None, reason)``."""
    values = []
    for path, _, _ in domains:
        try:
            values.append(_read_int(os.path.join(path, "energy_uj")))
        except PermissionError:
            return None, (f"{path}/energy_uj is not readable by this user (root only since Linux 5.10; "
                          "run as root or make it readable)")
        except (OSError, ValueError) as exc:
            return None, f"cannot read {path}/energy_uj: {exc}"
    return values, None


def rapl_joules(domains: list, before: list, after: list) -> float:
    """Joules between two readings, adding ``max_energy_range_uj`` where a counter wrapped
    (once at most: read more often than the counter's range lasts, minutes at full power)."""
    total = 0
    for (_, _, max_range), start, end in zip(domains, before, after):
        total += end - start if end >= start else end + max_range - start
    return total / 1e6


def _result(joules: Optional[float], seconds: float, images: Optional[int], source: Optional[str],
            reason: Optional[str], **extra: Any) -> dict:
    ok = joules is not None
    return {"joules": joules, "seconds": seconds, "images": images,
            "watts": joules / seconds if ok and seconds > 0 else None,
            "joules_per_image": joules / images if ok and images else None,
            "source": source, "reason": None if ok else reason, **extra}


class EnergyMeter:
    """Energy between ``start()`` and ``stop()`` of this rank's GPU (``cuda_index``) or, on a CPU
    run, of this host's RAPL packages (read only where ``reads_host``: one rank per host)."""

    def __init__(self, cuda_index: Optional[int] = None, powercap_root: str = POWERCAP,
                 reads_host: bool = True) -> None:
        self.cuda_index, self.root, self.reads_host = cuda_index, powercap_root, reads_host
        self._started = 0.0
        self._before: Any = None
        self._reason: Optional[str] = None
        self._pynvml: Any = None
        self._handle: Any = None
        self._domains: list = []
        self.source = "nvml" if cuda_index is not None else "rapl"

    def start(self) -> "EnergyMeter":
        self._reason, self._before = None, None
        if self.cuda_index is not None:
            self._pynvml, self._reason = nvml.open_nvml()
            if self._pynvml is not None:
                try:
                    self._handle = nvml.device_handle(self._pynvml, self.cuda_index)
                    self._before = nvml.read_device(self._pynvml, self._handle)["energy_j"]
                except Exception as exc:  # NVML does not know the device
                    self._reason = f"NVML: no device for CUDA index {self.cuda_index}: {exc}"
                if self._before is None and self._reason is None:
                    self._reason = "NVML has no energy counter for this GPU (nvmlDeviceGetTotalEnergyConsumption: Volta or newer)"
        elif self.reads_host:
            self._domains, self._reason = rapl_domains(self.root)
            if self._domains:
                self._before, self._reason = read_rapl(self._domains)
        self._started = time.perf_counter()
        return self

    def stop(self, images: Optional[int] = None) -> dict:
        """``{joules, watts, joules_per_image, seconds, images, source, reason}`` since ``start()``;
        a rank that leaves the host's counters to another adds ``counted_elsewhere: True``."""
        seconds = time.perf_counter() - self._started
        if self.cuda_index is None and not self.reads_host:
            return _result(None, seconds, images, "rapl", "the host's RAPL counters are read by local rank 0",
                           counted_elsewhere=True)
        joules, reason = None, self._reason
        if self._before is not None:
            if self.cuda_index is not None:
                after = nvml.read_device(self._pynvml, self._handle)["energy_j"]
                joules = None if after is None else after - self._before
                reason = "NVML energy counter stopped answering" if after is None else None
            else:
                after, reason = read_rapl(self._domains)
                joules = None if after is None else rapl_joules(self._domains, self._before, after)
        if self._pynvml is not None:
            nvml.close_nvml(self._pynvml)
            self._pynvml = self._handle = None
        if joules is not None:
            source = "nvml" if self.cuda_index is not None else "rapl:" + "+".join(d[1] for d in self._domains)
        else:
            source = None
        return _result(joules, seconds, images, source, reason)


def combine(readings: list, images: Optional[int]) -> dict:
    """One result from every rank's reading of the same phase: the GPUs' and hosts' joules added
    (readings ``counted_elsewhere`` skipped), watts over the longest rank's time."""
    readings = [r for r in readings if r is not None]
    counted = [r for r in readings if not r.get("counted_elsewhere")]
    if not counted:
        return _result(None, 0.0, images, None, "energy was not measured")
    seconds = max(r["seconds"] for r in counted)
    missing = [r for r in counted if r["joules"] is None]
    if missing:
        return _result(None, seconds, images, None, missing[0]["reason"])
    sources = sorted({r["source"] for r in counted})
    return _result(sum(r["joules"] for r in counted), seconds, images, ",".join(sources), None)


def pool(results: list) -> dict:
    """Several phases' combined results as one (joules, seconds and images added)."""
    results = [r for r in results if r is not None]
    if not results:
        return _result(None, 0.0, None, None, "energy was not measured")
    seconds = sum(r["seconds"] for r in results)
    images = sum(r["images"] or 0 for r in results) or None
    missing = [r for r in results if r["joules"] is None]
    if missing:
        return _result(None, seconds, images, None, missing[0]["reason"])
    return _result(sum(r["joules"] for r in results), seconds, images, results[0]["source"], None)
