"""Tunables read from ``HVPS_*`` environment variables (Horovod's ``HOROVOD_*`` equivalents)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .errors import HvpsError

ALGORITHMS = ("auto", "mpi", "ring")
BACKENDS = ("auto", "mpi", "tdist", "horovod")


def env_number(name: str, default: float, kind=float) -> float:
    """``$name`` as ``kind`` (``default`` when unset or empty); a clear HvpsError when it is not a
    number or is negative."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise HvpsError(f"{name}={raw!r} is not a number; unset it or give e.g. {name}={default}") from None
    if value < 0:
        raise HvpsError(f"{name}={raw!r} must be >= 0")
    return value


def _env_choice(name: str, default: str, choices: tuple) -> str:
    value = (os.environ.get(name) or default).lower()
    if value not in choices:
        raise HvpsError(f"{name}={value!r} is unknown; choose one of {', '.join(choices)}")
    return value


@dataclass(frozen=True)
class Settings:
    """Engine settings; ``from_env()`` reads them once at ``init``."""

    fusion_threshold: int = 64 * 1024 * 1024
    cycle_time_ms: float = 1.0
    stall_check_seconds: float = 60.0
    algorithm: str = "auto"
    ring_chunk_bytes: int = 4 * 1024 * 1024
    timeline: str = ""
    #: data plane: mpi, tdist (torch.distributed: gloo on CPU, NCCL on CUDA), horovod, or
    #: auto (NCCL for CUDA tensors when available, MPI for everything else)
    backend: str = "auto"
    #: allreduce within each node, then across nodes, then within the node again
    hierarchical: bool = False
    #: requests every rank has agreed on, named by a bit from then on (0: off); see response_cache.py
    cache_capacity: int = 1024
    #: tune fusion_threshold and cycle_time_ms from step times during the first steps (autotune.py)
    autotune: bool = False
    autotune_warmup_steps: int = 2
    autotune_steps_per_sample: int = 5

    def resolved(self, single_host: bool) -> "Settings":
        """``auto`` made concrete: hvps's ring within one host (shared memory), MPI's Allreduce across hosts.

        Measured on our machines (benchmarks/RESULTS.md): through shared memory the ring
        takes ~0.65x the time of Open MPI's Allreduce; over TCP Open MPI's reaches the
        line rate and the ring does not.
        """
        if self.algorithm != "auto":
            return self
        return dataclasses.replace(self, algorithm="ring" if single_host else "mpi")

    @classmethod
    def from_env(cls) -> "Settings":
        algorithm = _env_choice("HVPS_ALLREDUCE_ALGORITHM", cls.algorithm, ALGORITHMS)
        return cls(
            backend=_env_choice("HVPS_BACKEND", cls.backend, BACKENDS),
            hierarchical=_env_choice("HVPS_HIERARCHICAL_ALLREDUCE", "0", ("0", "1")) == "1",
            autotune=_env_choice("HVPS_AUTOTUNE", "0", ("0", "1")) == "1",
            autotune_warmup_steps=int(env_number("HVPS_AUTOTUNE_WARMUP_STEPS", cls.autotune_warmup_steps, int)),
            autotune_steps_per_sample=int(env_number("HVPS_AUTOTUNE_STEPS_PER_SAMPLE", cls.autotune_steps_per_sample,
                                                     int)) or 1,
            cache_capacity=int(env_number("HVPS_CACHE_CAPACITY", cls.cache_capacity, int)),
            fusion_threshold=int(env_number("HVPS_FUSION_THRESHOLD", cls.fusion_threshold, int)),
            cycle_time_ms=env_number("HVPS_CYCLE_TIME", cls.cycle_time_ms),
            stall_check_seconds=env_number("HVPS_STALL_CHECK_TIME_SECONDS", cls.stall_check_seconds),
            algorithm=algorithm,
            ring_chunk_bytes=int(env_number("HVPS_RING_CHUNK_BYTES", cls.ring_chunk_bytes, int)) or cls.ring_chunk_bytes,
            timeline=os.environ.get("HVPS_TIMELINE", ""),
        )
