"""HDF5 checkpoints versioned per epoch: the manager (save, load, roll back, recover), the file
format, its safety rules for untrusted files, the sandboxed inspection helper and ``hvps ckpt``."""

from .format import CheckpointError, IncompatibleCheckpointError
from .manager import Checkpoint, CheckpointManager, Version

__all__ = ["CheckpointManager", "Checkpoint", "Version", "CheckpointError", "IncompatibleCheckpointError"]
