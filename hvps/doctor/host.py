"""The one place ``hvps doctor`` reads the machine: files under a root, and the few facts
that are not files.

Every check is a pure function of what a :class:`Host` returns, so a test (or a support
engineer replaying a customer's node) builds a tree with ``proc/``, ``sys/``, ``etc/`` and
an optional ``hvps-doctor-facts.json`` and points ``--root`` at it. Under a root other than
``/`` the non-file facts (ulimits, ``/dev/shm`` size, scheduling policy, environment,
interface addresses, software versions, GPUs) come only from that JSON file: a missing key
means "unknown", never the real machine's value.
"""
from __future__ import annotations

import glob as globlib
import json
import os
import re
import stat
import subprocess
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from .gpu import probe_gpus
from .software import probe_software

FACTS_FILE = "hvps-doctor-facts.json"
_CHOICE = re.compile(r"\[([^\]]+)\]")


def replay_control_rule(env: Mapping[str, str], addresses: Mapping[str, str]) -> dict:
    """:meth:`Host.control_addresses` for a recorded node: the control plane's rule on its environment and
    interface addresses (HVPS_CONTROL_ADDR wins; HVPS_NETWORK_INTERFACE's address; else every address,
    loopback last)."""
    from ..core.settings import env_text

    explicit = env_text("HVPS_CONTROL_ADDR", env=env)
    wanted = env_text("HVPS_NETWORK_INTERFACE", env=env)
    if explicit:
        return {"addresses": [explicit], "listen": explicit if wanted else ""}
    if wanted:
        if not addresses.get(wanted):
            return {"error": f"HVPS_NETWORK_INTERFACE={wanted!r} has no IPv4 address"}
        return {"addresses": [addresses[wanted]], "listen": addresses[wanted]}
    return {"addresses": sorted(set(addresses.values()), key=lambda a: (a.startswith("127."), a)), "listen": ""}


class Host:
    """Reads files below ``root`` and non-file facts (real, or from ``FACTS_FILE`` under a root)."""

    def __init__(self, root: str = "/") -> None:
        self.root = Path(root).resolve()
        self.real = self.root == Path("/")
        self._facts: dict = {}
        self._cache: dict = {}
        if not self.real:
            try:
                self._facts = json.loads((self.root / FACTS_FILE).read_text())
            except FileNotFoundError:
                self._facts = {}

    # ------------------------------------------------------------------ files
    def path(self, path: str) -> Path:
        """``path`` (absolute, as on a real machine) inside the root."""
        return self.root / path.lstrip("/")

    def read(self, path: str) -> Optional[str]:
        """The stripped text of a file, or None when it is missing or unreadable."""
        try:
            return self.path(path).read_text(errors="replace").strip()
        except OSError:
            return None

    def read_int(self, path: str) -> Optional[int]:
        text = self.read(path)
        try:
            return int(text) if text is not None else None
        except ValueError:
            return None

    def read_choice(self, path: str) -> Optional[str]:
        """The selected word of a sysfs choice file (``always [madvise] never`` -> madvise)."""
        text = self.read(path)
        if text is None:
            return None
        m = _CHOICE.search(text)
        return m.group(1) if m else text

    def glob(self, pattern: str) -> list:
        """Absolute machine paths (as on the real machine) matching ``pattern``, sorted."""
        base = str(self.root).rstrip("/")
        return sorted(p[len(base):] if base else p for p in globlib.glob(base + pattern))

    def exists(self, path: str) -> bool:
        return self.path(path).exists()

    def inside(self, path: str) -> Path:
        """``path`` inside the root with its folders' symlinks resolved; PermissionError when it
        has a ``..`` or leads out of the root. Its last name is opened with O_NOFOLLOW by the callers."""
        if ".." in Path(path).parts:
            raise PermissionError(f"{path}: '..' is not allowed")
        target = self.path(path)
        resolved = target.parent.resolve() / target.name
        if not resolved.is_relative_to(self.root):
            raise PermissionError(f"{path} leads out of {self.root} (through a symlink)")
        return resolved

    def write(self, path: str, value: str) -> None:
        """Write ``value`` as a sysfs attribute: an existing regular file inside the root, never
        through a symlink. Under a fake root a choice file keeps its list and moves the brackets,
        as the kernel shows it after such a write."""
        target = self.inside(path)
        fd = os.open(target, (os.O_WRONLY if self.real else os.O_RDWR) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise PermissionError(f"{path} is not a regular file")
            if not self.real:
                old = os.read(fd, 1 << 16).decode(errors="replace").strip()
                words = old.replace("[", "").replace("]", "").split()
                if _CHOICE.search(old) and value in words:
                    value = " ".join(f"[{w}]" if w == value else w for w in words)
                os.ftruncate(fd, 0)
                os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, (value + "\n").encode())
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ non-file facts
    def fact(self, key: str, probe: Callable[[], Any]) -> Any:
        """``probe()`` on the real machine (cached), the facts file's ``key`` (or None) under a root."""
        if not self.real:
            return self._facts.get(key)
        if key not in self._cache:
            self._cache[key] = probe()
        return self._cache[key]

    @property
    def env(self) -> Mapping[str, str]:
        """The environment (the facts file's ``env`` under a root; empty when absent)."""
        return os.environ if self.real else dict(self._facts.get("env") or {})

    def rlimit(self, name: str) -> Optional[list]:
        """``[soft, hard]`` of ``RLIMIT_<NAME>``, None standing for unlimited; None if unknown."""
        def probe():
            import resource

            soft, hard = resource.getrlimit(getattr(resource, f"RLIMIT_{name.upper()}"))
            return [None if v == resource.RLIM_INFINITY else v for v in (soft, hard)]
        return self.fact(f"rlimit_{name}", probe)

    def statvfs(self, path: str) -> Optional[dict]:
        """``{"total": bytes, "free": bytes}`` of the file system at ``path``, or None."""
        def probe():
            try:
                st = os.statvfs(path)
            except OSError:
                return None
            return {"total": st.f_blocks * st.f_frsize, "free": st.f_bavail * st.f_frsize}
        return self.fact(f"statvfs:{path}", probe)

    def sched(self) -> Optional[dict]:
        """This process's scheduling: ``{"policy": "SCHED_OTHER", "priority": 0, "nice": 0}``."""
        def probe():
            names = {getattr(os, n): n for n in ("SCHED_OTHER", "SCHED_BATCH", "SCHED_IDLE", "SCHED_FIFO",
                                                 "SCHED_RR") if hasattr(os, n)}
            policy = os.sched_getscheduler(0)
            return {"policy": names.get(policy, str(policy)), "priority": os.sched_getparam(0).sched_priority,
                    "nice": os.getpriority(os.PRIO_PROCESS, 0)}
        return self.fact("sched", probe)

    def interface_addresses(self) -> dict:
        """Interface name -> IPv4 address (interfaces without one are left out)."""
        def probe():
            import socket

            from ..control.plane import interface_address

            found = {name: interface_address(name) for _, name in socket.if_nameindex()}
            return {k: v for k, v in found.items() if v}
        return self.fact("addresses", probe) or {}

    def control_addresses(self) -> dict:
        """The control plane's own answer: ``{"addresses": [...], "listen": addr or ""}`` from
        :func:`hvps.control.plane.candidate_addresses` and :func:`~hvps.control.plane.listen_address`
        (``{"error": message}`` when they refuse). Under a root: the facts file's ``control``, else the same
        rule replayed on the tree's ``env`` and ``addresses`` (a test checks that the replay agrees)."""
        def probe():
            from ..control.plane import candidate_addresses, listen_address
            from ..core.errors import HvpsError

            try:
                return {"addresses": candidate_addresses(), "listen": listen_address()}
            except HvpsError as exc:
                return {"error": str(exc)}
        if not self.real and "control" not in self._facts:
            return replay_control_rule(self.env, self.interface_addresses())
        return self.fact("control", probe) or {"addresses": [], "listen": ""}

    def software(self) -> dict:
        return self.fact("software", probe_software) or {}

    def gpus(self) -> dict:
        return self.fact("gpu", probe_gpus) or {"gpus": [], "reason": "no GPU facts in this tree"}

    def run(self, argv: list) -> tuple:
        """Run a command: ``(exit status, output)``. Under a fake root the command is only
        appended to ``commands.log`` in the tree (nothing on the real machine changes)."""
        if not self.real:
            try:
                fd = os.open(self.inside("/commands.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                             0o644)
            except OSError as exc:
                return 126, f"cannot log to {self.root}/commands.log: {exc.strerror or exc}"
            with os.fdopen(fd, "a") as f:
                f.write(" ".join(argv) + "\n")
            return 0, ""
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return 127, str(exc)
        return proc.returncode, (proc.stdout + proc.stderr).strip()
