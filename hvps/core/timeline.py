"""A Chrome-trace timeline of every collective, in Horovod's format of phases.

Switched on by ``HVPS_TIMELINE=path`` (or Horovod's ``HOROVOD_TIMELINE``; hvpsrun ``--timeline-filename``), or
``hvd.start_timeline(path, mark_cycles)`` / ``hvd.stop_timeline()``. Rank 0 writes one row per tensor name with, as
Horovod does, ``NEGOTIATE_<OP>`` from submission until every rank had submitted, then ``<OP>`` (``ALLREDUCE``,
``BROADCAST``, ...) while it ran; with ``HVPS_TIMELINE_MARK_CYCLES=1`` (``HOROVOD_TIMELINE_MARK_CYCLES``) an instant
``CYCLE_START`` mark at each engine cycle. Open the file in ``chrome://tracing`` or Perfetto.

The file is a JSON array written as the job runs: each executed collective's events are flushed to the file at
once, so it can be read mid-run (both tools accept the array without its closing bracket), and ``close()`` ends it
as valid JSON.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Optional


class Timeline:
    """Appends trace events to ``path``; each tensor name gets its own row.

    Args:
        path: the file to write (truncated).
        mark_cycles: whether :meth:`mark` calls for cycle starts are wanted (the engine asks ``mark_cycles``).

    Raises:
        OSError: ``path`` cannot be opened for writing.
    """

    def __init__(self, path: str, mark_cycles: bool = False) -> None:
        self.mark_cycles = bool(mark_cycles)
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()
        self._rows: dict = {}
        self._origin = time.monotonic()
        self._file.write("[\n")
        self._write({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "hvps rank 0"}})
        self._file.flush()

    def _row(self, name: str) -> int:
        row = self._rows.get(name)
        if row is None:
            row = self._rows[name] = len(self._rows) + 1
            self._write({"name": "thread_name", "ph": "M", "pid": 0, "tid": row, "args": {"name": name}})
        return row

    def _write(self, event: dict) -> None:
        self._file.write(json.dumps(event, separators=(",", ":")) + ",\n")

    def span(self, name: str, phase: str, start: float, end: float, args: Optional[dict] = None) -> None:
        """One completed phase of collective ``name`` between two ``time.monotonic()`` readings (buffered until
        :meth:`flush`)."""
        with self._lock:
            if self._file.closed:  # stop_timeline() raced with a collective finishing
                return
            event = {"name": phase, "ph": "X", "pid": 0, "tid": self._row(name),
                     "ts": round((start - self._origin) * 1e6, 1), "dur": round((end - start) * 1e6, 1)}
            if args:
                event["args"] = args
            self._write(event)

    def mark(self, name: str) -> None:
        """An instant event ``name`` (e.g. ``CYCLE_START``) across the whole trace, now (buffered)."""
        with self._lock:
            if not self._file.closed:
                self._write({"name": name, "ph": "i", "s": "g", "pid": 0, "tid": 0,
                             "ts": round((time.monotonic() - self._origin) * 1e6, 1)})

    def flush(self) -> None:
        """Hand what was written so far to the file, so that readers see it mid-run."""
        with self._lock:
            if not self._file.closed:
                self._file.flush()

    def close(self) -> None:
        """End the array (the file is then valid JSON) and close the file; idempotent."""
        with self._lock:
            if self._file.closed:
                return
            self._file.write("{}]\n")
            self._file.close()
