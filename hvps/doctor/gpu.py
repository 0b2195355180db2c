"""GPU facts for ``hvps doctor``: NVML (through :mod:`hvps.metrics.nvml`), else ``nvidia-smi``, plus the CUDA
runtime torch was built with and NCCL's version. Returns plain dicts so a fake tree can hold them."""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Optional

from ..metrics import nvml

COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}
#: NVML clock event (throttle) bits that mean the hardware is slowing itself down
BAD_THROTTLE = {0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "power_brake"}
#: nvmlDeviceGetTopologyCommonAncestor levels as nvidia-smi topo -m names them
TOPO_LEVELS = {0: "SAME", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
SMI_FIELDS = ("index", "name", "driver_version", "persistence_mode", "compute_mode", "ecc.mode.current",
              "retired_pages.pending", "clocks.sm", "clocks.max.sm", "power.limit", "power.default_limit",
              "pci.bus_id")


def torch_cuda_version() -> Optional[str]:
    """The CUDA runtime torch was built with, read from torch/version.py without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(list(spec.submodule_search_locations)[0]) / "version.py").read_text()
    except OSError:
        return None
    m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([0-9.]+)['\"]", text, re.M)
    return m.group(1) if m else None


def nccl_version() -> Optional[str]:
    """NCCL's version from torch (only when torch sees a GPU)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        v = torch.cuda.nccl.version()
    except Exception:
        return None
    if isinstance(v, int):  # old torch: 2708 -> 2.7.8
        return f"{v // 1000}.{v % 1000 // 100}.{v % 100}"
    return ".".join(map(str, v))


def _nvml_device(p: Any, i: int) -> tuple:
    h = p.nvmlDeviceGetHandleByIndex(i)
    ecc = nvml.maybe(p.nvmlDeviceGetEccMode, h)
    remap = nvml.maybe(p.nvmlDeviceGetRemappedRows, h)
    reasons = nvml.maybe(getattr(p, "nvmlDeviceGetCurrentClocksEventReasons", None)
                    or getattr(p, "nvmlDeviceGetCurrentClocksThrottleReasons", None), h) or 0
    retired = nvml.maybe(p.nvmlDeviceGetRetiredPagesPendingStatus, h)
    limit, default = nvml.maybe(p.nvmlDeviceGetPowerManagementLimit, h), \
        nvml.maybe(p.nvmlDeviceGetPowerManagementDefaultLimit, h)
    pci = nvml.maybe(p.nvmlDeviceGetPciInfo, h)
    return h, {
        "index": i, "name": nvml.text(p.nvmlDeviceGetName(h)),
        "persistence": nvml.maybe(p.nvmlDeviceGetPersistenceMode, h) == 1,
        "compute_mode": COMPUTE_MODES.get(nvml.maybe(p.nvmlDeviceGetComputeMode, h), "unknown"),
        "ecc": None if ecc is None else bool(ecc[0]),
        "retired_pending": None if retired is None else bool(retired),
        "remap_pending": None if remap is None else bool(remap[2]),
        "sm_clock": nvml.maybe(p.nvmlDeviceGetClockInfo, h, p.NVML_CLOCK_SM),
        "sm_clock_max": nvml.maybe(p.nvmlDeviceGetMaxClockInfo, h, p.NVML_CLOCK_SM),
        "power_limit_w": None if limit is None else limit / 1000,
        "power_default_w": None if default is None else default / 1000,
        "throttle": [n for bit, n in BAD_THROTTLE.items() if reasons & bit],
        "bus_id": None if pci is None else nvml.text(pci.busId),
    }


def _nvml_link(p: Any, a: tuple, b: tuple) -> str:
    (ha, _), (hb, db) = a, b
    links = 0
    for link in range(getattr(p, "NVML_NVLINK_MAX_LINKS", 18)):
        if nvml.maybe(p.nvmlDeviceGetNvLinkState, ha, link) == 1:
            remote = nvml.maybe(p.nvmlDeviceGetNvLinkRemotePciInfo, ha, link)
            links += remote is not None and nvml.text(remote.busId) == db["bus_id"]
    if links:
        return f"NV{links}"
    return TOPO_LEVELS.get(nvml.maybe(p.nvmlDeviceGetTopologyCommonAncestor, ha, hb), "unknown")


def _from_nvml(p: Any) -> dict:
    devices = [_nvml_device(p, i) for i in range(p.nvmlDeviceGetCount())]
    driver = nvml.text(p.nvmlSystemGetDriverVersion())
    links = [{"a": i, "b": i + 1, "link": _nvml_link(p, devices[i], devices[i + 1])}
             for i in range(len(devices) - 1)]
    return {"source": "nvml", "driver": driver, "gpus": [d for _, d in devices], "links": links}


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def _from_smi(smi: str) -> dict:
    out = subprocess.run([smi, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return {"gpus": [], "reason": f"nvidia-smi failed: {out.stderr.strip() or out.stdout.strip()}"}
    gpus, driver = [], None
    for line in out.stdout.strip().splitlines():
        f = dict(zip(SMI_FIELDS, (c.strip() for c in line.split(","))))
        driver = f["driver_version"]
        gpus.append({"index": int(f["index"]), "name": f["name"], "persistence": f["persistence_mode"] == "Enabled",
                     "compute_mode": f["compute_mode"].replace(" ", "_"),
                     "ecc": {"Enabled": True, "Disabled": False}.get(f["ecc.mode.current"]),
                     "retired_pending": {"Yes": True, "No": False}.get(f["retired_pages.pending"]),
                     "remap_pending": None, "sm_clock": _number(f["clocks.sm"]),
                     "sm_clock_max": _number(f["clocks.max.sm"]), "power_limit_w": _number(f["power.limit"]),
                     "power_default_w": _number(f["power.default_limit"]), "throttle": [], "bus_id": f["pci.bus_id"]})
    return {"source": "nvidia-smi", "driver": driver, "gpus": gpus, "links": _smi_links(smi, len(gpus))}


def _smi_links(smi: str, count: int) -> list:
    """Adjacent GPU pairs from the ``nvidia-smi topo -m`` matrix."""
    try:
        text = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = {}
    for line in text.splitlines():
        cells = line.split()
        if cells and re.fullmatch(r"GPU\d+", cells[0]):
            rows[int(cells[0][3:])] = cells[1:1 + count]
    return [{"a": i, "b": i + 1, "link": rows[i][i + 1]} for i in range(count - 1)
            if i in rows and len(rows[i]) > i + 1]


def probe_gpus() -> dict:
    """``{"gpus": [...], "links": [...], "driver", "cuda_runtime", "nccl", "source", "reason"}``."""
    facts: dict = {"gpus": [], "links": [], "driver": None, "reason": None, "source": None}
    p, why = nvml.open_nvml()
    if p is not None:
        try:
            facts.update(_from_nvml(p))
        except Exception as exc:
            facts["reason"] = f"NVML query failed: {type(exc).__name__}: {exc}"
        finally:
            nvml.close_nvml(p)
    else:
        smi = shutil.which("nvidia-smi")
        if smi:
            try:
                facts.update(_from_smi(smi))
            except (OSError, subprocess.TimeoutExpired) as exc:
                facts["reason"] = f"nvidia-smi failed: {exc}"
        else:
            facts["reason"] = f"{why}; and no nvidia-smi on PATH"
    if not facts["gpus"] and not facts["reason"]:
        facts["reason"] = "the driver reports no GPU"
    facts["cuda_runtime"] = torch_cuda_version()
    facts["nccl"] = nccl_version() if facts["gpus"] and facts["cuda_runtime"] else None
    return facts
