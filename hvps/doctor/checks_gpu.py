"""GPU checks. Without a GPU every row says "skip" with the reason, never "fail"."""
from __future__ import annotations

from typing import Optional

from .base import Check, Context, check
from .host import Host

#: minimum Linux driver of each CUDA toolkit's GA release (NVIDIA's CUDA release notes, table 3)
MIN_DRIVER = {
    (11, 0): "450.36.06", (11, 1): "455.23", (11, 2): "460.27.03", (11, 3): "465.19.01", (11, 4): "470.42.01",
    (11, 5): "495.29.05", (11, 6): "510.39.01", (11, 7): "515.43.04", (11, 8): "520.61.05", (12, 0): "525.60.13",
    (12, 1): "530.30.02", (12, 2): "535.54.03", (12, 3): "545.23.06", (12, 4): "550.54.14", (12, 5): "555.42.02",
    (12, 6): "560.28.03", (12, 8): "570.26", (12, 9): "575.51.03", (13, 0): "580.65.06",
}
#: minor-version compatibility: any toolkit of a major release runs on at least this driver (no PTX JIT)
MIN_DRIVER_MAJOR = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
LINK_WARN = ("PHB", "NODE", "SYS")


def _v(text: str) -> tuple:
    return tuple(int(x) for x in text.split(".") if x.isdigit())


def driver_verdict(driver: str, cuda: str) -> tuple:
    """``(verdict, reason)`` for running a CUDA ``cuda`` build on ``driver``."""
    major_minor = _v(cuda)[:2]
    need = MIN_DRIVER.get(major_minor)
    if need is None:  # a minor release the table does not list: the nearest older one of that major
        older = [k for k in MIN_DRIVER if k[0] == major_minor[0] and k <= major_minor]
        need = MIN_DRIVER[max(older)] if older else None
    floor = MIN_DRIVER_MAJOR.get(major_minor[0])
    if need and _v(driver) >= _v(need):
        return "ok", f"CUDA {cuda} needs driver >= {need}"
    if floor and _v(driver) >= _v(floor):
        return "warn", (f"CUDA {cuda} wants driver >= {need}; this one runs it only through minor-version "
                        f"compatibility (>= {floor}: no PTX JIT, newer APIs fail)")
    return "fail", f"CUDA {cuda} needs driver >= {need or floor or '?'}; CUDA calls fail with 'driver too old'"


def _no_gpu(host: Host, name: str, why: str) -> Optional[Check]:
    facts = host.gpus()
    if facts.get("gpus"):
        return None
    reason = facts.get("reason") or "none found"
    return Check(name, "skip", f"no GPU: {reason}" if name == "gpu.driver" else "no GPU",
                 f"{why} (no GPU here: {reason})")


def _per_gpu(host: Host, name: str, why: str, judge) -> Check:
    """One row from ``judge(gpu) -> (verdict, text, fix)`` over every GPU: worst verdict wins."""
    skip = _no_gpu(host, name, why)
    if skip:
        return skip
    order = ("ok", "skip", "warn", "fail")
    results = [(g["index"],) + tuple(judge(g)) for g in host.gpus()["gpus"]]
    verdict = max((r[1] for r in results), key=order.index)
    texts = sorted({r[2] for r in results})
    value = texts[0] + f" (all {len(results)} GPUs)" if len(texts) == 1 else "; ".join(
        f"GPU{i}: {t}" for i, _, t, _ in results)
    fix = next((r[3] for r in results if r[1] == verdict and r[3]), "")
    return Check(name, verdict, value, why, fix if verdict != "ok" else "", {"per_gpu": [r[2] for r in results]})


@check("gpu.driver", "gpu", mismatch="fail")
def driver(host: Host, ctx: Context) -> Check:
    why = "the driver must be new enough for the CUDA runtime torch was built with, and equal on every node"
    skip = _no_gpu(host, "gpu.driver", why)
    if skip:
        return skip
    facts = host.gpus()
    drv, cuda = facts.get("driver") or "?", facts.get("cuda_runtime")
    value = f"driver {drv}, torch built for CUDA {cuda or '(none: CPU build)'}"
    if not cuda:
        return Check("gpu.driver", "warn", value, why + "; this torch cannot use the GPU",
                     "install a CUDA build of torch (pip install torch --index-url https://download.pytorch.org/whl/cu128)",
                     {"driver": drv})
    verdict, reason = driver_verdict(drv, cuda)
    return Check("gpu.driver", verdict, value, f"{why}; {reason}",
                 "" if verdict == "ok" else "upgrade the NVIDIA driver, or install a torch built for an older CUDA",
                 {"driver": drv, "cuda": cuda})


@check("gpu.persistence", "gpu")
def persistence(host: Host, ctx: Context) -> Check:
    why = ("without persistence mode the driver tears down each GPU when no process holds it; every rank's "
           "first CUDA call then takes seconds, unevenly, and early collectives time out")
    return _per_gpu(host, "gpu.persistence", why, lambda g: (
        ("ok", "on", "") if g.get("persistence") else
        ("warn", "off", "hvps doctor --apply persistence (nvidia-smi -pm 1; or enable nvidia-persistenced)")))


@check("gpu.compute_mode", "gpu")
def compute_mode(host: Host, ctx: Context) -> Check:
    why = "'Prohibited' refuses every CUDA context; 'Exclusive_Process' allows one process (one rank) per GPU"

    def judge(g: dict) -> tuple:
        mode = g.get("compute_mode") or "unknown"
        if mode == "Prohibited":
            return "fail", mode, "nvidia-smi -c DEFAULT (as root)"
        if mode == "Exclusive_Process" and ctx.ranks_per_node > len(host.gpus()["gpus"]):
            return "fail", mode, "run one rank per GPU, or nvidia-smi -c DEFAULT"
        if mode in ("Default", "Exclusive_Process"):
            return "ok", mode, ""
        return "warn", mode, "nvidia-smi -c DEFAULT (as root)"
    return _per_gpu(host, "gpu.compute_mode", why, judge)


@check("gpu.ecc", "gpu")
def ecc(host: Host, ctx: Context) -> Check:
    why = ("a page or row waiting for retirement means the GPU has seen uncorrectable errors and needs a "
           "reset; without ECC a bit flip silently corrupts gradients on every rank")

    def judge(g: dict) -> tuple:
        if g.get("retired_pending") or g.get("remap_pending"):
            return "fail", "retirement pending", "drain the node and reset the GPU (nvidia-smi -r) or reboot"
        if g.get("ecc") is False:
            return "warn", "ECC off", "nvidia-smi -e 1, then reboot"
        return "ok", "ECC on, nothing pending" if g.get("ecc") else "ECC not supported", ""
    return _per_gpu(host, "gpu.ecc", why, judge)


@check("gpu.clocks", "gpu")
def clocks(host: Host, ctx: Context) -> Check:
    why = "a capped or throttling GPU sets the pace of the whole job: every collective waits for it"

    def judge(g: dict) -> tuple:
        limit, default = g.get("power_limit_w"), g.get("power_default_w")
        text = f"SM {g.get('sm_clock')}/{g.get('sm_clock_max')} MHz, power limit {limit}/{default} W"
        if g.get("throttle"):
            return "fail", text + f", throttling: {','.join(g['throttle'])}", (
                "check cooling and power delivery (nvidia-smi -q -d PERFORMANCE)")
        if limit and default and limit < default:
            return "warn", text, f"nvidia-smi -i {g['index']} -pl {default:g} (as root)"
        return "ok", text, ""
    return _per_gpu(host, "gpu.clocks", why, judge)


@check("gpu.topology", "gpu")
def topology(host: Host, ctx: Context) -> Check:
    why = ("ring neighbours exchange every gradient; NVLink or a shared PCIe switch is fast, a path through "
           "the CPU's host bridge (PHB, NODE) or across sockets (SYS) is several times slower")
    skip = _no_gpu(host, "gpu.topology", why)
    if skip:
        return skip
    links = host.gpus().get("links") or []
    if not links:
        return Check("gpu.topology", "ok", "one GPU: nothing to pair", why)
    value = ", ".join(f"GPU{lk['a']}-GPU{lk['b']} {lk['link']}" for lk in links)
    slow = [lk for lk in links if lk["link"] in LINK_WARN]
    if slow:
        return Check("gpu.topology", "warn", value, why, "pair ranks on GPUs under one PCIe switch or NVLink "
                     "(CUDA_VISIBLE_DEVICES order), or expect lower all-reduce bandwidth", {"links": links})
    return Check("gpu.topology", "ok", value, why, data={"links": links})


@check("gpu.nccl", "gpu", mismatch="fail")
def nccl(host: Host, ctx: Context) -> Check:
    why = "NCCL carries GPU all-reduces (HVPS_BACKEND=tdist or auto); every rank must load the same version"
    skip = _no_gpu(host, "gpu.nccl", why)
    if skip:
        return skip
    version = host.gpus().get("nccl")
    if version:
        return Check("gpu.nccl", "ok", version, why, data={"nccl": version})
    return Check("gpu.nccl", "warn", "not available", why + "; this torch has no usable NCCL, so GPU tensors "
                 "go through MPI", "install a CUDA build of torch (it bundles NCCL)")
