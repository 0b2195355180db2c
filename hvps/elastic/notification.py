"""Host-update notices: what an elastic launcher tells a running worker, and the interrupt it causes.

The launcher's driver notifies rank 0 only (as Horovod's does) through :func:`notify_hosts_updated`;
the process-wide :data:`notification_manager` forwards each notice to the states of the
``hvd.elastic.run`` loops running in this process, and ``State.check_host_updates`` (a collective)
turns rank 0's view into a :class:`HostsUpdatedInterrupt` on every rank at the same point.
"""

from __future__ import annotations

import enum
import numbers
import threading
from typing import Any, Union


class HostUpdateResult(enum.IntFlag):
    """What changed in the job's hosts (Horovod's values): removals only allow skipping the sync."""

    no_update = 0
    removed = 1
    added = 2
    mixed = 3


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added or removed: every rank leaves the training function at the same commit and
    re-initializes. ``skip_sync`` is true when hosts were only removed (the survivors' state is the
    same everywhere, so the sync after the reset may be left out when every rank agrees).

    Args:
        skip_sync: hosts were only removed.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts were updated: re-initializing" + (" (removals only)" if skip_sync else ""))
        self.skip_sync = bool(skip_sync)


def update_kind(value: Union[HostUpdateResult, int, str]) -> HostUpdateResult:
    """``value`` (a HostUpdateResult, its int, or its name) as a HostUpdateResult; ValueError otherwise."""
    if isinstance(value, str) and value in HostUpdateResult.__members__:
        return HostUpdateResult[value]
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and 0 <= int(value) <= 3:
        return HostUpdateResult(int(value))
    raise ValueError(f"update kind {value!r} is not a HostUpdateResult: give one of "
                     f"{', '.join(HostUpdateResult.__members__)} (or 0..3)")


class WorkerNotificationManager:
    """Forwards host-update notices to the registered listeners (the running loops' states)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: list = []

    def register_listener(self, listener: Any) -> None:
        """Forward notices to ``listener`` from now on (once, however often it is registered).

        Args:
            listener: an object with ``on_hosts_updated(timestamp, update_res)`` (an elastic state).
        """
        with self._lock:
            if not any(existing is listener for existing in self._listeners):
                self._listeners.append(listener)

    def remove_listener(self, listener: Any) -> None:
        """Stop forwarding notices to ``listener`` (nothing happens when it is not registered).

        Args:
            listener: a registered listener.
        """
        with self._lock:
            self._listeners = [existing for existing in self._listeners if existing is not listener]

    def listeners(self) -> list:
        """The registered listeners.

        Returns:
            A copy of their list, in registration order.
        """
        with self._lock:
            return list(self._listeners)

    def handle_hosts_updated(self, timestamp: float, update_res: Union[HostUpdateResult, int, str]) -> int:
        """Hand the notice to every listener.

        Args:
            timestamp: the driver's time of the update.
            update_res: ``added``, ``removed`` or ``mixed`` (a HostUpdateResult, its int or its name).

        Returns:
            How many listeners got it (0: no elastic loop is running, and the notice is dropped, as Horovod
            drops it: the next rendezvous includes the change).

        Raises:
            ValueError: ``timestamp`` is not a number, or ``update_res`` names no HostUpdateResult.
        """
        if not isinstance(timestamp, numbers.Real) or isinstance(timestamp, bool) or timestamp != timestamp:
            raise ValueError(f"timestamp {timestamp!r} must be a number (the driver's time of the update)")
        kind = update_kind(update_res)
        listeners = self.listeners()
        for listener in listeners:
            listener.on_hosts_updated(timestamp, kind)
        return len(listeners)


#: the process-wide manager (one per worker process)
notification_manager = WorkerNotificationManager()


def notify_hosts_updated(timestamp: float, update_kind: Union[HostUpdateResult, int, str] = HostUpdateResult.mixed
                         ) -> int:
    """The driver's entry point: hosts changed at ``timestamp`` (``added``, ``removed`` or ``mixed``).

    Thread-safe; call it on rank 0 (only rank 0's notices count at the next ``commit()``).

    Args:
        timestamp: the driver's time of the update.
        update_kind: ``added``, ``removed`` or ``mixed`` (a HostUpdateResult, its int or its name).

    Returns:
        The number of running ``hvd.elastic.run`` loops that received it.

    Raises:
        ValueError: as :meth:`WorkerNotificationManager.handle_hosts_updated`.
    """
    return notification_manager.handle_hosts_updated(timestamp, update_kind)
