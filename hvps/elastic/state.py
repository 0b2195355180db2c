"""What an elastic training loop commits, restores and syncs (Horovod's ``State`` and ``ObjectState``).

``commit()`` saves the state in host memory and checks for host updates; ``restore()`` returns to the
last save; ``sync()`` makes every rank's state rank 0's. The framework adapters subclass these for
models, optimizers and samplers.
"""

from __future__ import annotations

import copy
import queue
from typing import Any, Callable, Iterable, Optional

from .. import api
from ..runtime.bootstrap import elastic_session
from .notification import HostsUpdatedInterrupt, HostUpdateResult

#: the name of the collective that shares rank 0's view of host updates
HOST_UPDATES_NAME = "hvps.elastic.host_updates"


def _broadcast_object(obj: Any) -> Any:
    return api.broadcast_object(obj, 0, name="hvps.elastic.object_state")


def _broadcast_host_updates(obj: Any) -> Any:
    return api.broadcast_object(obj, 0, name=HOST_UPDATES_NAME)


class SavedValue:
    """What saves, restores and syncs a value: the ``State`` of ``hvd.elastic`` and the torch state's
    per-value handlers alike (subclasses implement all three)."""

    def save(self) -> None:
        """Copy the value to host memory."""
        raise NotImplementedError(f"{type(self).__name__} must implement save()")

    def restore(self) -> None:
        """Return to the last saved value, undoing uncommitted changes."""
        raise NotImplementedError(f"{type(self).__name__} must implement restore()")

    def sync(self) -> None:
        """Make every rank's value rank 0's (a collective)."""
        raise NotImplementedError(f"{type(self).__name__} must implement sync()")


class State(SavedValue):
    """Base of every elastic state.

    Subclasses implement :meth:`save`, :meth:`restore` and :meth:`sync`.

    Args:
        bcast_object: ``bcast_object(obj) -> obj`` broadcasts a picklable object from rank 0 (default: hvps's).
        get_rank: gives this rank (default: hvps's ``rank``).
    """

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None) -> None:
        self._bcast_object = bcast_object or _broadcast_object
        self._rank = get_rank or api.rank
        self._host_bcast = _broadcast_host_updates if bcast_object is None else bcast_object
        self._host_messages: queue.Queue = queue.Queue()
        self._last_updated_timestamp: float = 0
        self._reset_callbacks: list = []
        self._commits = 0

    @property
    def same_on_every_rank(self) -> bool:
        """Whether every rank holds the same state after a commit (True here). Only then may the sync after a
        reset that only removed hosts be skipped; a sharded state (each rank its own shard) re-shards then."""
        return True

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Run each of ``callbacks`` (no arguments) after every reset, before the state is synced:
        e.g. to scale the learning rate to the new ``hvd.size()``.

        Args:
            callbacks: functions taking no arguments, run in order (after those registered before).

        Raises:
            TypeError: one of them is not callable.
        """
        callbacks = list(callbacks)
        for callback in callbacks:
            if not callable(callback):
                raise TypeError(f"reset callback {callback!r} is not callable; pass functions taking no arguments")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """After a reset: forget host notices from before it, then run the reset callbacks in order."""
        self._host_messages = queue.Queue()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: HostUpdateResult = HostUpdateResult.mixed) -> None:
        """A host-update notice (from the notification manager; any thread).

        Args:
            timestamp: when the hosts changed; a notice no newer than the last one acted on is ignored.
            update_res: what changed: hosts ``added``, ``removed`` or ``mixed``.
        """
        self._host_messages.put((timestamp, HostUpdateResult(update_res)))

    def commit(self) -> None:
        """Save the state, then check for host updates (a collective: every rank must commit together;
        raises HostsUpdatedInterrupt on every rank when rank 0 was notified of a change).

        A commit copies the state (from the GPU, for tensors there): commit every few batches, trading
        the lost work after a failure against the copy's cost.

        Raises:
            HostsUpdatedInterrupt: on every rank, when the hosts changed (``hvd.elastic.run`` handles it).
        """
        self.save()
        self.check_host_updates()
        self._commits += 1  # completed: a commit that a host update interrupts is no progress (issue 38)

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt, on every rank at once, when rank 0 has a host-update notice
        newer than the last one acted on (a collective: rank 0's view is broadcast).

        Raises:
            HostsUpdatedInterrupt: the hosts changed (``skip_sync`` when hosts were only removed).
        """
        prev = last = self._last_updated_timestamp
        kind = HostUpdateResult.no_update
        driver_notice = elastic_session.pending_notice()  # hvpsrun's elastic driver tells rank 0 only
        if driver_notice is not None:
            self.on_hosts_updated(*driver_notice)
        while True:
            try:
                timestamp, update = self._host_messages.get_nowait()
            except queue.Empty:
                break
            if timestamp > last:
                last = timestamp
                kind |= update
        prev, last, kind = self._host_bcast((prev, last, int(kind)))
        self._last_updated_timestamp = last
        if last > prev:
            raise HostsUpdatedInterrupt(skip_sync=HostUpdateResult(kind) == HostUpdateResult.removed)



class ObjectState(State):
    """State of plain picklable Python objects, given as keyword arguments and kept as attributes.

    ``ObjectState(epoch=0, batch=0)``: ``state.epoch`` is saved by ``commit()``, put back by ``restore()``
    and broadcast from rank 0 by ``sync()``. Saves and restores copy the objects (deep copies), so that
    changing a list in place after a commit cannot change what ``restore()`` returns to.

    Args:
        bcast_object: as :class:`State`'s.
        get_rank: as :class:`State`'s.
        **kwargs: the objects, by attribute name.

    Raises:
        ValueError: a name starts with ``_`` or is one of the state's methods.
    """

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs: Any) -> None:
        for name in kwargs:
            if name.startswith("_") or hasattr(type(self), name):
                raise ValueError(f"elastic state attribute {name!r} would hide a method or internal attribute of "
                                 f"{type(self).__name__}; rename it")
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))
