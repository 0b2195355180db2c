"""Helpers that bring every rank to the root's model and optimizer state."""

from __future__ import annotations

import io
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch

import hvps
from hvps import ProcessSet, global_process_set
from hvps.core import devices

from .mpi_ops import broadcast_async_


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def rank_device() -> str:
    """Where tensors that arrive from other ranks' CUDA memory are put on this rank: its CUDA device (the
    device of its CUDA tensors, else its local rank's GPU), or the host without CUDA."""
    if not torch.cuda.is_available():
        return "cpu"
    index = devices.chosen()
    return f"cuda:{devices.fallback_index(torch.cuda.device_count()) if index is None else index}"


def placer(target: str) -> Callable:
    """``torch.load``'s ``map_location``: storages saved on any CUDA device come back on ``target``
    (``"cpu"`` or ``"cuda:<index>"``), never on the device the sender used (another rank's GPU, or
    cuda:0 for every rank of a node); host storages stay on the host."""
    index = None if target == "cpu" else int(target.split(":")[1])

    def place(storage, location: str):
        if index is None or not location.startswith("cuda"):
            return storage
        return storage.cuda(index)

    return place


def _loads(data: bytes, target: str) -> Any:
    # torch.load reads every storage into host memory first, then hands it to map_location
    return torch.load(io.BytesIO(data), map_location=placer(target), weights_only=False)


def broadcast_object(obj: Any = None, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set, map_location: Optional[str] = None) -> Any:
    """Pickle ``obj`` on the root and return a copy of it on every member of the set.

    Tensors the root had on a GPU arrive on this rank's GPU (``map_location``: ``"cpu"`` or
    ``"cuda:<index>"`` instead), not on the root's device (issue 43, finding 8).

    Args:
        obj: the object to send (the root's; ignored elsewhere).
        root_rank: the rank whose object every member receives.
        name: the collective's name, the same on every rank (default: numbered in call order).
        process_set: the ranks that take part (default: all).
        map_location: where received tensors go: ``"cpu"`` or ``"cuda:<index>"`` (default: this rank's device).

    Returns:
        ``obj`` on the root; an unpickled copy of the root's object on the other members.

    Raises:
        HvpsError: the collective failed (a rank lost, or one that never calls it).
    """
    root = hvps.rank() == root_rank
    data = hvps.broadcast_object(_dumps(obj) if root else None, root_rank, name, process_set)
    return obj if root else _loads(data, map_location or rank_device())


def allgather_object(obj: Any, name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> list:
    """Pickle ``obj`` on every member and return all members' objects, in rank order (CUDA tensors on
    this rank's GPU, as ``broadcast_object``).

    Args:
        obj: this rank's object.
        name: the collective's name, the same on every rank (default: numbered in call order).
        process_set: the ranks that take part (default: all).

    Returns:
        A list of the members' objects, in rank order.

    Raises:
        HvpsError: the collective failed (a rank lost, or one that never calls it).
    """
    target = rank_device()
    return [_loads(data, target) for data in hvps.allgather_object(_dumps(obj), name, process_set)]


def broadcast_parameters(params: Union[Mapping[str, torch.Tensor], Iterable], root_rank: int = 0,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite ``params`` (a ``state_dict()`` or ``named_parameters()``) in place with the root's.

    Args:
        params: a ``state_dict()`` or ``(name, tensor)`` pairs such as ``model.named_parameters()``.
        root_rank: the rank whose values every member receives.
        process_set: the ranks that take part (default: all).

    Raises:
        ValueError: ``params`` is neither a mapping nor ``(name, tensor)`` pairs.
        HvpsError: the broadcasts failed (the ranks' tensors differ in shape or dtype, or a rank is lost).
    """
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

    Args:
        optimizer: a ``torch.optim.Optimizer`` (``DistributedOptimizer`` and ``ShardedOptimizer`` included).
        root_rank: the rank whose state every member receives.
        process_set: the ranks that take part (default: all).

    Raises:
        HvpsError: the broadcast failed (a rank lost, or one that never calls it).
    """
    own = optimizer.state_dict()  # on every rank: a ShardedOptimizer's state_dict() is collective
    if not own["state"]:
        _zero_missing_grads(optimizer)
    # arrives in host memory (never on the root's GPU); load_state_dict moves each state to its parameter's device
    state: Any = broadcast_object(own if hvps.rank() == root_rank else None, root_rank,
                                  name="optimizer_state", process_set=process_set, map_location="cpu")
    if hvps.rank() != root_rank:
        optimizer.load_state_dict(state)
