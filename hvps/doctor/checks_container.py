"""Recognise a container; the shm, ulimit and cgroup checks then give container-specific fixes."""
from __future__ import annotations

from typing import Optional

from .base import Check, Context, check
from .host import Host

#: cgroup path fragments -> runtime, first match wins
_CGROUP_MARKS = (("kubepods", "kubernetes"), ("docker", "docker"), ("libpod", "podman"),
                 ("containerd", "containerd"), ("lxc", "lxc"))


def detect_container(host: Host) -> Optional[str]:
    """The container runtime this process runs under, or None on a bare host or VM."""
    if host.env.get("KUBERNETES_SERVICE_HOST"):
        return "kubernetes"
    if host.exists("/.dockerenv"):
        return "docker"
    if host.exists("/run/.containerenv"):
        return "podman"
    text = (host.read("/proc/1/cgroup") or "") + "\n" + (host.read("/proc/self/cgroup") or "")
    for mark, runtime in _CGROUP_MARKS:
        if mark in text:
            return runtime
    if (host.read("/proc/1/environ") or "").find("container=") >= 0:
        return "container"
    return None


@check("container", "container")
def container(host: Host, ctx: Context) -> Check:
    why = ("containers default to 64 MiB /dev/shm, an 8 MiB memlock limit and cgroup CPU/memory caps; "
           "the shm, ulimit and cgroup rows below give the container flags that lift them")
    if ctx.container is None:
        return Check("container", "ok", "none detected", why)
    return Check("container", "ok", ctx.container, why, data={"runtime": ctx.container})
