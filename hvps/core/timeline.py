"""A Chrome-trace timeline of every collective (``HVPS_TIMELINE=path``, hvpsrun ``--timeline-filename``).

Rank 0 writes one event per collective and phase: ``NEGOTIATE`` from submission
until every rank had submitted, then the operation itself. Open the file in
``chrome://tracing`` or Perfetto. The file is a JSON array written as it goes,
which both tools read even when the job died before closing it.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Optional


class Timeline:
    """Appends trace events to ``path``; each tensor name gets its own row."""

    def __init__(self, path: str, mark_cycles: bool = False) -> None:
        #: accepted for Horovod's ``start_timeline(path, mark_cycles)``; hvps's engine marks no cycles
        self.mark_cycles = mark_cycles
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._file.write("[\n")
        self._lock = threading.Lock()
        self._rows: dict = {}
        self._origin = time.monotonic()

    def _row(self, name: str) -> int:
        row = self._rows.get(name)
        if row is None:
            row = self._rows[name] = len(self._rows) + 1
            self._write({"name": "thread_name", "ph": "M", "pid": 0, "tid": row, "args": {"name": name}})
        return row

    def _write(self, event: dict) -> None:
        self._file.write(json.dumps(event, separators=(",", ":")) + ",\n")

    def span(self, name: str, phase: str, start: float, end: float, args: Optional[dict] = None) -> None:
        """One completed phase of collective ``name`` between two ``time.monotonic()`` readings."""
        with self._lock:
            if self._file.closed:  # stop_timeline() raced with a collective finishing
                return
            event = {"name": phase, "ph": "X", "pid": 0, "tid": self._row(name),
                     "ts": round((start - self._origin) * 1e6, 1), "dur": round((end - start) * 1e6, 1)}
            if args:
                event["args"] = args
            self._write(event)

    def close(self) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._file.write("{}]\n")
            self._file.close()
