"""The ``--apply`` record (``doctor-state.json``), read as untrusted input.

``--revert`` runs as root and undoes what the record says, so the record names known settings
only, never a command line or a free path:

* ``{"action": "thp", "kind": "write", "path": <THP enabled|defrag>, "before": w, "after": w}``
* ``{"action": "governor", "kind": "write", "path": "/sys/devices/system/cpu/cpuN/cpufreq/scaling_governor", ...}``
* ``{"action": "persistence", "kind": "nvidia-smi", "gpu": N, "before": 0|1, "after": 0|1}``
  (carried out as ``nvidia-smi -i N -pm 0|1``)

with each value one of that setting's choice words. A record that is not a regular file owned
by the running user, is writable by group or others, or holds one step outside this list is
refused whole, before anything is changed. It is written through a fresh temporary file with a
random name (``O_EXCL``, mode 0600), then renamed over the old one.
"""
from __future__ import annotations

import errno
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Optional

from ..core.files import RefusedFile, open_untrusted
from .checks_cpu import THP

VERSION = 1
MAX_BYTES = 1 << 20
#: sysfs files --apply may write, with the words each may hold
THP_CHOICES = {f"{THP}/enabled": ("always", "madvise", "never"),
               f"{THP}/defrag": ("always", "defer", "defer+madvise", "madvise", "never")}
GOVERNOR_PATH = re.compile(r"/sys/devices/system/cpu/cpu[0-9]{1,5}/cpufreq/scaling_governor")
GOVERNORS = ("performance", "powersave", "schedutil", "ondemand", "conservative", "userspace")
MAX_GPU = 1023


class RecordError(ValueError):
    """The record cannot be trusted or read; nothing it says is done."""


def persistence_argv(gpu: int, mode: int) -> list:
    """The one command a record may lead to: ``nvidia-smi -i N -pm 0|1``."""
    return ["nvidia-smi", "-i", str(gpu), "-pm", str(mode)]


def _choices(step: dict) -> tuple:
    action, path = step.get("action"), step.get("path")
    if action == "thp" and path in THP_CHOICES:
        return THP_CHOICES[path]
    if action == "governor" and isinstance(path, str) and GOVERNOR_PATH.fullmatch(path):
        return GOVERNORS
    raise RecordError(f"step {action!r} on {path!r}: not a setting hvps doctor --apply changes")


def _legacy_persistence(step: dict) -> Optional[dict]:
    """A persistence step in the earlier ``"kind": "command"`` form, when it is exactly
    ``nvidia-smi -i N -pm 1`` undone by ``... -pm 0`` (or the reverse); else None."""
    do, undo = step.get("do"), step.get("undo")
    if set(step) != {"action", "kind", "do", "undo"} or not isinstance(do, list) or not isinstance(undo, list):
        return None
    if len(do) != 5 or do[:2] != ["nvidia-smi", "-i"] or not (isinstance(do[2], str) and do[2].isdigit()):
        return None
    gpu = int(do[2])
    for after in (0, 1):
        if do == persistence_argv(gpu, after) and undo == persistence_argv(gpu, 1 - after):
            return {"action": "persistence", "kind": "nvidia-smi", "gpu": gpu, "before": 1 - after, "after": after}
    return None


def check_step(step: object) -> dict:
    """``step`` if it is one of the known settings with allowed values; RecordError otherwise."""
    if not isinstance(step, dict):
        raise RecordError(f"step {step!r} is not an object")
    if step.get("action") == "persistence":
        if step.get("kind") == "command":
            legacy = _legacy_persistence(step)
            if legacy is None:
                raise RecordError(f"step {step!r}: a record holds no command lines, only nvidia-smi -i N -pm 0|1")
            return legacy
        gpu = step.get("gpu")
        if (set(step) != {"action", "kind", "gpu", "before", "after"} or step.get("kind") != "nvidia-smi"
                or type(gpu) is not int or not 0 <= gpu <= MAX_GPU
                or {step.get("before"), step.get("after")} != {0, 1}
                or type(step["before"]) is not int or type(step["after"]) is not int):
            raise RecordError(f"step {step!r}: persistence is {{gpu: 0-{MAX_GPU}, before/after: 0 or 1}}")
        return dict(step)
    if set(step) != {"action", "kind", "path", "before", "after"} or step.get("kind") != "write":
        raise RecordError(f"step {step!r}: a write step has exactly action, kind, path, before and after")
    words = _choices(step)
    for key in ("before", "after"):
        if step[key] not in words:
            raise RecordError(f"step on {step['path']}: {key} {step[key]!r} is not one of {', '.join(words)}")
    return dict(step)


def _open_own_file(path: Path) -> int:
    """An fd of ``path`` read-only, not following a symlink, when it is a regular file of this user
    that group and others cannot write; RecordError otherwise."""
    try:
        return open_untrusted(path, follow_links=False, own=True, forbidden_mode=0o022, max_bytes=MAX_BYTES)
    except RefusedFile as exc:
        if exc.missing:
            raise FileNotFoundError(errno.ENOENT, exc.reason, str(path)) from None
        raise RecordError(f"{path} {exc.reason}; refusing to act on it") from None


def load(path: Path) -> list:
    """The checked steps of the record at ``path``, oldest first; FileNotFoundError when there is none."""
    fd = _open_own_file(path)
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_BYTES + 1)
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise RecordError(f"{path} is not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("hvps_doctor_state") != VERSION or not isinstance(doc.get("changes"), list):
        raise RecordError(f"{path} is not an hvps doctor record (version {VERSION})")
    return [check_step(s) for s in doc["changes"]]


def save(path: Path, steps: list) -> None:
    """Write the record atomically: a new 0600 file with a random name in the same folder, renamed over ``path``."""
    for s in steps:
        check_step(s)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=".doctor-state-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"hvps_doctor_state": VERSION, "changes": steps}, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise

