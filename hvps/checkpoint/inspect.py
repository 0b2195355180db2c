"""Inspect a checkpoint's HDF5 metadata in a helper process, under a deadline.

libhdf5 parses a file's structure in C; a crafted file can make it loop forever (a
corrupt global heap does, while a string attribute is read) or crash, and no Python
code in the same process can stop that.  :func:`inspect_header` therefore runs
:func:`read_header_local` (opening the file, the safety checks, headers, attributes,
manifest) in a helper: ``sys.executable`` started with ``subprocess`` (never a fork of
the caller, which may be a multi-threaded MPI process).  A helper that overruns the
deadline is killed, one that dies is reaped, and either becomes a CheckpointError naming
the file, so ``load("latest")`` falls back and ``hvps ckpt verify`` reports it as bad.

The helper imports h5py once and then serves one request per line (JSON both ways: no
pickle crosses the pipe), so only the first inspection of a process pays its start-up;
:func:`prestart` (called when a CheckpointManager is created on the root) begins that
start-up early.  Its heap may grow by MEMORY_LIMIT at most, so a file that makes libhdf5
allocate gigabytes fails too.

``HVPS_CHECKPOINT_INSPECT_TIMEOUT`` (seconds, default 10) plus 1 s per GiB of file is
the deadline; 0 inspects in this process without one (for files you trust).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from ..core.errors import HvpsError
from ..core.settings import env_number, env_text
from .format import (CheckpointError, DatasetEntry, Header, IncompatibleCheckpointError, Reader, open_regular,
                     read_header_local)
from .safety import KEY_ENV

TIMEOUT_ENV = "HVPS_CHECKPOINT_INSPECT_TIMEOUT"
DEFAULT_TIMEOUT = 10.0
PER_GIB = 1.0  # extra seconds per GiB of file
MEMORY_LIMIT = 1 << 30  # heap the helper may add after start-up (the manifest is at most 64 MiB)
START_TIMEOUT = 120.0  # importing h5py on a loaded node (not the file's fault)
# The helper imports hvps' checkpoint modules without the package __init__s of hvps and
# hvps.checkpoint (numpy and h5py only, no engine).
_BOOT = ("import os, sys, types\n"
         "for name, path in (('hvps', sys.argv[1]), ('hvps.checkpoint', os.path.join(sys.argv[1], 'checkpoint'))):\n"
         "    pkg = types.ModuleType(name); pkg.__path__ = [path]; sys.modules[name] = pkg\n"
         "from hvps.checkpoint.inspect import serve\n"
         "serve(int(sys.argv[2]))\n")


def deadline_s(path: Path) -> float:
    """Seconds the helper may take for ``path`` (0: no helper)."""
    base = env_number(TIMEOUT_ENV, DEFAULT_TIMEOUT)
    if base == 0:
        return 0.0
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    return base + PER_GIB * size / (1 << 30)


# ----------------------------------------------------------------------------- helper side
def _header_json(h: Header) -> dict:
    return {"attrs": h.attrs, "entries": [dataclasses.astuple(e) for e in h.entries], "groups": h.groups,
            "total_bytes": h.total_bytes, "offsets": h.offsets, "manifest_sha256": h.manifest_sha256}


def _answer(path: str) -> dict:
    try:
        return {"header": _header_json(read_header_local(path))}
    except CheckpointError as exc:
        return {"error": exc.reason, "problems": [str(p) for p in exc.problems],
                "incompatible": isinstance(exc, IncompatibleCheckpointError)}
    except Exception as exc:  # noqa: BLE001 - a bug in hvps, reported as one by the caller
        return {"bug": f"{type(exc).__name__}: {exc}"}


def _limit_memory(resource) -> None:
    """Cap the helper's data segment at what it uses now + MEMORY_LIMIT (Linux), so that a
    file whose metadata makes libhdf5 allocate gigabytes fails instead."""
    try:
        with open("/proc/self/status") as f:
            used = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmData:"))
    except (OSError, StopIteration, ValueError):
        return
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = used + MEMORY_LIMIT if hard == resource.RLIM_INFINITY else min(used + MEMORY_LIMIT, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def serve(out_fd: int) -> None:
    """The helper's loop: one JSON request per line on stdin, one answer per line on ``out_fd``."""
    import resource

    import h5py  # noqa: F401 - imported before "ready", so requests are timed without it

    _limit_memory(resource)
    out = os.fdopen(out_fd, "wb")
    try:
        out.write(b'{"ready": true}\n')
        out.flush()
        for line in sys.stdin.buffer:
            request = json.loads(line)
            if request.get("key") is None:
                os.environ.pop(KEY_ENV, None)
            else:
                os.environ[KEY_ENV] = request["key"]
            out.write(json.dumps(_answer(request["path"])).encode() + b"\n")
            out.flush()
    except BrokenPipeError:  # the caller exited (it may never have asked anything): nothing to answer
        os._exit(0)


# ----------------------------------------------------------------------------- caller side
class _Helper:
    """One running helper process and the read end of its answers."""

    def __init__(self) -> None:
        rfd, wfd = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(Path(__file__).resolve().parent.parent), str(wfd)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, pass_fds=(wfd,))
        except OSError as exc:
            os.close(rfd)
            raise HvpsError(f"cannot start the checkpoint inspection helper ({sys.executable}): {exc}") from exc
        finally:
            os.close(wfd)
        self.fd, self.pid, self.buf, self.ready = rfd, os.getpid(), b"", False

    def wait_ready(self) -> None:
        """Wait until the helper has imported h5py (HvpsError if it cannot)."""
        try:
            line = self.read_line(time.monotonic() + START_TIMEOUT)
        except TimeoutError:
            line = None
        if line is None:
            code = self.stop()
            raise HvpsError(f"the checkpoint inspection helper did not start ({_describe(code)}; "
                            "its error, if any, is on stderr above)")
        self.ready = True

    def read_line(self, deadline: float) -> Optional[bytes]:
        """The next answer line; None at end of file; TimeoutError past ``deadline``."""
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                return None
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line

    def ask(self, path: Path, timeout: float) -> Optional[dict]:
        key = env_text(KEY_ENV)
        self.proc.stdin.write(json.dumps({"path": str(path), "key": key}).encode() + b"\n")
        self.proc.stdin.flush()
        line = self.read_line(time.monotonic() + timeout)
        return None if line is None else json.loads(line)

    def stop(self) -> Optional[int]:
        """Kill the helper; its exit status (negative: the signal that ended it)."""
        for close in (self.proc.stdin.close, lambda: os.close(self.fd)):
            try:
                close()
            except OSError:
                pass
        try:
            return self.proc.wait(0.2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


_lock = threading.Lock()
_helper: Optional[_Helper] = None


def _describe(code: Optional[int]) -> str:
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"


def _current() -> _Helper:
    """This process's helper, started if needed (call with _lock held)."""
    global _helper
    if _helper is not None and (_helper.pid != os.getpid() or _helper.proc.poll() is not None):
        _helper = None  # inherited over a fork, or gone since the last request
    if _helper is None:
        _helper = _Helper()
    return _helper


def prestart() -> None:
    """Start the helper now, without waiting for it (it imports h5py while the caller goes
    on), unless inspection runs in-process."""
    if env_number(TIMEOUT_ENV, DEFAULT_TIMEOUT) != 0:
        with _lock:
            _current()


def _ask(path: Path, timeout: float) -> dict:
    global _helper
    with _lock:
        helper = _current()
        if not helper.ready:
            _helper = None
            helper.wait_ready()
            _helper = helper
        try:
            answer = helper.ask(path, timeout)
        except TimeoutError:
            _helper = None
            helper.stop()
            raise CheckpointError(f"inspecting its HDF5 metadata took over {timeout:.3g} s ({TIMEOUT_ENV}): "
                                  "corrupt HDF5 structure?", path) from None
        except (OSError, ValueError) as exc:  # a broken pipe: the helper died between requests
            _helper = None
            raise CheckpointError(f"the inspection helper failed: {exc}", path) from exc
        if answer is None:
            _helper = None
            code = helper.stop()
            raise CheckpointError(f"inspecting its HDF5 metadata crashed the helper process "
                                  f"({_describe(code)}): corrupt HDF5 structure?", path)
        return answer


def inspect_header(path: Path) -> Header:
    """:func:`read_header_local` of ``path`` in the helper, under :func:`deadline_s`."""
    if os.path.exists(path):  # a FIFO or a device is refused at once, never handed to libhdf5 (issue 38)
        os.close(open_regular(path))
    timeout = deadline_s(path)
    if timeout == 0:
        return read_header_local(path)
    answer = _ask(path, timeout)
    if "bug" in answer:
        raise RuntimeError(f"{path}: checkpoint inspection failed: {answer['bug']}")
    if "error" in answer:
        cls = IncompatibleCheckpointError if answer["incompatible"] else CheckpointError
        raise cls(answer["error"], path, answer["problems"])
    h: dict[str, Any] = answer["header"]
    entries = [DatasetEntry(p, d, s, tuple(shape), n, sha, start) for p, d, s, shape, n, sha, start in h["entries"]]
    return Header(path, h["attrs"], entries, h["groups"], total_bytes=h["total_bytes"], offsets=h["offsets"],
                  manifest_sha256=h["manifest_sha256"])


@atexit.register
def stop_helper() -> None:
    """Stop this process's helper (the next inspection starts a new one)."""
    global _helper
    with _lock:
        if _helper is not None and _helper.pid == os.getpid():
            _helper.stop()
        _helper = None


def read_header(path: os.PathLike) -> Header:
    """Open ``path``, check format name and version, read the manifest, check it against
    ``manifest_sha256`` (and its signature when HVPS_CHECKPOINT_KEY is set) and its schema,
    and compare it with the file's structure and storage (checkpoint/safety.py).  Reads no
    tensor data.  Raises CheckpointError naming the file for any defect.

    All of this runs in this module's helper process under a deadline, so that
    a file that makes libhdf5 hang or crash ends in a CheckpointError too."""
    return inspect_header(Path(path))


def read_verified(path: os.PathLike) -> tuple:
    """(header, buffer) of a fully verified checkpoint; CheckpointError otherwise."""
    reader = Reader(path, read_header(path))
    buf = reader.read()
    reader.verify()
    return reader.header, buf


def verify_file(path: os.PathLike) -> Header:
    """Check everything about ``path`` (structure, manifest, every dataset's SHA-256)."""
    header, _ = read_verified(path)
    return header
