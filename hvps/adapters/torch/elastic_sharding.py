"""The elastic state of sharded training: a fully sharded model (``hvd.fully_shard``, ZeRO stage 3) with the
optimizers over its shards, and a ``ShardedOptimizer`` (stage 1-2): a lost rank loses nothing, and no checkpoint
is read.

Why inside ``hvd.elastic.TorchState``. A Horovod elastic user already writes
``state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)`` and calls ``state.commit()``; with a
fully sharded model the same line works. TorchState recognises the model (``FullyShardedModel.of``) and gives it
:class:`FullyShardedStateHandler`, which also takes over every optimizer of the state whose parameters are all
shards of that model (their state is sharded the same way). A ``ShardedOptimizer`` (``hvd.DistributedOptimizer(
..., shard=True)``) gets :class:`ShardedOptimizerStateHandler` in the same way: its buckets are the flat groups,
its element-wise state the channels (the parameters are replicated: the model's own handler keeps them). Nothing
else in the loop changes.

What a commit keeps (host memory, never the device): per flat group of the model, this rank's block as a
``[shard elements, channels]`` array, channel 0 the parameters and one channel per element-wise optimizer state
(momentum, ``exp_avg``, ...), plus the optimizers' other state (``step``, hyper-parameters) and the model's
buffers. Then one ring exchange (an alltoall in which rank r sends only to r + s: a sendrecv) gives each rank a
copy of the blocks of rank r - s, where the stride s is 1 on one host and the ranks per host on several, so that
each copy lives on another host than its block (:func:`hvps.elastic.shard_recovery.copy_stride`: a failed
worker's whole host leaves the job).

What a sync after a reset does (every rank of the new world, joiners included): the ranks tell each other which
save they hold; the survivors of the save rank 0 holds provide every old block, from their own blocks or the
copies they keep (:mod:`hvps.elastic.shard_recovery`), one alltoall moves each element to its rank of the new
layout, and the model is re-laid out for the new size (``FullyShardedModel.relayout``: the shard parameters
stay the same objects, so the optimizers keep working; ``ShardedOptimizer.relayout`` rebuilds its buckets).
When a block's owner and its copy's keeper both died between two commits, that shard is lost: ``HvpsError``,
and the user's checkpoint is the way back. The same path serves growth (the joiners
receive their blocks) and a same-size world (nothing moves).

A restore (after a failed collective, before the reset) is local: this rank's own saved blocks, in the layout
they were saved in.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import numpy as np
import torch

from hvps.core.errors import HvpsError
from hvps.elastic.ring_shards import RingShardsHandler
from hvps.elastic.state import SavedValue

from .fully_sharded import FullyShardedModel
from .functions import broadcast_parameters
from .sharded_optimizer import ShardedOptimizer

__all__ = ["FullyShardedStateHandler", "ShardedOptimizerStateHandler", "AdoptedOptimizerHandler"]

log = logging.getLogger("hvps")


def _element_wise(value: Any, shard: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() >= 1 and value.shape == shard.shape


class FullyShardedStateHandler(RingShardsHandler):
    """Saves, restores and syncs a fully sharded model and the optimizers it adopted (see the module).

    Args:
        model: a model that ``hvd.fully_shard`` changed.

    Raises:
        ValueError: the model is not fully sharded.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.value = model
        self.controller = FullyShardedModel.of(model)
        self.optimizers: list = []
        self._start()

    what = "fully_shard"

    @staticmethod
    def handles(value: Any) -> bool:
        """Whether this handler is the one for ``value``.

        Args:
            value: a value given to a TorchState.

        Returns:
            True for a model that ``hvd.fully_shard`` changed.
        """
        try:
            FullyShardedModel.of(value)
        except ValueError:
            return False
        return True

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this handler should save ``optimizer`` with the shards.

        Args:
            optimizer: an optimizer of the same TorchState.

        Returns:
            True when every parameter of ``optimizer`` is a shard of this model.
        """
        shards = {id(s) for s in self.controller.sharded_parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return bool(params) and all(id(p) in shards for p in params)

    def adopt(self, optimizer: torch.optim.Optimizer) -> "AdoptedOptimizerHandler":
        """Save, restore and sync ``optimizer``'s state with the shards.

        Args:
            optimizer: an optimizer over shards of this model (:meth:`owns`).

        Returns:
            The handler that stands for it in the TorchState.
        """
        self.optimizers.append(optimizer)
        self._start()
        return AdoptedOptimizerHandler(optimizer, self)

    def set_value(self, value: torch.nn.Module) -> None:
        """Track another fully sharded model (the optimizers still over its shards stay adopted) and save it
        locally.

        Args:
            value: the model now in the TorchState's attribute.

        Raises:
            ValueError: it is not fully sharded.
        """
        self.value = value
        self.controller = FullyShardedModel.of(value)
        self.optimizers = [opt for opt in self.optimizers if self.owns(opt)]
        self._start()

    def _structure(self) -> dict:
        groups = self.controller.flat_groups()
        where = {id(shard): (g, i) for g, group in enumerate(groups) for i, shard in enumerate(group.shards)}
        channels: list = [[] for _ in groups]
        optimizers = []
        for index, optimizer in enumerate(self.optimizers):
            scalars, flat = [], []
            for p in (p for group in optimizer.param_groups for p in group["params"]):
                entries = optimizer.state.get(p, {})
                keys = [key for key, value in entries.items() if _element_wise(value, p)]
                scalars.append({key: copy.deepcopy(value) for key, value in entries.items() if key not in keys})
                flat.append(keys)
                column = channels[where[id(p)][0]]
                column.extend((index, key) for key in keys if (index, key) not in column)
            groups_state = [{k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
                            for group in optimizer.param_groups]
            optimizers.append({"param_groups": groups_state, "state": scalars, "flat": flat,
                               "has_state": [p in optimizer.state for group in optimizer.param_groups
                                             for p in group["params"]]})
        return {"optimizers": optimizers, "channels": channels}

    def _layout(self) -> list:
        return [(g.name, tuple(shape.numel() for shape in g.shapes), str(g.dtype))
                for g in self.controller.flat_groups()]

    def _world(self) -> tuple:
        return self.controller.world()

    def _row_bytes(self, structure: dict) -> list:
        return [(1 + len(structure["channels"][g])) * torch.empty(0, dtype=group.dtype).element_size()
                for g, group in enumerate(self.controller.flat_groups())]

    def _capture(self) -> tuple:
        structure = self._structure()
        blocks = []
        for g, group in enumerate(self.controller.flat_groups()):
            columns = [group.shard_flat.detach().to("cpu", copy=True)]
            for index, key in structure["channels"][g]:
                column = torch.zeros(group.shard_numel, dtype=group.dtype)
                optimizer = self.optimizers[index]
                for shard, (at, n) in zip(group.shards, group.pieces):
                    value = optimizer.state.get(shard, {}).get(key)
                    if value is not None and _element_wise(value, shard):
                        if value.dtype != group.dtype:
                            raise HvpsError(f"elastic fully_shard: optimizer state {key!r} is {value.dtype} for "
                                            f"parameters of {group.dtype}; a shard's state must share its dtype")
                        column[at : at + n] = value.detach().reshape(-1).cpu()
                columns.append(column)
            blocks.append(torch.stack(columns, dim=1).contiguous().view(torch.uint8).numpy())
        buffers = {name: b.detach().clone() for name, b in self.value.named_buffers()}
        return blocks, structure, buffers

    def _install(self, blocks: list, size: int, rank: int, structure: dict) -> None:
        groups = self.controller.flat_groups()
        tensors = []
        for group, block in zip(groups, blocks):
            tensors.append(torch.from_numpy(np.ascontiguousarray(block)).view(group.dtype))
        self.controller.relayout([t[:, 0] for t in tensors], size, rank)
        where = {id(shard): (g, i) for g, group in enumerate(groups) for i, shard in enumerate(group.shards)}
        for index, (optimizer, saved) in enumerate(zip(self.optimizers, structure["optimizers"])):
            optimizer.state.clear()
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for p, scalars, keys, has_state in zip(params, saved["state"], saved["flat"], saved["has_state"]):
                if not has_state:
                    continue
                g, i = where[id(p)]
                at, n = groups[g].pieces[i]
                entries = copy.deepcopy(scalars)
                for key in keys:
                    column = 1 + structure["channels"][g].index((index, key))
                    entries[key] = tensors[g][at : at + n, column].clone().reshape(p.shape).to(p.device)
                optimizer.state[p] = entries
            for group, values in zip(optimizer.param_groups, saved["param_groups"]):
                group.update(copy.deepcopy(values))

    def _apply_hyperparameters(self, structure: dict) -> None:
        for optimizer, values in zip(self.optimizers, structure["optimizers"]):
            for group, hyper in zip(optimizer.param_groups, values["param_groups"]):
                group.update(copy.deepcopy(hyper))

    def _restore_replicated(self, replicated: Any) -> None:
        with torch.no_grad():
            for name, b in self.value.named_buffers():
                if name in replicated:
                    b.copy_(replicated[name])

    def _sync_replicated(self) -> None:
        broadcast_parameters(dict(self.value.named_buffers()), root_rank=0)


class ShardedOptimizerStateHandler(RingShardsHandler):
    """Saves, restores and syncs a ``ShardedOptimizer`` (ZeRO stage 1-2, ``hvd.DistributedOptimizer(...,
    shard=True)``): its optimizer state is sharded by bucket, one channel per element-wise state (momentum,
    ``exp_avg``, ...); the parameters are replicated, so the model's own handler keeps them.

    Args:
        optimizer: the sharded optimizer.
    """

    what = "sharded_optimizer"

    def __init__(self, optimizer: ShardedOptimizer) -> None:
        self.value = optimizer
        self._start()

    def set_value(self, value: ShardedOptimizer) -> None:
        """Track another sharded optimizer and save it locally.

        Args:
            value: the optimizer now in the TorchState's attribute.
        """
        self.value = value
        self._start()

    def _buckets(self) -> list:
        return self.value.shard_layout()["buckets"]

    def _layout(self) -> list:
        params = self.value.shard_layout()["params"]
        return [(f"bucket{b}", tuple(n for _, _, n in bucket["params"]), params[bucket["params"][0][0]][2])
                for b, bucket in enumerate(self._buckets())]

    def _world(self) -> tuple:
        return self.value.world()

    def _dtypes(self) -> list:
        return [getattr(torch, dtype) for _, _, dtype in self._layout()]

    def _row_bytes(self, structure: dict) -> list:
        return [len(keys) * torch.empty(0, dtype=dtype).element_size()
                for keys, dtype in zip(structure["channels"], self._dtypes())]

    def _capture(self) -> tuple:
        local = self.value.local_state()
        channels, scalars, blocks = [], {}, []
        for b, (bucket, dtype) in enumerate(zip(self._buckets(), self._dtypes())):
            entries = local.get(b, {})
            keys = [k for k, v in entries.items() if torch.is_tensor(v) and v.dim() > 0
                    and v.numel() == bucket["shard_numel"]]
            scalars[b] = {k: copy.deepcopy(v) for k, v in entries.items() if k not in keys}
            channels.append(keys)
            for key in keys:
                if entries[key].dtype != dtype:
                    raise HvpsError(f"elastic sharded optimizer: state {key!r} is {entries[key].dtype} for a bucket "
                                    f"of {dtype}; a shard's state must share its dtype")
            if keys:
                block = torch.stack([entries[k].detach().reshape(-1).cpu() for k in keys], dim=1).contiguous()
                blocks.append(block.view(torch.uint8).numpy().copy())
            else:
                blocks.append(np.zeros((bucket["shard_numel"], 0), np.uint8))
        groups = [{k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
                  for group in self.value.param_groups]
        structure = {"channels": channels, "scalars": scalars, "has_state": sorted(local), "param_groups": groups}
        return blocks, structure, None

    def _install(self, blocks: list, size: int, rank: int, structure: dict) -> None:
        self.value.relayout(size, rank)
        by_bucket = {}
        for b, (block, keys, dtype) in enumerate(zip(blocks, structure["channels"], self._dtypes())):
            if b not in structure["has_state"]:
                continue
            entry = copy.deepcopy(structure["scalars"][b])
            if keys:
                values = torch.from_numpy(np.ascontiguousarray(block)).view(dtype)
                entry.update({key: values[:, c].clone() for c, key in enumerate(keys)})
            by_bucket[b] = entry
        self.value.load_local_state(by_bucket, structure["param_groups"])

    def _apply_hyperparameters(self, structure: dict) -> None:
        for group, hyper in zip(self.value.param_groups, structure["param_groups"]):
            group.update(copy.deepcopy(hyper))


class AdoptedOptimizerHandler(SavedValue):
    """Stands in a TorchState for an optimizer over a fully sharded model's shards: that model's
    :class:`FullyShardedStateHandler` saves, restores and syncs its state with the shards, so these do nothing.

    Args:
        optimizer: the adopted optimizer.
        owner: the model's handler.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, owner: FullyShardedStateHandler) -> None:
        self.value, self.owner = optimizer, owner

    def set_value(self, value: torch.optim.Optimizer) -> None:
        """Another optimizer over the same shards: the model's handler adopts it instead.

        Args:
            value: the optimizer now in the TorchState's attribute.

        Raises:
            ValueError: its parameters are not the model's shards.
        """
        if not self.owner.owns(value):
            raise ValueError("a TorchState optimizer over a fully sharded model's shards can only be replaced by "
                             "another optimizer over those shards")
        self.owner.optimizers = [value if opt is self.value else opt for opt in self.owner.optimizers]
        self.value = value

    def save(self) -> None:
        """Saved by the model's handler."""

    def restore(self) -> None:
        """Restored by the model's handler."""

    def sync(self) -> None:
        """Synced by the model's handler."""
