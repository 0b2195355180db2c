"""What a check returns, what it is told about the job, and the registry of checks."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from .host import Host

#: verdicts, best first; "skip" = does not apply here (e.g. no GPU), never a failure
VERDICTS = ("ok", "skip", "warn", "fail")


@dataclass
class Check:
    """One row of the report."""

    name: str
    verdict: str
    value: str
    why: str
    fix: str = ""
    data: dict = field(default_factory=dict)  # machine-readable facts behind ``value``

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} is not one of {VERDICTS}")

    def as_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Context:
    """What the checks know about the job around this node."""

    ranks_per_node: int = 1
    world_size: int = 1
    multi_host: bool = False
    container: Optional[str] = None  # "docker", "podman", "kubernetes", "containerd", "lxc" or None


CheckFn = Callable[[Host, Context], Check]


@dataclass(frozen=True)
class Spec:
    """A registered check: its function, and the verdict when its value differs between ranks
    (``mismatch``: "fail" for versions that hang a job when they differ, "warn" for node settings
    that make one node slower, None where differences are expected)."""

    name: str
    group: str
    func: CheckFn
    mismatch: Optional[str] = None


REGISTRY: dict = {}


def check(name: str, group: str, mismatch: Optional[str] = None) -> Callable[[CheckFn], CheckFn]:
    """Register ``func(host, ctx) -> Check`` under ``name`` (``mismatch``: see :class:`Spec`)."""
    def deco(func: CheckFn) -> CheckFn:
        if name in REGISTRY:
            raise ValueError(f"check {name!r} is registered twice")
        REGISTRY[name] = Spec(name, group, func, mismatch)
        return func
    return deco


def worst(verdicts) -> str:
    """The worst of ``verdicts`` ("ok" for none)."""
    return max(verdicts, key=VERDICTS.index, default="ok")


def gib(n: float) -> str:
    """Bytes as a short human string."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
