"""One POSIX shared-memory segment per node, and the counters its ranks synchronise with.

Layout: a header of one 128-byte line per rank (``IN``, ``RED``, ``DONE`` sequence numbers, the rank's
pid, its fast-lane post: ``LANE_SEQ``, ``LANE_BIT``, ``LANE_EPOCH``, ``LANE_SINCE``, the last agreement
whose rows it read, ``LANE_READ``, and the rounds its alltoall's largest block needs, ``A2A_ROUNDS``),
one line for the abort flag and the fast lane's verdicts, then per rank the rows its fast-lane posts name
(two posts' worth, by the parity of their sequence number), padded to whole pages; then per rank a slot of
two buffers (double-buffering: a rank copies round k+1 in while its peers still read round k).

The segment lives in ``/dev/shm`` under a random name chosen by local rank 0; it is
unlinked as soon as every rank has mapped it, so the kernel frees it when the last
process exits, whatever way the job ends. Waits spin briefly, then nap with a growing
sleep (an oversubscribed box keeps its cores for training), and give up with
``HvpsError`` when a peer's process is gone, a peer set the abort flag, or nothing
moved for the stall time.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
import time
from array import array
from typing import Optional

import numpy as np

from ..core.errors import DataPlaneStall, HvpsError

SHM_DIR = "/dev/shm"
#: header fields (int64 each) of a rank's line: the collectives' counters and pid, then the fast lane's post
#: (``hvps/runtime/fast_lane.py``)
IN, RED, DONE, PID, LANE_SEQ, LANE_BIT, LANE_EPOCH, LANE_SINCE, LANE_READ = range(9)
#: per buffer (0, 1): the rounds an alltoall that starts in it needs for the largest block this rank sends or
#: receives (a field per buffer: a rank may start the next alltoall, in the other buffer, before a slow peer read it)
A2A_ROUNDS = (9, 10)
#: fields of the last line: the abort flag, the fast lane's latest agreement, and its last verdicts (a ring)
ABORTED, LANE_DECIDED, LANE_VERDICTS = 0, 1, range(2, 8)
_LINE = 16  # int64 per 128-byte line (two cache lines)
_PAGE = 4096
#: seconds a wait polls (yielding the core to any runnable thread between polls) before napping, the
#: first nap, the longest, and how often peers' pids are checked
_SPIN_S, _NAP, _MAX_NAP, _PID_CHECK = 2e-3, 20e-6, 1e-3, 0.05


class Backoff:
    """How a rank waiting on the segment passes time: it yields the core for the first 2 ms, then naps from 20 µs,
    doubling up to 1 ms. Polling loses no wake-up, and a runnable training thread goes first (as Open MPI's
    ``mpi_yield_when_idle``)."""

    __slots__ = ("_spin_until", "_nap")

    def __init__(self) -> None:
        self._spin_until = time.monotonic() + _SPIN_S
        self._nap = _NAP

    def pause(self) -> bool:
        """Yield the core, or nap once the spin is over; whether it napped (time for the slower checks)."""
        if time.monotonic() < self._spin_until:
            os.sched_yield()
            return False
        time.sleep(self._nap)
        self._nap = min(_MAX_NAP, self._nap * 2)
        return True


def _row_words(size: int) -> int:
    """int64 per fast-lane post's rows: an alltoall's splits (one per rank), or an allgather's two numbers."""
    return max(size, 2)


def header_bytes(size: int) -> int:
    """Bytes of the header for ``size`` ranks: a line per rank, the job's line and the fast lane's rows, in whole
    pages."""
    words = (size + 1) * _LINE + size * 2 * _row_words(size)
    return -(-words * 8 // _PAGE) * _PAGE


def segment_bytes(size: int, buffer_bytes: int) -> int:
    """Bytes of a segment for ``size`` ranks with buffers of ``buffer_bytes``."""
    return header_bytes(size) + size * 2 * buffer_bytes


def new_name() -> str:
    """A fresh, unguessable segment name for this user."""
    return f"hvps-{os.getuid()}-{secrets.token_hex(8)}"


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie or a missing process does not; a stopped one does)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


class Segment:
    """A mapped node segment: ``create`` on local rank 0, ``attach`` on the others, ``unlink`` once all mapped."""

    def __init__(self, name: str, size: int, rank: int, buffer_bytes: int, timeout: float, create: bool) -> None:
        self.name, self.size, self.rank = name, size, rank
        self.buffer_bytes, self.timeout = buffer_bytes, timeout
        self.path = os.path.join(SHM_DIR, name)
        total = segment_bytes(size, buffer_bytes)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, total)  # ENOSPC now, not SIGBUS on first touch
                except OSError:
                    os.unlink(self.path)
                    raise
            elif os.fstat(fd).st_uid != os.getuid():
                raise PermissionError(f"{self.path} belongs to another user")
            self.map = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self.header = np.frombuffer(self.map, np.int64, (size + 1) * _LINE).reshape(size + 1, _LINE)
        self.counters = self.header[:size, :3]
        #: the same header as Python ints: one rank's field is ``_words[rank * _LINE + field]`` (a read costs
        #: ~40 ns, where a numpy comparison of a counter column costs ~3 us; a 4 B allreduce waits 3 times)
        self._words = memoryview(self.map)[:header_bytes(size)].cast("q")
        self.header[rank, PID] = os.getpid()
        self._pids: dict = {}
        #: once set (the engine's event for ranks lost on the control plane), a wait gives up at once
        self.lost: Optional[threading.Event] = None

    def unlink(self) -> None:
        """Remove the name (mappings stay valid); only local rank 0 calls it."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def buffer(self, rank: int, which: int, dtype: np.dtype, count: int) -> np.ndarray:
        """``count`` elements of ``dtype`` at the start of buffer ``which`` (0 or 1) of ``rank``'s slot."""
        offset = header_bytes(self.size) + (2 * rank + which) * self.buffer_bytes
        return np.frombuffer(self.map, dtype, count, offset)

    def publish(self, field: int, value: int) -> None:
        """Set this rank's ``field`` counter (after its data is in place: x86 keeps stores in order)."""
        self._words[self.rank * _LINE + field] = value

    def abort(self) -> None:
        """Tell every peer's wait to give up (this rank failed midway)."""
        self.header[self.size, ABORTED] = 1

    def field(self, rank: int, field: int) -> int:
        """``rank``'s ``field`` (of its header line), as it is now."""
        return self._words[rank * _LINE + field]

    def _rows_at(self, rank: int, parity: int) -> int:
        width = _row_words(self.size)
        return (self.size + 1) * _LINE + (2 * rank + parity) * width

    def publish_rows(self, parity: int, rows) -> None:
        """Write the rows this rank's fast-lane post names into its area ``parity`` (before the post)."""
        at = self._rows_at(self.rank, parity)
        self._words[at:at + len(rows)] = array("q", rows)

    def rows(self, rank: int, parity: int, count: int) -> list:
        """The first ``count`` rows ``rank``'s fast-lane post in area ``parity`` names."""
        at = self._rows_at(rank, parity)
        return self._words[at:at + count].tolist()

    def job_field(self, field: int) -> int:
        """``field`` of the line every rank shares (after the ranks' lines)."""
        return self._words[self.size * _LINE + field]

    def set_job_field(self, field: int, value: int) -> None:
        """Set ``field`` of the line every rank shares (one writer per field: the fast lane's is rank 0)."""
        self._words[self.size * _LINE + field] = value

    def wait(self, field: int, value: int, ranks=None) -> None:
        """Until ``field`` is at least ``value`` on ``ranks`` (every rank when None)."""
        if not self._behind(field, value, ranks):
            return
        self._wait_slow(field, value, ranks)

    def _behind(self, field: int, value: int, ranks) -> bool:
        """Whether ``field`` is below ``value`` on any of ``ranks`` (every rank when None)."""
        words = self._words
        for rank in range(self.size) if ranks is None else ranks:
            if words[rank * _LINE + field] < value:
                return True
        return False

    def _column(self, field: int) -> list:
        """Every rank's ``field``, in rank order."""
        words = self._words
        return [words[rank * _LINE + field] for rank in range(self.size)]

    def _wait_slow(self, field: int, value: int, ranks) -> None:
        last = self._column(field)
        backoff = Backoff()
        start = time.monotonic()
        deadline, next_check = start + self.timeout, start + _PID_CHECK
        while self._behind(field, value, ranks):
            if not backoff.pause():
                continue
            if self.lost is not None and self.lost.is_set():
                self.abort()
                raise HvpsError("shared-memory collective abandoned: the job lost ranks (the control plane "
                                "found them gone) while this rank waited on the node's segment")
            now = time.monotonic()
            if now < next_check:
                continue
            next_check = now + _PID_CHECK
            current = self._column(field)
            if current != last:  # a peer moved: a slow rank, not a stalled one
                last = current
                deadline = now + self.timeout
            self._check_peers(field, value, now > deadline)

    def _check_peers(self, field: int, value: int, stalled: bool) -> None:
        behind = [r for r in range(self.size) if r != self.rank and self.counters[r, field] < value]
        if self.header[self.size, ABORTED]:  # a stall to the engine: its control plane names who died or stopped
            raise DataPlaneStall("shared-memory collective aborted: another rank on this node failed midway "
                                 "(it found a peer dead or stalled)")
        dead = [r for r in behind if not process_alive(int(self.header[r, PID]))]
        if dead:
            self.abort()
            raise HvpsError(f"shared-memory collective failed: local ranks {dead} died while this rank waited "
                            "for them on the node's segment")
        if stalled:
            self.abort()
            raise DataPlaneStall(f"shared-memory collective failed: local ranks {behind} moved no data for "
                                 f"{self.timeout:g} s (HVPS_STALL_CHECK_TIME_SECONDS); a rank hangs or was stopped")

    def close(self) -> None:
        """Drop the mapping (views into it must be gone)."""
        self.header = self.counters = None
        self._words.release()
        try:
            self.map.close()
        except BufferError:  # a caller still holds a view: the kernel frees it at exit
            pass
