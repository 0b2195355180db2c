"""Handles: what an asynchronous collective returns."""

from __future__ import annotations

import _thread
import time
from typing import Any, Callable, Optional

from .errors import HvpsError

#: a waiting user thread gives up on its own after this multiple of the stall time (plus a second): the
#: coordinator reports stalls first and more precisely, but it cannot reach a rank whose link or coordinator is
#: gone. More than 2: a collective whose missing rank was held in another one that stalled gets a second stall
#: window from then (``Coordinator._restart_clocks``); at 1.5 its waiters gave up first, with a message blaming
#: rank 0, and their unanswered entries made ``hvps.shutdown()`` abort the job.
_WATCHDOG_FACTOR = 2.5


def watchdog_seconds(stall_seconds: float) -> float:
    """How long a waiting thread waits for a collective before it gives up on its own.

    Args:
        stall_seconds: the stall time (``HVPS_STALL_CHECK_TIME_SECONDS``, or the shutdown time when longer).

    Returns:
        Seconds.
    """
    return stall_seconds * _WATCHDOG_FACTOR + 1.0
#: serialises the first ``set_result``/``set_error`` of any handle (the engine thread, a waiter's
#: watchdog and shutdown may race to finish one): exactly one of them opens the handle's gate
_SETTING = _thread.allocate_lock()


class Handle:
    """An in-flight collective; owns its input and output buffers until it completes.

    The ``*_async`` functions return one; users call :meth:`wait` and :meth:`poll`.

    Args:
        name: the collective's full name.
        buffers: the input and output buffers it keeps alive until it completes.
        stall_seconds: the stall time; a waiter's watchdog fails the handle 1.5 times it (plus 1 s) after
            submission without an answer from rank 0, or after its start without an end.
        expedite: called with the handle by the first :meth:`wait` that would block (the engine's fast path).
    """

    __slots__ = ("name", "_done", "_gate", "_result", "_error", "_buffers", "_submitted", "_started", "_limit",
                 "event", "_expedite", "_source", "_finish", "__weakref__")

    def __init__(self, name: str, buffers: tuple = (), stall_seconds: float = 60.0,
                 expedite: Optional[Callable[["Handle"], None]] = None) -> None:
        self.name = name
        #: whether the result or error is in; ``_gate`` is held until then (waiters block on it:
        #: a bare lock costs a fraction of a threading.Event, and a handle is made per gradient)
        self._done = False
        self._gate = _thread.allocate_lock()
        self._gate.acquire()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._buffers = buffers
        self._submitted = time.monotonic()
        self._started: Optional[float] = None
        self._limit = watchdog_seconds(stall_seconds)
        #: CUDA results: what they are valid after on the device, with ``wait(result)`` (the waiter's stream on
        #: that device waits for it) and ``query()`` (None on the host)
        self.event: Any = None
        #: called once, with the handle, by the first wait() that would block: the engine then starts
        #: the collective now instead of at its next cycle, or lets the waiter run it (it has nothing
        #: else to do)
        self._expedite = expedite
        #: a handle made by ``then``: the handle it waits for; ``_finish`` turns that one's result (or,
        #: set by ``finish_with``, this handle's own) into the result ``wait()`` returns
        self._source: Optional[Handle] = None
        self._finish: Optional[Callable[[Any], Any]] = None

    def finish_with(self, finish: Callable[[Any], Any]) -> "Handle":
        """Make this handle's result ``finish(result)``, computed once, by the first ``wait()`` that
        succeeds (a gradient's one finisher, without a second handle).

        Args:
            finish: turns the collective's result into the handle's.

        Returns:
            This handle.
        """
        self._finish = finish
        return self

    def then(self, finish: Callable[[Any], Any]) -> "Handle":
        """A handle on the same collective whose result is ``finish(this handle's result)``, computed once,
        by the first ``wait()`` (adapters turn core arrays into framework tensors this way).

        Args:
            finish: turns this handle's result into the new handle's.

        Returns:
            The new handle.
        """
        derived = Handle(self.name)
        derived._source, derived._finish = self, finish
        return derived

    def poll(self) -> bool:
        """Whether the collective has finished (successfully or not); never blocks. On CUDA tensors,
        once the GPU has finished it, as in Horovod (not once the engine has enqueued it).

        Returns:
            True once :meth:`wait` would return (or raise) at once.
        """
        if self._source is not None:
            return self._done or self._source.poll()
        return self._done and (self.event is None or self._error is not None or self.event.query())

    done = poll

    @property
    def finished(self) -> bool:
        """Whether the engine has finished with the collective (the host's view: on CUDA the GPU may still
        be running it; ``poll`` waits for that too). What the engine itself checks."""
        return self._done

    @property
    def claimed(self) -> bool:
        """Whether a ``wait()`` has taken the result (until then the name stays in use, as in Horovod,
        where a name is outstanding until it is synchronized)."""
        return not self._buffers

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until the collective finishes and return its result.

        Args:
            timeout: seconds to wait at most (None: until it finishes or fails).

        Returns:
            The collective's result.

        Raises:
            HvpsError: the collective failed (on every rank that submitted it), the watchdog gave up on it, or
                ``timeout`` passed.
        """
        if self._source is not None:
            if not self._done:
                self._result = self._finish(self._source.wait(timeout))
                self._done = True
            return self._result
        deadline = None if timeout is None else time.monotonic() + timeout
        expedite, self._expedite = self._expedite, None
        if expedite is not None and not self._done:
            expedite(self)
        while not self._done:
            if self._gate.acquire(timeout=0.5):
                self._gate.release()  # the gate stays open for every other waiter
                break
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise HvpsError(f"timed out after {timeout} s waiting for '{self.name}'")
            self._check_watchdog(now)
        self._buffers = ()
        if self._error is not None:
            raise self._error
        if self.event is not None:
            # the waiter's current stream on the result's device waits (the host does not), and the
            # result's tensors are marked in use by it (``dataplane/backends/device.py``'s ``Done``)
            self.event.wait(self._result)
        if self._finish is not None:
            self._result = self._finish(self._result)
            self._finish = None
        return self._result

    def _check_watchdog(self, now: float) -> None:
        if self._started is None and now - self._submitted > self._limit:
            self.set_error(HvpsError(
                f"'{self.name}' got no answer from the coordinator (rank 0) within {self._limit:g} s; "
                "rank 0 or the network to it may be down (HVPS_STALL_CHECK_TIME_SECONDS sets the limit)"
            ))
        elif self._started is not None and now - self._started > self._limit:
            self.set_error(HvpsError(
                f"'{self.name}' started on every rank but did not finish within {self._limit:g} s; "
                "a rank or a link between ranks may have died (HVPS_STALL_CHECK_TIME_SECONDS sets the limit)"
            ))

    @property
    def submitted_at(self) -> float:
        """``time.monotonic()`` when the collective was submitted."""
        return self._submitted

    def mark_started(self) -> None:
        """Called by the engine when every rank has agreed and the data starts to move."""
        self._started = time.monotonic()

    def set_result(self, result: Any) -> None:
        """Finish with ``result`` (the first finish counts).

        Args:
            result: what :meth:`wait` returns.
        """
        with _SETTING:
            if self._done:
                return
            self._result = result
            self._open()

    def set_error(self, error: BaseException) -> None:
        """Finish with ``error`` (as HvpsError; the first finish counts).

        Args:
            error: what :meth:`wait` raises (wrapped in an HvpsError naming the collective if it is none).
        """
        if not isinstance(error, HvpsError):
            wrapped = HvpsError(f"'{self.name}' failed: {error}")
            wrapped.__cause__ = error
            error = wrapped
        with _SETTING:
            if self._done:
                return
            self._error = error
            self._open()

    def _open(self) -> None:
        self._done = True
        self._gate.release()
