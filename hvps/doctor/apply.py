"""``--apply`` and ``--revert``: only safe, reversible changes, each recorded in a JSON state file
before the next one is made, so ``--revert`` can put back exactly what was there.

The record holds known settings only and is checked before anything is undone (:mod:`.record`).
The seed's unsafe advice is refused by name, with the reason (:data:`REFUSED`).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, TextIO

from .checks_cpu import THP
from .host import Host
from .record import RecordError, check_step, load, persistence_argv, save

STATE_NAME = "doctor-state.json"

#: what --apply will not do, and why
REFUSED = {
    "rt-priority": "real-time priority (chrt -f 99) for training processes starves kernel threads, network "
                   "interrupts and MPI progress; a busy-polling rank at SCHED_FIFO 99 can lock up the node. "
                   "Training runs at SCHED_OTHER; pin cores with --bind-to instead.",
    "min-granularity": "kernel.sched_min_granularity_ns=99 makes the scheduler switch tasks every 99 ns, so CPUs "
                       "spend their time in context switches; the kernel default (about 0.75-3 ms) is right "
                       "for training.",
}


@dataclass(frozen=True)
class Action:
    """A safe change: ``plan(host)`` lists the steps it would take now (none when already done)."""

    name: str
    summary: str
    plan: Callable[[Host], list]


def _plan_thp(host: Host) -> list:
    steps = []
    for attr in ("enabled", "defrag"):
        path = f"{THP}/{attr}"
        now = host.read_choice(path)
        if now is not None and now != "madvise":
            steps.append({"action": "thp", "kind": "write", "path": path, "before": now, "after": "madvise"})
    return steps


def _plan_governor(host: Host) -> list:
    steps = []
    for path in host.glob("/sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_governor"):
        now = host.read(path)
        available = (host.read(path.replace("scaling_governor", "scaling_available_governors")) or "").split()
        if now and now != "performance" and "performance" in available:
            steps.append({"action": "governor", "kind": "write", "path": path, "before": now, "after": "performance"})
    return steps


def _plan_persistence(host: Host) -> list:
    return [{"action": "persistence", "kind": "nvidia-smi", "gpu": g["index"], "before": 0, "after": 1}
            for g in host.gpus().get("gpus", []) if not g.get("persistence")]


ACTIONS = {a.name: a for a in (
    Action("thp", "transparent huge pages enabled and defrag to madvise", _plan_thp),
    Action("governor", "CPU frequency governor to performance", _plan_governor),
    Action("persistence", "GPU persistence mode on", _plan_persistence),
)}


def default_state_path(host: Host) -> Path:
    """/var/lib/hvps for root, else the user's state directory; inside the tree under --root."""
    if not host.real:
        return host.inside(f"/var/lib/hvps/{STATE_NAME}")
    if os.geteuid() == 0:
        return Path("/var/lib/hvps") / STATE_NAME
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "hvps" / STATE_NAME


def _describe(step: dict) -> str:
    if step["kind"] == "write":
        return f"{step['action']}: {step['path']}: {step['before']} -> {step['after']}"
    do, undo = (" ".join(persistence_argv(step["gpu"], step[k])) for k in ("after", "before"))
    return f"{step['action']}: {do} (undo: {undo})"


def _do(host: Host, step: dict, undo: bool = False) -> Optional[str]:
    """Carry out one checked step (or its undo); an error message, or None."""
    value = step["before"] if undo else step["after"]
    if step["kind"] == "write":
        try:
            host.write(step["path"], value)
        except OSError as exc:
            return f"cannot write {step['path']}: {exc.strerror or exc} (needs root)"
        return None
    argv = persistence_argv(step["gpu"], value)
    rc, out = host.run(argv)
    return None if rc == 0 else f"{' '.join(argv)} failed ({rc}): {out}"


def apply(host: Host, names: list, state: Path, yes: bool, out: Optional[TextIO] = None,
          answer: Callable[[str], str] = input) -> int:
    """Make the changes of the named actions (all safe ones for ``["all"]``). Exit status: 0 done or
    nothing to do, 1 a change failed (those made so far are recorded), 2 refused or declined."""
    out = out or sys.stdout
    refused = [n for n in names if n in REFUSED]
    if refused:
        for n in refused:
            print(f"hvps doctor: refusing --apply {n}: {REFUSED[n]}", file=out)
        return 2
    wanted = list(ACTIONS) if names in ([], ["all"]) else names
    unknown = [n for n in wanted if n not in ACTIONS]
    if unknown:
        print(f"hvps doctor: unknown --apply action(s) {', '.join(unknown)}; choose from "
              f"{', '.join(ACTIONS)} (or all)", file=out)
        return 2
    if state.exists() or state.is_symlink():
        print(f"hvps doctor: {state} records changes not yet reverted; run 'hvps doctor --revert' first "
              "so that the original settings stay recoverable", file=out)
        return 2
    steps = [s for n in wanted for s in ACTIONS[n].plan(host)]
    try:
        for s in steps:
            check_step(s)
    except RecordError as exc:
        print(f"hvps doctor: cannot record this change, so it is not made: {exc}", file=out)
        return 2
    if not steps:
        print("hvps doctor: nothing to change", file=out)
        return 0
    print("hvps doctor will make these changes (undo with 'hvps doctor --revert'):", file=out)
    for s in steps:
        print(f"  {_describe(s)}", file=out)
    if not yes:
        try:
            reply = answer("Apply them? [y/N] ")
        except EOFError:
            reply = ""
        if reply.strip().lower() not in ("y", "yes"):
            print("hvps doctor: nothing changed", file=out)
            return 2
    done: list = []
    for s in steps:
        error = _do(host, s)
        if error:
            print(f"hvps doctor: {error}; {len(done)} change(s) made and recorded in {state}", file=out)
            if done:
                save(state, done)
            return 1
        done.append(s)
        save(state, done)
    print(f"hvps doctor: {len(done)} change(s) made; recorded in {state}", file=out)
    return 0


def revert(host: Host, state: Path, out: Optional[TextIO] = None) -> int:
    """Undo what ``state`` records, newest first. Exit status 0 when all is undone (the file is
    removed), 1 when something could not be (the file keeps what is left), 2 when the record is
    refused (not this user's, writable by others, or naming anything but known settings)."""
    out = out or sys.stdout
    try:
        steps = load(state)
    except FileNotFoundError:
        print(f"hvps doctor: no recorded changes in {state}; nothing to revert", file=out)
        return 0
    except RecordError as exc:
        print(f"hvps doctor: refusing --revert: {exc}; nothing changed", file=out)
        return 2
    while steps:
        error = _do(host, steps[-1], undo=True)
        if error:
            save(state, steps)
            print(f"hvps doctor: {error}; {len(steps)} change(s) left in {state}", file=out)
            return 1
        print(f"  reverted {_describe(steps[-1])}", file=out)
        steps.pop()
    state.unlink()  # a symlink put in its place is removed, never followed
    print("hvps doctor: every recorded change reverted", file=out)
    return 0
