"""This rank's CUDA device: chosen once, by the first CUDA tensor it submits (or by ``join(device)``).

Horovod runs every collective of a rank on one GPU (the device of its tensors; the examples pin it
with ``torch.cuda.set_device(local_rank)``). hvps records that device the first time a CUDA tensor
reaches the engine, on the submitting thread, and every thread that is not the user's asks this
module instead of ``torch.cuda.current_device()`` (0 on a thread that never set one):

- the engine thread makes a joined rank's zeros here (``zeros_device``), not on ``cuda:0``;
- the metrics thread reads this GPU's NVML counters;
- a CUDA tensor on another device, or a group mixing devices, is refused before anything is
  enqueued (``check``), naming the tensor and the devices.

Nothing here imports torch: a caller passes tensors (or device indices) it already has.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Optional

from .errors import HvpsError

_lock = threading.Lock()
#: the index of this rank's CUDA device, once a CUDA tensor (or ``join(device)``) has named it
_chosen: Optional[int] = None
#: ``join(device)``'s device for a joined rank's zeros (Horovod's argument), when one was given
_join_device: Optional[int] = None
#: this rank's local rank (set by ``init``): the GPU it falls back to before any CUDA tensor named one
_local_rank = 0


def chosen() -> Optional[int]:
    """The index of this rank's CUDA device, or None while no CUDA tensor has been submitted."""
    return _chosen


def reset(local_rank: int = 0) -> None:
    """Forget the choice (``init`` and shutdown: a later ``init`` may pin another device)."""
    global _chosen, _join_device, _local_rank
    with _lock:
        _chosen = _join_device = None
        _local_rank = int(local_rank)


def fallback_index(device_count: int = 1) -> int:
    """The GPU of this rank before any CUDA tensor named one: its local rank's (modulo the GPUs seen)."""
    return _local_rank % max(1, device_count)


def _index(tensor: Any) -> int:
    index = tensor.device.index
    if index is None:  # "cuda" without an index: the current device of the submitting (user) thread
        index = sys.modules["torch"].cuda.current_device()
    return int(index)


def check(name: str, tensors: list) -> Optional[int]:
    """The CUDA device index of ``tensors`` (None for host arrays), choosing it on first use.

    Raises HvpsError, naming ``name`` and the devices, for a group that mixes devices or a CUDA
    tensor on a device other than the one this rank chose: NCCL would open a second communicator
    on another GPU (a duplicate-GPU error or a hang on the other ranks), and the ready and done
    events would order the wrong streams.
    """
    global _chosen
    found: dict = {}
    for tensor in tensors:
        device = getattr(tensor, "device", None)
        kind = getattr(device, "type", "cpu")
        found.setdefault("cpu" if kind == "cpu" else f"{kind}:{_index(tensor)}" if kind == "cuda" else kind, tensor)
    if len(found) > 1:
        raise HvpsError(f"hvps: '{name}' mixes tensors on {sorted(found)} in one collective; a collective's "
                        "tensors must all lie on one device (move them with .to(device) first)")
    cuda = [key for key in found if key.startswith("cuda:")]
    if not cuda:
        return None
    index = int(cuda[0].split(":")[1])
    with _lock:
        if _chosen is None:
            _chosen = index
    if index != _chosen:
        raise HvpsError(
            f"hvps: '{name}' is a tensor on cuda:{index}, but this rank's collectives run on cuda:{_chosen} "
            f"(the device of its first CUDA tensor); keep one GPU per rank: torch.cuda.set_device(local_rank) "
            f"and put every tensor hvps moves on it")
    return index


def set_join_device(device: Optional[int]) -> None:
    """``join(device)``: where a joined rank makes its zeros (None or a negative index: its chosen device)."""
    global _join_device
    with _lock:
        _join_device = None if device is None or device < 0 else int(device)


def zeros_device(kind: str, device_count: int = 1) -> str:
    """The device on which a joined rank makes zeros for a collective on ``kind`` (``"cpu"``, ``"cuda"``).

    ``cuda:<index>``, the index being ``join(device)``'s, else this rank's chosen device, else the
    local rank's GPU (one GPU per rank by local rank, as Horovod's examples pin it); never a bare
    ``"cuda"``, which the engine thread would read as cuda:0.
    """
    if kind != "cuda":
        return kind
    index = _join_device if _join_device is not None else _chosen
    if index is None:
        index = fallback_index(device_count)
    return f"cuda:{index}"
