"""Opening a file hvps did not write (a hostfile, a secret, a checkpoint, the doctor's record) as an
untrusted input: one rule for all of them. The name is opened without blocking (a FIFO planted at it would
hang the reader for ever), then the descriptor, not the name, is checked (a file swapped after a check
cannot slip through): a regular file, optionally one that does not follow a symlink, belongs to this user,
withholds the given permission bits from others and is at most so many bytes."""

from __future__ import annotations

import os
import stat
from typing import Optional


class RefusedFile(OSError):
    """A file that fails :func:`open_untrusted`'s checks. ``reason`` says why in words a message can
    carry after the file's name ("is not a regular file", "is writable by group or others (mode 664)")."""

    def __init__(self, path: os.PathLike, reason: str, missing: bool = False) -> None:
        super().__init__(f"{os.fspath(path)} {reason}")
        self.path = os.fspath(path)
        self.reason = reason
        #: the file does not exist (a caller may treat that apart: a first run, an optional file)
        self.missing = missing


def open_untrusted(path: os.PathLike, *, follow_links: bool = True, own: bool = False, forbidden_mode: int = 0,
                   max_bytes: Optional[int] = None) -> int:
    """A blocking read descriptor of ``path``, once the file passed every check asked for.

    Args:
        path: the file.
        follow_links: False refuses a symlink at ``path`` (``O_NOFOLLOW``).
        own: the file must belong to this process's effective user.
        forbidden_mode: permission bits the file must not have (``0o077``: readable by nobody else,
            for a secret; ``0o022``: writable by nobody else, for a file whose contents are acted on).
        max_bytes: the largest size accepted (None: any size).

    Returns:
        The descriptor; the caller closes it.

    Raises:
        RefusedFile: the file is missing (``missing`` set), cannot be opened, or fails a check; ``reason``
            says which.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise RefusedFile(path, "does not exist", missing=True) from None
    except OSError as exc:  # ELOOP: a symlink under O_NOFOLLOW
        link = "" if follow_links else "; a symlink is refused"
        raise RefusedFile(path, f"cannot be opened as a regular file ({exc.strerror}{link})") from None
    try:
        info = os.fstat(fd)
        problem = _problem(info, own, forbidden_mode, max_bytes)
        if problem:
            raise RefusedFile(path, problem)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _problem(info: os.stat_result, own: bool, forbidden_mode: int, max_bytes: Optional[int]) -> Optional[str]:
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file (a FIFO, device or directory?)"
    if own and info.st_uid != os.geteuid():
        return f"belongs to user {info.st_uid}, not to this one ({os.geteuid()})"
    if info.st_mode & forbidden_mode:
        mode = stat.filemode(info.st_mode)
        if forbidden_mode & 0o044:
            return f"may be read or written by others (mode {mode})"
        return f"is writable by group or others (mode {mode})"
    if max_bytes is not None and info.st_size > max_bytes:
        return f"holds {info.st_size} bytes, more than the {max_bytes} accepted"
    return None


def read_untrusted(path: os.PathLike, limit: int, **checks) -> bytes:
    """At most ``limit`` bytes from the start of ``path``, opened by :func:`open_untrusted` with ``checks``.

    Args:
        path: the file.
        limit: how many bytes to read at most.
        **checks: :func:`open_untrusted`'s keyword arguments.

    Returns:
        The bytes read.

    Raises:
        RefusedFile: as :func:`open_untrusted`, or the read failed.
    """
    fd = open_untrusted(path, **checks)
    try:
        return os.read(fd, limit)
    except OSError as exc:
        raise RefusedFile(path, f"cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)
