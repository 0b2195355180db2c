"""``compression_stats()`` and ``set_epoch()``, the compression controls of every gradient wrapper."""

from __future__ import annotations

from typing import Any, Optional

from hvps.compression import GradientCompression


def compression_of(optimizer: Any) -> Optional[GradientCompression]:
    """The compression of a gradient wrapper (a ``hvd.DistributedOptimizer``), which holds its error
    feedback, else None: what an elastic state commits and restores beside the optimizer's state.

    Args:
        optimizer: any optimizer.

    Returns:
        Its ``compression`` when that has ``state_dict()``, else None.
    """
    compression = getattr(optimizer, "compression", None)
    return compression if callable(getattr(compression, "state_dict", None)) else None


class CompressionControls:
    """Mixin for a gradient wrapper whose ``compression`` attribute holds its GradientCompression."""

    compression: GradientCompression

    def compression_stats(self) -> dict:
        """Bytes sent and received, compression ratio and (de)compression time of this rank since the
        last ``compression.stats.reset()``; they live in the compression object, shared by every
        wrapper given the same one."""
        return self.compression.stats.as_dict()

    def set_epoch(self, epoch: int) -> None:
        """Tell the compression the epoch (DGC's density warm-up); it applies from the next exchange
        on, without retracing a ``tf.function``."""
        self.compression.set_epoch(epoch)
