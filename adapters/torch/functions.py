"""Helpers that bring every rank to the root's model and optimizer state."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Union

import torch

import hvps
from hvps import ProcessSet, global_process_set

from .mpi_ops import broadcast_async_


def broadcast_object(obj: Any = None, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Pickle ``obj`` on the root and return a copy of it on every member of the set."""
    return hvps.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> list:
    """Pickle ``obj`` on every member and return all members' objects, in rank order."""
    return hvps.allgather_object(obj, name, process_set)


def broadcast_parameters(params: Union[Mapping[str, torch.Tensor], Iterable], root_rank: int = 0,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite ``params`` (a ``state_dict()`` or ``named_parameters()``) in place with the root's."""
    items = sorted(params.items()) if isinstance(params, Mapping) else list(params)
    if items and not isinstance(items[0], tuple):
        raise ValueError("params must be a state_dict() or a list of (name, tensor) pairs, as named_parameters()")
    handles = [broadcast_async_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank,
                                name=f"parameter.{name}", process_set=process_set)
               for name, p in items if isinstance(p, torch.Tensor)]
    for handle in handles:
        handle.wait()


def _zero_missing_grads(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter that takes gradients and has none a zero gradient, as Horovod leaves them.

    Horovod steps once on those zeros to create the state tensors it broadcasts one by one;
    hvps sends the root's whole ``state_dict()``, so it needs no such step and an optimizer's
    trajectory (Adam's step count, say) stays that of a fresh one.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every member's optimizer state (hyper-parameters and buffers) equal to the root's.

    The root's whole ``state_dict()`` travels, so ranks whose state differs in shape or presence
    end up with the root's. As in Horovod, when this rank's optimizer has no state yet, every
    parameter that takes gradients and has none gets a zero gradient.
    """
    if not optimizer.state_dict()["state"]:
        _zero_missing_grads(optimizer)
    state: Any = hvps.broadcast_object(optimizer.state_dict() if hvps.rank() == root_rank else None, root_rank,
                                       name="optimizer_state", process_set=process_set)
    if hvps.rank() != root_rank:
        optimizer.load_state_dict(state)
