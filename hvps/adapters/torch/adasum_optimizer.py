"""The Adasum kind of ``DistributedOptimizer`` (``op=hvd.Adasum``, Horovod's delta optimizer).

Gradients are not reduced while backward runs: every rank steps the wrapped optimizer on its own
gradients, and the parameter updates (the deltas the step made) are then combined by Adasum, so
each rank ends the step with the same parameters.  A rank outside ``process_set`` steps on its
local gradients only.  What this kind shares with the allreduce kind (the checks, the wrapped
optimizer, the step's order) is in :mod:`.optimizer_base`.
"""

from __future__ import annotations

from typing import Any

import torch

from hvps import metrics as _metrics

from .mpi_ops import Adasum, grouped_allreduce_async_
from .optimizer_base import DistributedOptimizer


class DistributedAdasumOptimizer(DistributedOptimizer, reduces=(Adasum,)):
    """The ``DistributedOptimizer`` for Adasum: ``step()`` steps locally, then replaces every
    parameter's update by the Adasum of all ranks' updates (see :class:`DistributedOptimizer`
    for the arguments; any compression is accepted, the updates travel uncompressed)."""

    _qualname_prefix = "DistributedAdasumOptimizer"

    def synchronize(self) -> None:
        """Nothing to wait for: the updates are combined in ``step()``."""
        _metrics.on_sync_start()
        self._synchronized = True

    def _update(self, closure: Any = None) -> Any:
        if not self._included:  # outside the process set: the local step only
            return self._inner.step(closure)
        params = [p for p in self._params() if p.requires_grad]
        starts = [p.detach().clone() for p in params]
        loss = self._inner.step(closure)
        deltas = [(p.detach() - start).contiguous() for p, start in zip(params, starts)]
        handles = [grouped_allreduce_async_([d], name=f"delta.{self._parameter_names[p]}", op=Adasum)
                   for p, d in zip(params, deltas)]
        with torch.no_grad():
            for p, start, handle in zip(params, starts, handles):
                (delta,) = handle.wait()
                p.copy_(start + delta)
        return loss


__all__ = ["DistributedAdasumOptimizer"]
