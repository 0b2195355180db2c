"""Helpers that bring every rank to the root's model and optimizer state."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Union

import torch

import hvps

from .mpi_ops import broadcast_async_

broadcast_object = hvps.broadcast_object
allgather_object = hvps.allgather_object


def broadcast_parameters(params: Union[Mapping[str, torch.Tensor], Iterable], root_rank: int = 0) -> None:
    """Overwrite ``params`` (a ``state_dict()`` or ``named_parameters()``) in place with the root's."""
    items = sorted(params.items()) if isinstance(params, Mapping) else list(params)
    if items and not isinstance(items[0], tuple):
        raise ValueError("params must be a state_dict() or a list of (name, tensor) pairs, as named_parameters()")
    handles = [broadcast_async_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank,
                                name=f"parameter.{name}")
               for name, p in items if isinstance(p, torch.Tensor)]
    for handle in handles:
        handle.wait()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Make every rank's optimizer state (hyper-parameters and buffers) equal to the root's.

    Ranks whose state is not yet initialised (no ``step()`` taken) get the root's
    state all the same, since the whole ``state_dict()`` travels.
    """
    state: Any = hvps.broadcast_object(optimizer.state_dict() if hvps.rank() == root_rank else None, root_rank,
                                       name="optimizer_state")
    if hvps.rank() != root_rank:
        optimizer.load_state_dict(state)
