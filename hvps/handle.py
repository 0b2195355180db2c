"""Handles: what an asynchronous collective returns."""

from __future__ import annotations

import threading
from typing import Any, Optional

from .errors import HvpsError


class Handle:
    """An in-flight collective; owns its input and output buffers until it completes."""

    __slots__ = ("name", "_done", "_result", "_error", "_buffers")

    def __init__(self, name: str, buffers: tuple = ()) -> None:
        self.name = name
        self._done = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._buffers = buffers

    def poll(self) -> bool:
        """Whether the collective has finished (successfully or not); never blocks."""
        return self._done.is_set()

    done = poll

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until the collective finishes and return its result; raise HvpsError if it failed."""
        if not self._done.wait(timeout):
            raise HvpsError(f"timed out after {timeout} s waiting for '{self.name}'")
        self._buffers = ()
        if self._error is not None:
            raise self._error
        return self._result

    def set_result(self, result: Any) -> None:
        self._result = result
        self._done.set()

    def set_error(self, error: BaseException) -> None:
        self._error = error if isinstance(error, HvpsError) else HvpsError(f"'{self.name}' failed: {error}")
        if self._error is not error:
            self._error.__cause__ = error
        self._done.set()
