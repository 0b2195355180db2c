"""The versions in a checkpoint directory, as local file operations on one process.

A directory holds one file per saved epoch, ``ckpt-epoch-NNNNNN.h5``, and an ``attic/``
where rollbacks move newer versions instead of deleting them.  :class:`CheckpointVersions`
lists, verifies, rolls back and restores them; none of it is collective: call it on one
process (the ``hvps ckpt`` command line does; :class:`~hvps.checkpoint.CheckpointManager`
uses it on the root rank and delegates its own ``list``, ``latest``, ``verify``,
``rollback`` and ``undo_rollback`` to it).
"""

from __future__ import annotations

import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from ..core.atomic_files import fsync_path
from ..core.user_warnings import warn
from .format import CheckpointError, Header
from .inspect import verify_file

FILE_RE = re.compile(r"^ckpt-epoch-(\d{6,})\.h5$")
ATTIC = "attic"


def file_name(epoch: int) -> str:
    """The file name of the version of ``epoch``.

    Args:
        epoch: the saved epoch.

    Returns:
        ``ckpt-epoch-NNNNNN.h5`` (at least six digits).
    """
    return f"ckpt-epoch-{int(epoch):06d}.h5"


@dataclass(frozen=True)
class Version:
    """One checkpoint file in the directory (not yet verified)."""

    epoch: int
    path: Path

    @property
    def size(self) -> int:
        return self.path.stat().st_size


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{secrets.token_hex(2)}"


class CheckpointVersions:
    """List, verify, roll back and restore the versions in ``directory`` (one process).

    Args:
        directory: the checkpoint directory (it need not exist yet).
        fsync: fsync the directories a rollback changes (turn off only for tests on tmpfs).
    """

    def __init__(self, directory: Union[str, os.PathLike], fsync: bool = True) -> None:
        self.directory = Path(directory)
        self.fsync = fsync

    # ------------------------------------------------------------------ listing and verification
    def list(self) -> list:
        """Every version in the directory (not the attic), oldest first; nothing is verified.

        Returns:
            a list of :class:`Version`, empty when the directory does not exist.
        """
        if not self.directory.is_dir():
            return []
        out = []
        for p in self.directory.iterdir():
            m = FILE_RE.match(p.name)
            if m and p.is_file():
                out.append(Version(int(m.group(1)), p))
        return sorted(out, key=lambda v: v.epoch)

    def path_of(self, version: Union[str, int, os.PathLike]) -> Path:
        """The path of a version given as an epoch number (int or digits) or as a path.

        Args:
            version: an epoch number, or a path (returned as it is).

        Returns:
            the file's path (it may not exist).
        """
        if isinstance(version, (str, os.PathLike)) and not str(version).isdigit():
            return Path(version)
        return self.directory / file_name(int(version))

    def verify(self, version: Union[int, str, os.PathLike]) -> Header:
        """Fully verify one version: structure and every checksum.

        Args:
            version: an epoch number or a path.

        Returns:
            the file's header.

        Raises:
            CheckpointError: naming the file, when it is missing, unsafe or damaged.
        """
        return verify_file(self.path_of(version))

    def latest(self) -> Optional[Version]:
        """The newest version that verifies completely; broken ones are skipped with a warning.

        Returns:
            the newest good :class:`Version`, or None when there is none.
        """
        for v in reversed(self.list()):
            try:
                verify_file(v.path)
                return v
            except CheckpointError as exc:
                warn(f"skipping checkpoint: {exc}", RuntimeWarning)
        return None

    # ------------------------------------------------------------------ rollback
    @property
    def attic(self) -> Path:
        """The folder where rollbacks keep the versions they move aside."""
        return self.directory / ATTIC

    def rollback(self, epoch: int) -> list:
        """Make ``epoch`` the newest version; nothing is deleted.

        Newer versions move into ``attic/rollback-<time>-to-epoch-NNNNNN/``.

        Args:
            epoch: the version to make the newest; it must exist and verify.

        Returns:
            the moved paths (their new locations), empty when none was newer.

        Raises:
            CheckpointError: when ``epoch`` has no version or it does not verify.
        """
        target = self.directory / file_name(epoch)
        if not target.exists():
            raise CheckpointError(f"cannot roll back: there is no version for epoch {epoch}", target)
        verify_file(target)
        newer = [v for v in self.list() if v.epoch > int(epoch)]
        if not newer:
            return []
        batch = self.attic / f"rollback-{_stamp()}-to-epoch-{int(epoch):06d}"
        batch.mkdir(parents=True)
        moved = []
        for v in newer:
            dst = batch / v.path.name
            os.replace(v.path, dst)
            moved.append(dst)
        if self.fsync:
            fsync_path(batch, directory=True)
            fsync_path(self.directory, directory=True)
        return moved

    def rollbacks(self) -> list:
        """The attic's rollback batches, oldest first.

        Returns:
            a list of folder paths.
        """
        if not self.attic.is_dir():
            return []
        return sorted((p for p in self.attic.iterdir() if p.is_dir() and p.name.startswith("rollback-")),
                      key=lambda p: p.name)

    def undo_rollback(self, force: bool = False) -> list:
        """Move the versions of the most recent rollback back from the attic.

        Args:
            force: when the directory meanwhile got versions with the same epochs (training
                went on after the rollback), move those newer files to the attic first
                (nothing is deleted) instead of refusing.

        Returns:
            the restored paths.

        Raises:
            CheckpointError: when the attic holds no rollback, or (without ``force``) when
                restored versions would replace newer ones (listed in the error).
        """
        batches = self.rollbacks()
        if not batches:
            raise CheckpointError("nothing to undo: the attic holds no rollback", self.attic)
        batch = batches[-1]
        files = sorted(p for p in batch.iterdir() if FILE_RE.match(p.name))
        conflicts = [self.directory / p.name for p in files if (self.directory / p.name).exists()]
        if conflicts and not force:
            raise CheckpointError("cannot undo the rollback: these versions were written since "
                                  "(pass force=True / --force to move them to the attic first)",
                                  batch, [str(c) for c in conflicts])
        if conflicts:
            aside = self.attic / f"displaced-{_stamp()}"
            aside.mkdir(parents=True)
            for c in conflicts:
                os.replace(c, aside / c.name)
        restored = []
        for p in files:
            dst = self.directory / p.name
            os.replace(p, dst)
            restored.append(dst)
        try:
            batch.rmdir()
        except OSError:
            pass
        if self.fsync:
            fsync_path(self.directory, directory=True)
        return restored


__all__ = ["CheckpointVersions", "Version", "FILE_RE", "ATTIC", "file_name"]
