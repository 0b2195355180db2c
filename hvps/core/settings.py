"""Every ``HVPS_*`` environment variable: what it means, and the one place it is read.

``VARIABLES`` lists them all (the README's settings table says the same, and
``tests/test_settings_coverage.py`` fails when code names a variable that is missing here or
there, or reads one from ``os.environ`` outside this module). ``Settings.from_env()`` reads the
engine's at ``init``; the others are read where they are used, through :func:`env_text`,
:func:`env_number` and :func:`env_choice`, which check the name against ``VARIABLES``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from .errors import HvpsError

#: name -> what it does (one line; the README's table has the defaults and the details)
VARIABLES: dict[str, str] = {
    # the engine (Settings)
    "HVPS_FUSION_THRESHOLD": "bytes per fusion buffer; 0 turns fusion off",
    "HVPS_CYCLE_TIME": "ms between negotiation cycles",
    "HVPS_SPIN_WAIT_MICROSECONDS": "how long a thread waiting alone on a collective runs the engine itself; 0: never",
    "HVPS_STALL_CHECK_TIME_SECONDS": "a collective missing on some rank fails after this long (only warns when "
                                     "HVPS_STALL_SHUTDOWN_TIME_SECONDS is longer)",
    "HVPS_STALL_SHUTDOWN_TIME_SECONDS": "s after which a stalled collective fails (Horovod's meaning); "
                                        "0: at the check time",
    "HVPS_ALLREDUCE_ALGORITHM": "ring, mpi or auto",
    "HVPS_RING_CHUNK_BYTES": "message size of the ring algorithm",
    "HVPS_BACKEND": "data plane: mpi, tdist or auto",
    "HVPS_HIERARCHICAL_ALLREDUCE": "1: reduce within nodes, across nodes, within nodes again",
    "HVPS_ENCRYPT": "1: seal (AES-256-GCM) every data-plane byte between hosts; all: between every pair of ranks",
    "HVPS_TEST_TAMPER": "test-only fault hook of HVPS_ENCRYPT: damage a sealed chunk (flip|replay:RANK[:N])",
    "HVPS_SHM": "auto (default), 0 or 1: collectives among a node's ranks through one shared-memory segment",
    "HVPS_CACHE_CAPACITY": "requests the response cache keeps; 0 turns it off",
    "HVPS_FAST_LANE": "1 (default) or 0: a synchronous collective known to the response cache is agreed through the "
                      "node's shared memory, not through rank 0, when every rank is on one node",
    "HVPS_AUTOTUNE": "1: tune the fusion threshold and cycle time from step times",
    "HVPS_AUTOTUNE_WARMUP_STEPS": "steps each autotune candidate runs before it is measured",
    "HVPS_AUTOTUNE_STEPS_PER_SAMPLE": "steps each autotune candidate is measured over",
    "HVPS_TIMELINE": "file rank 0 writes a Chrome-trace timeline to from init on",
    "HVPS_TIMELINE_MARK_CYCLES": "1: the timeline marks the start of each engine cycle (CYCLE_START)",
    "HVPS_LOG_LEVEL": "level of the 'hvps' logger from init on: trace, debug, info, warning, error or fatal",
    # topology and the control plane
    "HVPS_LOCAL_SIZE": "ranks per node, overriding discovery",
    "HVPS_NETWORK_INTERFACE": "interface whose address the control plane (and gloo) offers",
    "HVPS_CONTROL_ADDR": "address rank 0's control plane binds and offers, overriding the interface",
    "HVPS_CONTROL_FANOUT": "children per rank in the control-plane tree (up to this many ranks + 1: a star); 0: a star",
    "HVPS_DYNAMIC_PROCESS_SETS": "1: process sets may be added and removed after init",
    # starting without MPI (hvps.runtime.bootstrap)
    "HVPS_RENDEZVOUS_ADDR": "addresses of hvpsrun --gloo's rendezvous store (hvpsrun sets it)",
    "HVPS_RENDEZVOUS_PORT": "port of hvpsrun --gloo's rendezvous store (hvpsrun sets it)",
    "HVPS_SECRET": "the job's secret, hex (hvpsrun --gloo hands it to its workers)",
    "HVPS_SECRET_FILE": "owner-only file whose first line is the job's secret (torchrun, or any launcher)",
    # metrics
    "HVPS_METRICS_PORT": "serve Prometheus metrics on this port + local rank",
    "HVPS_METRICS_ADDR": "address the metrics exporter binds",
    "HVPS_METRICS_TLS_CERT": "PEM certificate: serve metrics over TLS",
    "HVPS_METRICS_TLS_KEY": "PEM key of HVPS_METRICS_TLS_CERT",
    "HVPS_METRICS_BASIC_AUTH_FILE": "file whose first line is user:password for the metrics endpoint",
    # checkpoints
    "HVPS_CHECKPOINT_KEY": "secret that signs checkpoints (HMAC) and is required to load them",
    "HVPS_CHECKPOINT_INSPECT_TIMEOUT": "s the sandboxed helper may take over a file's metadata; 0: in process",
    # TensorFlow
    "HVPS_TF_BUCKET_BYTES": "bytes of dense gradients per overlapped allreduce bucket",
    # the launcher (hvpsrun sets or reads these)
    "HVPS_MPIRUN": "the mpirun for hvpsrun, the benchmarks and the tests",
    "HVPS_CHECKPOINT_DIR": "checkpoint directory hvpsrun --checkpoint-dir hands to the script",
    "HVPS_RESTART_COUNT": "which try of an hvpsrun --max-restarts job this is",
    "HVPS_ELASTIC": "1: an elastic launcher started the job (hvd.elastic.run retries failures in place)",
    "HVPS_ELASTIC_WORKER": "this worker's slot (host:index) in hvpsrun's elastic mode (hvpsrun sets it)",
    "HVPS_ELASTIC_TIMEOUT": "seconds an elastic worker waits for its next membership (hvpsrun's --elastic-timeout)",
    "HVPS_ELASTIC_RESETS_WITHOUT_COMMIT": "resets in a row without a completed commit after which hvd.elastic.run "
                                          "gives up (default 8; hvpsrun's --resets-without-commit)",
    "HVPS_DOCTOR": "1: the Slurm GPU recipes run hvps doctor on every rank first",
}


#: Horovod's variable -> its hvps twin. The twin is read first; the Horovod name only when the twin is unset.
ALIASES: dict[str, str] = {
    "HOROVOD_FUSION_THRESHOLD": "HVPS_FUSION_THRESHOLD",
    "HOROVOD_CYCLE_TIME": "HVPS_CYCLE_TIME",
    "HOROVOD_CACHE_CAPACITY": "HVPS_CACHE_CAPACITY",
    "HOROVOD_HIERARCHICAL_ALLREDUCE": "HVPS_HIERARCHICAL_ALLREDUCE",
    "HOROVOD_TIMELINE": "HVPS_TIMELINE",
    "HOROVOD_TIMELINE_MARK_CYCLES": "HVPS_TIMELINE_MARK_CYCLES",
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "HVPS_STALL_CHECK_TIME_SECONDS",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "HVPS_STALL_SHUTDOWN_TIME_SECONDS",
    "HOROVOD_AUTOTUNE": "HVPS_AUTOTUNE",
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "HVPS_AUTOTUNE_STEPS_PER_SAMPLE",
    "HOROVOD_LOG_LEVEL": "HVPS_LOG_LEVEL",
    "HOROVOD_GLOO_IFACE": "HVPS_NETWORK_INTERFACE",
    "HOROVOD_DYNAMIC_PROCESS_SETS": "HVPS_DYNAMIC_PROCESS_SETS",
}
_TWINS = {hvps: horovod for horovod, hvps in ALIASES.items()}

#: HOROVOD_* variables that launchers set for their workers (horovodrun, hvpsrun --gloo, Horovod's Gloo and
#: elastic drivers, Spark and Ray runners): facts about the job, not settings, so never warned about
LAUNCHER_VARIABLES = frozenset({
    "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
    "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT",
    "HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS", "HOROVOD_ELASTIC", "HOROVOD_SECRET_KEY",
    "HOROVOD_GLOO_GLOBAL_PREFIX", "HOROVOD_GLOO_LOCAL_PREFIX", "HOROVOD_GLOO_CROSS_PREFIX",
})

#: (hvps name, Horovod name) pairs already reported as both set; names already warned as unhonoured
_reported: set = set()


def _known(name: str) -> str:
    if name not in VARIABLES:
        raise KeyError(f"{name} is not an hvps setting; add it to hvps.core.settings.VARIABLES and the README")
    return name


def _lookup(name: str, env: Optional[Mapping[str, str]] = None) -> tuple:
    """``(the variable as the user wrote it, its value or None)`` for setting ``name``: ``$name``, else its
    Horovod twin (:data:`ALIASES`). When both are set, ``$name`` wins, and one log line says so."""
    env = os.environ if env is None else env
    value = env.get(_known(name)) or None
    twin = _TWINS.get(name)
    other = env.get(twin) or None if twin else None
    if other is None:
        return name, value
    if value is None:
        return twin, other
    if (name, twin) not in _reported:  # one line per pair and process: a warning where they disagree
        _reported.add((name, twin))
        logging.getLogger("hvps").log(logging.WARNING if other != value else logging.INFO,
                                      "hvps: %s=%s and %s=%s are both set; %s wins", name, value, twin, other, name)
    return name, value


def env_text(name: str, default: Optional[str] = None, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``$name``, else its Horovod twin's value (``default`` when both are unset or empty).

    Args:
        name: an ``HVPS_*`` name listed in :data:`VARIABLES`.
        default: what an unset variable reads as.
        env: the environment to read (``os.environ`` when None).

    Returns:
        The value, or ``default``.

    Raises:
        KeyError: ``name`` is not listed in :data:`VARIABLES`.
    """
    value = _lookup(name, env)[1]
    return default if value is None else value


def unhonoured_horovod_variables(env: Optional[Mapping[str, str]] = None) -> list:
    """The ``HOROVOD_*`` variables set in ``env`` (default ``os.environ``) that hvps does not read: neither an
    alias of an hvps setting (:data:`ALIASES`) nor a launcher's (:data:`LAUNCHER_VARIABLES`); sorted."""
    env = os.environ if env is None else env
    return sorted(k for k in env if k.startswith("HOROVOD_") and k not in ALIASES and k not in LAUNCHER_VARIABLES)


def warn_unhonoured_horovod_variables(env: Optional[Mapping[str, str]] = None) -> list:
    """Name, in one warning, the ``HOROVOD_*`` variables hvps does not honour and has not named before in this
    process (``init`` calls it). Returns the names it warned about."""
    new = [k for k in unhonoured_horovod_variables(env) if k not in _reported]
    if new:
        _reported.update(new)
        logging.getLogger("hvps").warning(
            "hvps does not honour %s (set, but ignored); see the README's table of Horovod variables for the ones "
            "it reads", ", ".join(new))
    return new

ALGORITHMS = ("auto", "mpi", "ring")
BACKENDS = ("auto", "mpi", "tdist")
#: HVPS_LOG_LEVEL's (and Horovod's) names -> logging's levels
LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "fatal")
LOGGING_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
                  "error": logging.ERROR, "fatal": logging.CRITICAL}


def env_number(name: str, default: float, kind=float) -> float:
    """``$name`` as ``kind`` (``default`` when unset or empty); a clear HvpsError when it is not a
    number or is negative."""
    written, raw = _lookup(name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise HvpsError(f"{written}={raw!r} is not a number; unset it or give e.g. {written}={default}") from None
    if value < 0:
        raise HvpsError(f"{written}={raw!r} must be >= 0")
    return value


def env_choice(name: str, default: str, choices: tuple) -> str:
    """``$name`` lower-cased, one of ``choices`` (``default`` when unset); HvpsError otherwise."""
    written, raw = _lookup(name)
    value = default.lower() if raw is None else raw.lower()
    if value not in choices:
        raise HvpsError(f"{written}={value!r} is unknown; choose one of {', '.join(choices)}")
    return value


@dataclass(frozen=True)
class Settings:
    """Engine settings; ``from_env()`` reads them once at ``init``."""

    fusion_threshold: int = 64 * 1024 * 1024
    cycle_time_ms: float = 1.0
    #: a thread waiting on the only collective in flight negotiates and runs it itself, polling for up to
    #: this long before it sleeps (the fast path of synchronous calls; see engine.py)
    spin_wait_us: float = 2000.0
    stall_check_seconds: float = 60.0
    #: Horovod's stall shutdown time: when longer than stall_check_seconds, a stall only warns at the check time
    #: and fails at this one (0: it fails at the check time, hvps's default)
    stall_shutdown_seconds: float = 0.0
    algorithm: str = "auto"
    ring_chunk_bytes: int = 4 * 1024 * 1024
    timeline: str = ""
    #: the timeline marks each engine cycle (Horovod's HOROVOD_TIMELINE_MARK_CYCLES)
    timeline_mark_cycles: bool = False
    #: the 'hvps' logger's level from init on ("" leaves it alone)
    log_level: str = ""
    #: data plane: mpi, tdist (torch.distributed: gloo on CPU, NCCL on CUDA), or
    #: auto (NCCL for CUDA tensors when available, MPI for everything else)
    backend: str = "auto"
    #: allreduce within each node, then across nodes, then within the node again
    hierarchical: bool = False
    #: node-local collectives through shared memory: auto (where ranks share a host and it applies, else the
    #: flat plane with one warning), 1 (or an HvpsError at init), 0 (never); see dataplane/backends/node_plane.py
    shm: str = "auto"
    #: requests every rank has agreed on, named by a bit from then on (0: off); see response_cache.py
    cache_capacity: int = 1024
    #: synchronous collectives the cache knows are agreed through the node's segment (runtime/fast_lane.py)
    fast_lane: bool = True
    #: children per rank in the control-plane tree (control/tree.py); above fanout + 1 ranks, relays merge
    #: their subtree's announcements, so rank 0 hears from ``fanout`` ranks instead of every rank (0: a star).
    #: 16: rank 0 and the busiest relay stay under 5 ms of negotiation per step up to 4,096 ranks (RESULTS.md)
    control_fanout: int = 16
    #: tune fusion_threshold and cycle_time_ms from step times during the first steps (autotune.py)
    autotune: bool = False
    autotune_warmup_steps: int = 2
    autotune_steps_per_sample: int = 5
    #: seal the data plane: "0" off, "1" between hosts, "all" between every pair of ranks (backends/sealed.py)
    encrypt: str = "0"

    @property
    def stall_fail_seconds(self) -> float:
        """How long a collective missing on some rank waits before it fails."""
        return max(self.stall_check_seconds, self.stall_shutdown_seconds)

    @property
    def stall_warn_seconds(self) -> Optional[float]:
        """When a stalled collective is first warned about, if before it fails (else None)."""
        return self.stall_check_seconds if self.stall_shutdown_seconds > self.stall_check_seconds else None

    def resolved(self, single_host: bool, mpi: bool = True) -> "Settings":
        """``auto`` made concrete. The algorithm: hvps's ring within one host (shared memory), MPI's
        Allreduce across hosts. The backend, in a job started without MPI (``mpi`` false):
        torch.distributed, the only data plane there.

        Measured on our machines (benchmarks/RESULTS.md): through shared memory the ring
        takes ~0.65x the time of Open MPI's Allreduce; over TCP Open MPI's reaches the
        line rate and the ring does not.
        """
        resolved = self
        if not mpi:
            if self.backend == "mpi":
                raise HvpsError(f"HVPS_BACKEND={self.backend} needs a job started by an MPI launcher (mpirun, srun, "
                                "hvpsrun without --gloo); this one was started without MPI, where the data plane is "
                                "torch.distributed: unset HVPS_BACKEND or set it to tdist")
            resolved = dataclasses.replace(resolved, backend="tdist")
        if resolved.algorithm != "auto":
            return resolved
        return dataclasses.replace(resolved, algorithm="ring" if single_host else "mpi")

    @classmethod
    def from_env(cls) -> "Settings":
        algorithm = env_choice("HVPS_ALLREDUCE_ALGORITHM", cls.algorithm, ALGORITHMS)
        return cls(
            backend=env_choice("HVPS_BACKEND", cls.backend, BACKENDS),
            hierarchical=env_choice("HVPS_HIERARCHICAL_ALLREDUCE", "0", ("0", "1")) == "1",
            encrypt=env_choice("HVPS_ENCRYPT", "0", ("0", "1", "all")),
            shm=env_choice("HVPS_SHM", cls.shm, ("auto", "0", "1")),
            autotune=env_choice("HVPS_AUTOTUNE", "0", ("0", "1")) == "1",
            autotune_warmup_steps=int(env_number("HVPS_AUTOTUNE_WARMUP_STEPS", cls.autotune_warmup_steps, int)),
            autotune_steps_per_sample=int(env_number("HVPS_AUTOTUNE_STEPS_PER_SAMPLE", cls.autotune_steps_per_sample,
                                                     int)) or 1,
            cache_capacity=int(env_number("HVPS_CACHE_CAPACITY", cls.cache_capacity, int)),
            fast_lane=env_choice("HVPS_FAST_LANE", "1", ("0", "1")) == "1",
            control_fanout=int(env_number("HVPS_CONTROL_FANOUT", cls.control_fanout, int)),
            fusion_threshold=int(env_number("HVPS_FUSION_THRESHOLD", cls.fusion_threshold, int)),
            cycle_time_ms=env_number("HVPS_CYCLE_TIME", cls.cycle_time_ms),
            spin_wait_us=env_number("HVPS_SPIN_WAIT_MICROSECONDS", cls.spin_wait_us),
            stall_check_seconds=env_number("HVPS_STALL_CHECK_TIME_SECONDS", cls.stall_check_seconds),
            algorithm=algorithm,
            ring_chunk_bytes=int(env_number("HVPS_RING_CHUNK_BYTES", cls.ring_chunk_bytes, int)) or cls.ring_chunk_bytes,
            stall_shutdown_seconds=env_number("HVPS_STALL_SHUTDOWN_TIME_SECONDS", cls.stall_shutdown_seconds),
            timeline=env_text("HVPS_TIMELINE", ""),
            timeline_mark_cycles=env_choice("HVPS_TIMELINE_MARK_CYCLES", "0", ("0", "1")) == "1",
            log_level=env_choice("HVPS_LOG_LEVEL", "", LOG_LEVELS + ("",)),
        )
