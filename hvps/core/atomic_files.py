"""Publishing a file atomically and durably, and removing what dead writers left behind.

The rule, for every file a job must find whole or not at all after a crash (checkpoint
versions, store shards, store manifests)::

    with atomic_publish(final) as tmp:   # tmp: ".<final name>.tmp-<pid>-<8 hex>", same folder
        write(tmp)
    # on leaving: fsync(tmp), rename(tmp, final), fsync(the folder)

The file is made durable before the rename (else a crash could leave ``final`` naming a
file whose blocks never reached the disk), the rename publishes it (atomic on POSIX and on
NFS), and the folder's fsync makes the rename itself durable.  No fsync of the folder is
needed before: the temporary name never has to survive a crash.  If writing, the fsync or
the rename fails, the temporary file is removed and the error propagates; ``final`` keeps
what it held.  A writer killed in between leaves its temporary file: the next writer of
the folder removes it with :func:`remove_temporaries`.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

#: the temporary names :func:`atomic_publish` gives; group "final" is the name it publishes
TEMPORARY_RE = re.compile(r"^\.(?P<final>.+)\.tmp-\d+-[0-9a-f]{8}$")


def fsync_path(path: Union[str, os.PathLike], directory: bool = False) -> None:
    """fsync a file or (``directory=True``) a folder by its path.

    Args:
        path: the file or folder.
        directory: whether ``path`` is a folder (opened with ``O_DIRECTORY``).

    Raises:
        OSError: when it cannot be opened or the fsync fails.
    """
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(final: Union[str, os.PathLike]) -> Path:
    """A fresh temporary name for ``final``, hidden, in the same folder.

    Args:
        final: the path the file will be published at.

    Returns:
        ``<folder>/.<name>.tmp-<pid>-<8 random hex digits>``.
    """
    final = Path(final)
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


@contextlib.contextmanager
def atomic_publish(final: Union[str, os.PathLike], fsync: bool = True) -> Iterator[Path]:
    """Write a file under a temporary name, then publish it at ``final`` (see the module docstring).

    Args:
        final: the path to publish at; its folder must exist.
        fsync: fsync the file before the rename and the folder after it (turn off only
            for tests on tmpfs).

    Returns:
        a context manager yielding the temporary path to write.

    Raises:
        OSError: from the fsyncs or the rename (the temporary file is removed first); any
            exception raised inside the ``with`` block propagates the same way.
    """
    final = Path(final)
    tmp = temporary_name(final)
    try:
        yield tmp
        if fsync:
            fsync_path(tmp)
        os.replace(tmp, final)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:  # never written, or not removable: the next writer's clean-up
            pass
        raise
    if fsync:
        fsync_path(final.parent, directory=True)


def remove_temporaries(directory: Union[str, os.PathLike],
                       publishes: Optional[Callable[[str], object]] = None) -> list:
    """Remove the temporary files that writers killed inside :func:`atomic_publish` left.

    Call it only where no other writer is publishing into ``directory`` at the time.

    Args:
        directory: the folder to clean (not its subfolders).
        publishes: if given, only temporaries whose final name it accepts are removed.

    Returns:
        the paths removed.
    """
    removed = []
    for p in Path(directory).iterdir():
        match = TEMPORARY_RE.match(p.name)
        if match is None or (publishes is not None and not publishes(match.group("final"))):
            continue
        try:
            p.unlink()
        except OSError:
            continue
        removed.append(p)
    return removed


__all__ = ["TEMPORARY_RE", "atomic_publish", "fsync_path", "remove_temporaries", "temporary_name"]
