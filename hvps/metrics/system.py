"""Readings taken when Prometheus scrapes, not by a polling thread: this process's CPU time and
memory, the host's CPU time by mode and memory, and this rank's GPU through NVML.

Linux's ``/proc`` serves the process and host readings; where it is missing (macOS) psutil
does, when installed (hvps's ``dev`` extra); otherwise they are left out.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Iterator, Optional

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..core import devices
from . import nvml

_MODES = ("user", "system", "idle", "iowait", "steal")


def read_proc_self(proc: str = "/proc") -> Optional[dict]:
    """``cpu_seconds``, ``rss_bytes`` and ``threads`` of this process from ``/proc/self/stat``."""
    try:
        with open(f"{proc}/self/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 (state) is fields[0]
    ticks = os.sysconf("SC_CLK_TCK")
    return {"cpu_seconds": (int(fields[11]) + int(fields[12])) / ticks,
            "threads": int(fields[17]),
            "rss_bytes": int(fields[21]) * os.sysconf("SC_PAGE_SIZE")}


def read_proc_host(proc: str = "/proc") -> Optional[dict]:
    """CPU seconds by mode (all CPUs) from ``/proc/stat`` and memory bytes from ``/proc/meminfo``."""
    try:
        with open(f"{proc}/stat") as f:
            cpu = next(line for line in f if line.startswith("cpu "))
        with open(f"{proc}/meminfo") as f:
            meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.strip()}
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    v = [int(x) / ticks for x in cpu.split()[1:9]] + [0.0] * 8
    user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
    return {"cpu_seconds": {"user": user + nice, "system": system + irq + softirq, "idle": idle,
                            "iowait": iowait, "steal": steal},
            "memory_total_bytes": meminfo.get("MemTotal"),
            "memory_available_bytes": meminfo.get("MemAvailable", meminfo.get("MemFree"))}


def _psutil_readings() -> tuple:
    try:
        import psutil
    except ImportError:
        return None, None
    proc = psutil.Process()
    times, mem = proc.cpu_times(), proc.memory_info()
    own = {"cpu_seconds": times.user + times.system, "threads": proc.num_threads(), "rss_bytes": mem.rss}
    cpu, vm = psutil.cpu_times(), psutil.virtual_memory()
    host = {"cpu_seconds": {mode: float(getattr(cpu, mode, 0.0)) for mode in _MODES},
            "memory_total_bytes": vm.total, "memory_available_bytes": vm.available}
    return own, host


class HostCollector:
    """``hvps_process_*{rank}`` and ``hvps_host_*{host}``, read at scrape time."""

    def __init__(self, rank: str, host: str) -> None:
        self.rank, self.host = rank, host

    def collect(self) -> Iterator[Any]:
        own, host = read_proc_self(), read_proc_host()
        if own is None or host is None:
            own, host = _psutil_readings()
        if own is not None:
            cpu = CounterMetricFamily("hvps_process_cpu_seconds", "CPU time (user + system) of this rank's process",
                                      labels=["rank"])
            cpu.add_metric([self.rank], own["cpu_seconds"])
            yield cpu
            for name, key, doc in (("hvps_process_resident_memory_bytes", "rss_bytes", "Resident memory of this rank"),
                                   ("hvps_process_threads", "threads", "Threads of this rank's process")):
                gauge = GaugeMetricFamily(name, doc, labels=["rank"])
                gauge.add_metric([self.rank], own[key])
                yield gauge
        if host is not None:
            cpu = CounterMetricFamily("hvps_host_cpu_seconds", "CPU time of the whole host (all CPUs) by mode",
                                      labels=["host", "mode"])
            for mode, seconds in host["cpu_seconds"].items():
                cpu.add_metric([self.host, mode], seconds)
            yield cpu
            for name, key, doc in (("hvps_host_memory_total_bytes", "memory_total_bytes", "Host memory"),
                                   ("hvps_host_memory_available_bytes", "memory_available_bytes",
                                    "Host memory available to new processes (MemAvailable)")):
                if host[key] is not None:
                    gauge = GaugeMetricFamily(name, doc, labels=["host"])
                    gauge.add_metric([self.host], host[key])
                    yield gauge
        load = GaugeMetricFamily("hvps_host_load1", "Host load average over one minute", labels=["host"])
        load.add_metric([self.host], os.getloadavg()[0])
        yield load


class GpuCollector:
    """``hvps_gpu_*{rank,host,gpu}`` of this rank's GPU through NVML; nothing without one.

    The GPU is the device of the CUDA tensors this rank has submitted (``core/devices.py``), else the
    local rank's (one GPU per rank, pinned by local rank, as Horovod's examples do).
    """

    def __init__(self, rank: str, host: str, local_rank: int) -> None:
        self.rank, self.host, self.local_rank = rank, host, local_rank
        self._lock = threading.Lock()
        self._pynvml: Any = None
        self._opened = False
        #: why no GPU readings are served (None while they are)
        self.reason: Optional[str] = None
        self._handles: dict = {}

    def _cuda_index(self) -> int:
        # Never torch.cuda.current_device(): this runs on the metrics thread, where it is 0 whatever
        # device the rank trains on (issue 43, finding 9).
        index = devices.chosen()
        return self.local_rank if index is None else index

    def _handle(self) -> tuple:
        with self._lock:
            if not self._opened:
                self._opened = True
                self._pynvml, self.reason = nvml.open_nvml()
            if self._pynvml is None:
                return None, None
            index = self._cuda_index()
            if index not in self._handles:
                try:
                    self._handles[index] = nvml.device_handle(self._pynvml, index)
                except Exception as exc:  # no such device
                    self.reason = f"NVML has no device for CUDA index {index}: {exc}"
                    self._handles[index] = None
            return index, self._handles[index]

    def collect(self) -> Iterator[Any]:
        index, handle = self._handle()
        if handle is None:
            return
        reading = nvml.read_device(self._pynvml, handle)
        labels = [self.rank, self.host, str(index)]
        mib = float(nvml.MiB)
        for name, key, scale, doc in (
                ("hvps_gpu_utilization_percent", "utilization_pct", 1.0, "GPU utilisation (NVML, % of time busy)"),
                ("hvps_gpu_memory_used_bytes", "memory_used_mib", mib, "GPU memory used"),
                ("hvps_gpu_memory_total_bytes", "memory_total_mib", mib, "GPU memory"),
                ("hvps_gpu_temperature_celsius", "temperature_c", 1.0, "GPU temperature"),
                ("hvps_gpu_power_watts", "power_w", 1.0, "GPU power draw")):
            if reading[key] is not None:
                gauge = GaugeMetricFamily(name, doc, labels=["rank", "host", "gpu"])
                gauge.add_metric(labels, reading[key] * scale)
                yield gauge
        if reading["energy_j"] is not None:
            energy = CounterMetricFamily("hvps_gpu_energy_joules", "GPU energy since the driver loaded (NVML)",
                                         labels=["rank", "host", "gpu"])
            energy.add_metric(labels, reading["energy_j"])
            yield energy

    def close(self) -> None:
        with self._lock:
            nvml.close_nvml(self._pynvml)
            self._pynvml, self._handles, self._opened = None, {}, True
