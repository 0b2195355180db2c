"""Prometheus metrics of each rank: collectives, negotiation, stalls, steps, checkpoints, host, GPU.

Why a module of its own: the engine, the optimizer and the checkpoint code each call one hook
here, and a hook must cost nothing while metrics are off. So every hook starts by checking the
module-level sink, which is ``None`` until :func:`serve` (or ``HVPS_METRICS_PORT`` at
``hvps.init()``) creates it; prometheus-client is imported only then. With metrics on, hooks
record once per fused response, optimizer step or checkpoint, never per tensor.

Each rank serves its own metrics (``/metrics``, Prometheus text format) from a dedicated
``CollectorRegistry``; host and GPU readings are taken when Prometheus scrapes, not by a thread.

Settings (read at ``hvps.init()``; :func:`serve` takes the same as arguments):

``HVPS_METRICS_PORT``
    base port; each rank serves on this port + its local rank, so ranks sharing a host do not
    collide (scrape ``host:PORT`` ... ``host:PORT+ranks_per_host-1``). Unset: no exporter.
``HVPS_METRICS_ADDR``
    address to bind (default ``127.0.0.1``: only this host can scrape). Give ``0.0.0.0`` or an
    interface's address to expose it, preferably with TLS and basic auth.
``HVPS_METRICS_TLS_CERT``, ``HVPS_METRICS_TLS_KEY``
    PEM certificate (chain) and key: serve HTTPS (TLS 1.2 or newer).
``HVPS_METRICS_BASIC_AUTH_FILE``
    a file whose first line is ``user:password``: requests without them get 401.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import logging
import socket
import threading
import time
from typing import Any, Callable, Optional, Tuple

from ..core.errors import HvpsError
from ..core.launchers import env_local_rank, env_rank
from ..core.settings import env_text

log = logging.getLogger("hvps")

DEFAULT_ADDR = "127.0.0.1"
ENV_PORT, ENV_ADDR = "HVPS_METRICS_PORT", "HVPS_METRICS_ADDR"
ENV_CERT, ENV_KEY, ENV_AUTH = "HVPS_METRICS_TLS_CERT", "HVPS_METRICS_TLS_KEY", "HVPS_METRICS_BASIC_AUTH_FILE"

#: the Instruments hooks record into; None while metrics are off
_sink: Any = None
_exporter: Optional["Exporter"] = None
_job_identity: Optional[Tuple[int, int]] = None
_lock = threading.Lock()


class Exporter:
    """A running exporter: its ``registry``, ``url``, ``addr`` and ``port``; ``close()`` stops it."""

    def __init__(self, instruments: Any, server: Any) -> None:
        self.instruments, self.server = instruments, server
        self.registry = instruments.registry
        self.addr, self.port, self.url = server.addr, server.port, server.url

    def close(self) -> None:
        """Stop serving and switch the hooks off again."""
        global _sink, _exporter
        with _lock:
            if _exporter is self:
                _sink = _exporter = None
        self.server.close()
        self.instruments.close()

    def __repr__(self) -> str:
        return f"Exporter({self.url})"


def set_job_identity(identity: Optional[Tuple[int, int]]) -> None:
    """(rank, local rank) that labels this rank's metrics: ``hvps.init`` sets it, ``shutdown`` clears it."""
    global _job_identity
    _job_identity = identity


def _identity() -> Tuple[int, int]:
    """(rank, local rank): hvps's topology once initialised, else what the launcher exported."""
    if _job_identity is not None:
        return _job_identity
    return env_rank(), env_local_rank()


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def serve(port: Optional[int] = None, addr: Optional[str] = None, *, certfile: Optional[str] = None,
          keyfile: Optional[str] = None, basic_auth: Optional[Tuple[str, str]] = None,
          offset_by_local_rank: bool = True) -> Exporter:
    """Serve this rank's metrics on ``addr:port + local_rank`` (``port`` 0: any free port).

    Arguments left out come from ``HVPS_METRICS_*`` (see the module's docstring); ``basic_auth``
    is ``(user, password)``. Raises RuntimeError while an exporter is running, and HvpsError
    (naming the port) when the port is taken or cannot be bound.
    """
    global _sink, _exporter
    from .instruments import Instruments
    from .server import BindFailed, MetricsServer, read_basic_auth_file

    if port is None:
        port = _port_from_env()
        if port is None:
            raise ValueError(f"serve() needs a port, or {ENV_PORT} set to one")
    addr = addr or env_text(ENV_ADDR, DEFAULT_ADDR)
    certfile = certfile or env_text(ENV_CERT)
    keyfile = keyfile or env_text(ENV_KEY)
    if basic_auth is None and env_text(ENV_AUTH):
        basic_auth = read_basic_auth_file(env_text(ENV_AUTH))
    rank, local_rank = _identity()
    with _lock:
        if _exporter is not None:
            raise RuntimeError(f"hvps metrics are already served at {_exporter.url}; close() that exporter first")
        instruments = Instruments(rank, local_rank, socket.gethostname())
        bound = port + local_rank if port and offset_by_local_rank else port
        try:
            server = MetricsServer(instruments.registry, addr, bound, certfile, keyfile, basic_auth)
        except BindFailed as exc:
            instruments.close()
            raise HvpsError(_bind_failure(exc, addr, port, bound, rank, local_rank)) from exc
        except BaseException:
            instruments.close()
            raise
        _exporter = Exporter(instruments, server)
        _sink = instruments
    if not _is_loopback(addr) and (not certfile or basic_auth is None):
        log.warning("hvps metrics of rank %d are served at %s without %s: anyone who reaches this address can "
                    "read them", rank, _exporter.url, " or ".join(
                        w for w, off in (("TLS", not certfile), ("basic auth", basic_auth is None)) if off))
    return _exporter


def _bind_failure(exc: OSError, addr: str, port: int, bound: int, rank: int, local_rank: int) -> str:
    where = (f"port {bound} ({ENV_PORT}={port} + local rank {local_rank})" if bound != port
             else f"port {bound}")
    if exc.errno == errno.EADDRINUSE:
        return (f"hvps metrics of rank {rank} cannot listen on {addr}:{bound}: {where} is already taken by another "
                "process. Whoever holds it would receive your scrapers' requests, credentials included. Find it "
                f"(`ss -ltnp 'sport = :{bound}'`) and stop it, or choose a base port whose next ranks-per-host ports "
                f"are all free ({ENV_PORT}); serve with TLS ({ENV_CERT}/{ENV_KEY}) and have Prometheus verify the "
                "certificate (tls_config ca_file) so that a squatter cannot pass for this rank")
    return (f"hvps metrics of rank {rank} cannot listen on {addr}:{bound} ({where}): {exc}; "
            f"check {ENV_ADDR} and {ENV_PORT}")


def current() -> Optional[Exporter]:
    """The running exporter, or None."""
    return _exporter


def stop() -> None:
    """Stop the running exporter, if any (hooks cost nothing again)."""
    exporter = _exporter
    if exporter is not None:
        exporter.close()


def _port_from_env() -> Optional[int]:
    """``HVPS_METRICS_PORT`` as a port number (None when unset); ValueError when it is not one."""
    raw = env_text(ENV_PORT)
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) > 65535:
        raise ValueError(f"{ENV_PORT}={raw!r} is not a port number")
    return int(raw)


def start_from_env() -> Optional[Exporter]:
    """At ``hvps.init()``: serve when ``HVPS_METRICS_PORT`` is set and nothing is served yet.

    Metrics were asked for, so what stops them is an HvpsError from ``init`` on this rank, not a
    log line: a taken port (whoever holds it would get the scrapers' credentials), a bad setting,
    an unreadable certificate or auth file. The other ranks' ``init`` returns; they fail their
    first collective after the stall time (``HVPS_STALL_CHECK_TIME_SECONDS``), which this rank
    never submits, and the job ends with this rank's error printed first.
    """
    try:
        port = _port_from_env()
        if port is None or _exporter is not None:
            return _exporter
        exporter = serve(port)
    except HvpsError:
        raise
    except (OSError, ValueError) as exc:
        files = ", ".join(f"{name}={env_text(name)}" for name in (ENV_CERT, ENV_KEY, ENV_AUTH) if env_text(name))
        raise HvpsError(f"hvps metrics ({ENV_PORT}={env_text(ENV_PORT)}) cannot start on this rank: {exc}"
                        + (f"; check {files}" if files else "")) from exc
    log.info("hvps: metrics at %s", exporter.url)
    return exporter


def record_samples(count: int) -> None:
    """Count ``count`` training samples (images) for the samples/s panels; free while metrics are off."""
    if _sink is not None:
        _sink.samples(count)


# -- hooks: one line at each instrumentation point ------------------------------------------
def on_collective(response: Any, entries: list, started: float, fusion_threshold: int) -> None:
    """The engine executed ``response`` (one fused collective), which started at ``started``."""
    if _sink is not None:
        _sink.collective(response, entries, started, fusion_threshold)


def on_collective_error(message: str, mine: bool) -> None:
    """The coordinator reported an error; ``mine``: this rank had submitted the collective."""
    if _sink is not None:
        _sink.collective_error(message, mine)


def on_engine_failure() -> None:
    if _sink is not None:
        _sink.engine_failure()


def on_step() -> None:
    """``DistributedOptimizer.step()`` began (step time is the time between two)."""
    if _sink is not None:
        _sink.step()


def on_sync_start() -> None:
    if _sink is not None:
        _sink.sync_started()


def on_sync_end(compression: Any) -> None:
    """``synchronize()`` installed the reduced gradients; ``compression``'s stats give the ratio."""
    if _sink is not None:
        _sink.sync_finished(compression)


def timed_checkpoint(operation: str) -> Callable:
    """Decorator for a checkpoint ``save`` or ``load`` method: its duration and file size."""
    def decorate(func: Callable) -> Callable:
        @functools.wraps(func)
        def timed(*args: Any, **kwargs: Any) -> Any:
            sink = _sink
            if sink is None:
                return func(*args, **kwargs)
            started = time.perf_counter()
            result = func(*args, **kwargs)
            sink.checkpoint(operation, time.perf_counter() - started, result)
            return result
        return timed
    return decorate


__all__ = ["Exporter", "serve", "set_job_identity", "current", "stop", "start_from_env", "record_samples", "timed_checkpoint",
           "on_collective", "on_collective_error", "on_engine_failure", "on_step", "on_sync_start", "on_sync_end"]
