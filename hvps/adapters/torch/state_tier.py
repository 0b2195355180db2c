"""A disk tier for a torch optimizer's element-wise state (issue 39, item 3: ZeRO-Infinity's NVMe tier, by mmap).

``DiskStateTier(optimizer, disk_dir)`` keeps every element-wise state tensor of ``optimizer`` (Adam's moments,
SGD's momentum, Adagrad's sums: the tensors shaped like their parameter) in a memory-mapped file under
``disk_dir`` instead of anonymous memory. The optimizer's code does not change: its state tensors are ordinary
CPU tensors whose storage is the mapping, so the kernel pages them in as a step reads them and may write them
back and drop them under memory pressure (a cgroup's cap). State that exceeds the memory a rank may hold then
still trains, at the cost of the disk traffic. ``ShardedOptimizer(..., state_tier="disk", disk_dir=...)``
puts its shards' state there and adds read-ahead (``MADV_WILLNEED`` of the next bucket's state) and
write-behind (the finished bucket's dirty pages are sent to the disk at once and unmapped from the
process) around each bucket's step; for ``hvd.fully_shard`` wrap the plain optimizer built over the
shard parameters.

How. At construction the tier learns which state is element-wise by stepping a throw-away optimizer of the
same class and defaults on a 2-element tensor per parameter dtype, then reserves room for every parameter's
state in one scratch file: created with a unique name, its blocks reserved with ``posix_fallocate`` (so a
full filesystem fails here, with ``HvpsError``, not as a ``SIGBUS`` at a later write to a page of a sparse
file), mapped, and unlinked at once. The file has no name from then on: no process can read it, and its
blocks return to the filesystem when the process unmaps it (``close()``) or exits, even by ``kill -9``. So
the tier never leaves a file that a later load could take for a checkpoint: checkpoints are written by the
checkpoint code from these tensors as from any others.

The optimizer creates its state lazily at its first step (and replaces it in ``load_state_dict``); a step
post-hook and a load post-hook copy each new element-wise tensor into its place in the mapping (bit for
bit) and install the mapped tensor in the optimizer's state, so at most one step's new state is ever in
anonymous memory. After each step the hook also writes behind the state of the parameters that were
stepped (those with a gradient): their dirty pages are sent to the disk at once
(``POSIX_FADV_DONTNEED``) and unmapped from the process (``MADV_DONTNEED``: a shared file mapping's data
stays in the page cache), so under a memory cap the kernel finds clean pages to drop instead of stalling
on write-back. (``ShardedOptimizer`` steps one bucket at a time, so this happens bucket by bucket.) State the probe did not predict (another dtype, a shape it did not show) gets a scratch
file of its own at that moment; a full filesystem then raises ``HvpsError`` from the step, before the
mapped tensor replaces the in-memory one.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Union

import torch

from hvps import HvpsError

__all__ = ["DiskStateTier"]

PAGE = mmap.PAGESIZE
#: ``madvise`` advice (Linux values; Python's mmap lacks MADV_PAGEOUT)
_WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)
_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def _round_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


class _ScratchFile:
    """One unnamed, fully allocated file under ``directory``, mapped shared; tensors are views of the mapping."""

    def __init__(self, directory: Path, nbytes: int) -> None:
        self.nbytes = max(PAGE, _round_up(nbytes))
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self.fd, name = tempfile.mkstemp(prefix="hvps-optimizer-state-", suffix=".tier", dir=directory)
        except OSError as e:
            raise HvpsError(f"the optimizer state's disk tier cannot create a file in {str(directory)!r}: "
                            f"{e.strerror or e} (a read-only or missing directory?)") from e
        try:
            os.unlink(name)  # scratch: nothing outlives the process, nothing can be mistaken for a checkpoint
            os.posix_fallocate(self.fd, 0, self.nbytes)
            self.map = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(self.fd)
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            raise HvpsError(f"the optimizer state's disk tier cannot reserve {_size(self.nbytes)} in "
                            f"{str(directory)!r}: {e.strerror or e}"
                            + (" (the filesystem is full: free space or choose another disk_dir)" if full else "")) \
                from e
        self.address = self.tensor(0, 1, torch.uint8).data_ptr()  # where the mapping starts in this process

    def tensor(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.frombuffer(self.map, dtype=dtype, count=numel, offset=offset)

    def advise(self, advice: int, offset: int, nbytes: int) -> None:
        start = offset - offset % PAGE
        length = min(self.nbytes, _round_up(offset + nbytes)) - start
        if length > 0:
            self.map.madvise(advice, start, length)

    def write_behind(self, offset: int, nbytes: int) -> None:
        """Start writing the range's dirty pages to the disk (asynchronously) and unmap them from this process:
        they stay in the page cache, clean soon, so the kernel can drop them without waiting under a cap."""
        start = offset - offset % PAGE
        length = min(self.nbytes, _round_up(offset + nbytes)) - start
        if length > 0:
            self.map.madvise(_DONTNEED, start, length)  # a shared file mapping keeps its data: pages go to the cache
            os.posix_fadvise(self.fd, start, length, os.POSIX_FADV_DONTNEED)  # starts write-back of dirty pages

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):  # tensors still alive keep the mapping until they go
            self.map.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


class DiskStateTier:
    """Keeps ``optimizer``'s element-wise state in a scratch file under ``disk_dir`` (see the module's docstring).

    Use it before the optimizer's first step or after (existing state moves into the tier at once)::

        optimizer = torch.optim.Adam(model.parameters())
        tier = hvd.DiskStateTier(optimizer, "/local_nvme/tier")
        ...  # train as usual; optimizer.state_dict() and checkpoints see ordinary tensors
        tier.close()  # or let the process end: the file has no name, its blocks are freed either way
    """

    def __init__(self, optimizer: torch.optim.Optimizer, disk_dir: Union[str, os.PathLike]) -> None:
        """Reserve the file for every parameter's element-wise state and hook the optimizer.

        Args:
            optimizer: a torch optimizer over CPU parameters.
            disk_dir: the directory for the scratch file (created if missing), on the disk to page to.

        Raises:
            ValueError: ``disk_dir`` is missing, or a parameter is not on the CPU.
            HvpsError: the directory cannot be written (read-only, permissions) or the filesystem lacks
                room for the state.
        """
        if disk_dir is None or str(disk_dir) == "":
            raise ValueError("the disk tier needs a directory: disk_dir=...")
        self.optimizer = optimizer
        self.directory = Path(disk_dir)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for p in params:
            if p.device.type != "cpu":
                raise ValueError(f"the disk tier holds the state of CPU parameters, not {p.device} ones")
        #: parameter -> state key -> (file, byte offset, numel, dtype)
        self._slots: dict = {}
        self._files: list = []
        self._closed = False
        plan, offset = [], 0
        keys_by_dtype = {dtype: _elementwise_keys(optimizer, dtype) for dtype in {p.dtype for p in params}}
        for p in params:
            if p.numel() == 0:  # an empty shard (fully_shard's last rank): nothing to page
                continue
            for key, dtype in keys_by_dtype[p.dtype].items():
                plan.append((p, key, offset, p.numel(), dtype))
                offset += _round_up(p.numel() * dtype.itemsize)
        if plan:
            scratch = _ScratchFile(self.directory, offset)
            self._files.append(scratch)
            for p, key, at, numel, dtype in plan:
                self._slots.setdefault(p, {})[key] = (scratch, at, numel, dtype)
        self.adopt()
        self._hooks = [optimizer.register_step_post_hook(lambda *_: self._after_step()),
                       optimizer.register_load_state_dict_post_hook(lambda *_: self.adopt())]

    @property
    def nbytes(self) -> int:
        """Bytes of disk the tier holds."""
        return sum(f.nbytes for f in self._files)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage is one of the tier's mappings.

        Args:
            tensor: a state tensor (e.g. ``optimizer.state[p]["exp_avg"]``).

        Returns:
            True when the tier holds it (it lives in the scratch file).
        """
        return any(self._slot_tensor_is(tensor, slot) for slots in self._slots.values() for slot in slots.values())

    def adopt(self) -> None:
        """Move every element-wise state tensor not yet in the tier into it (bit for bit); called after each
        step and each ``load_state_dict`` by the optimizer's hooks.

        Raises:
            HvpsError: state the probe did not predict needs a new file and the filesystem refuses it (the
                optimizer keeps the in-memory tensor).
        """
        if self._closed:
            return
        for p, state in self.optimizer.state.items():
            for key, value in list(state.items()):
                if not (torch.is_tensor(value) and value.dim() > 0 and value.numel() > 0
                        and value.shape == p.shape and value.device.type == "cpu"):
                    continue
                slot = self._slots.get(p, {}).get(key)
                if slot is not None and self._slot_tensor_is(value, slot):
                    continue
                if slot is None or slot[3] != value.dtype:
                    scratch = _ScratchFile(self.directory, value.numel() * value.element_size())
                    self._files.append(scratch)
                    slot = (scratch, 0, value.numel(), value.dtype)
                    self._slots.setdefault(p, {})[key] = slot
                scratch, at, numel, dtype = slot
                mapped = scratch.tensor(at, numel, dtype).view(p.shape)
                with torch.no_grad():
                    mapped.copy_(value)
                state[key] = mapped

    def _after_step(self) -> None:
        """Adopt new state, then write behind the state of the parameters just stepped (those with a gradient)."""
        self.adopt()
        self.write_behind(p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None)

    @staticmethod
    def _slot_tensor_is(tensor: torch.Tensor, slot: tuple) -> bool:
        scratch, at, _, _ = slot
        return tensor.data_ptr() == scratch.address + at

    def _ranges(self, params: Iterable[torch.Tensor]):
        for p in params:
            for scratch, at, numel, dtype in self._slots.get(p, {}).values():
                yield scratch, at, numel * dtype.itemsize

    def prefetch(self, params: Iterable[torch.Tensor]) -> None:
        """Read ahead: ask the kernel to start reading these parameters' state (``MADV_WILLNEED``).

        Args:
            params: parameters of the optimizer whose state the next step reads.
        """
        if not self._closed:
            for scratch, at, nbytes in self._ranges(params):
                scratch.advise(_WILLNEED, at, nbytes)

    def write_behind(self, params: Iterable[torch.Tensor]) -> None:
        """Write behind: start writing these parameters' state to the disk and unmap it from the process.

        Args:
            params: parameters of the optimizer whose state a step has just written.
        """
        if not self._closed:
            for scratch, at, nbytes in self._ranges(params):
                scratch.write_behind(at, nbytes)

    def close(self, keep_state: bool = True) -> None:
        """Stop tiering: the hooks go and the files are unmapped (their blocks are freed; they never had a name
        after construction). Idempotent.

        Args:
            keep_state: move the tiered state tensors back to memory (copies), so the optimizer goes on; with
                False they are dropped from the optimizer's state instead (for an optimizer being replaced).
        """
        if self._closed:
            return
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        for p, state in self.optimizer.state.items():
            for key, value in list(state.items()):
                slot = self._slots.get(p, {}).get(key)
                if torch.is_tensor(value) and slot is not None and self._slot_tensor_is(value, slot):
                    if keep_state:
                        state[key] = value.clone()
                    else:
                        del state[key]
        self._slots.clear()
        for scratch in self._files:
            scratch.close()
        self._files.clear()

    def __repr__(self) -> str:
        return f"DiskStateTier({str(self.directory)!r}, {_size(self.nbytes)})"


def _elementwise_keys(optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> dict:
    """State key -> dtype of the state ``type(optimizer)`` keeps per element of a ``dtype`` parameter, learnt
    by stepping a throw-away copy (same class and defaults) on a 2-element parameter; ``{}`` when the class
    cannot be built that way (its state then gets files as it appears)."""
    probe_param = torch.zeros(2, dtype=dtype, requires_grad=True)
    try:
        probe = type(optimizer)([probe_param], **optimizer.defaults)
        probe_param.grad = torch.full_like(probe_param, 2.0 ** -4)
        probe.step()
    except Exception:  # an optimizer with another constructor or needs (a closure): learn at adoption
        return {}
    state: Optional[dict] = probe.state.get(probe_param)
    return {key: value.dtype for key, value in (state or {}).items()
            if torch.is_tensor(value) and value.shape == probe_param.shape}
