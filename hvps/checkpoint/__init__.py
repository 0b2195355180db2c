"""HDF5 checkpoints versioned per epoch: the manager (collective save and load), the versions in a
directory (list, verify, roll back, on one process), the file format, its safety rules for untrusted
files, the sandboxed inspection helper and ``hvps ckpt``."""

from .format import CheckpointError, IncompatibleCheckpointError
from .manager import Checkpoint, CheckpointManager
from .versions import CheckpointVersions, Version

__all__ = ["CheckpointManager", "CheckpointVersions", "Checkpoint", "Version", "CheckpointError",
           "IncompatibleCheckpointError"]
