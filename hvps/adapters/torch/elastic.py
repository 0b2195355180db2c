"""``hvd.elastic`` for PyTorch, with Horovod's semantics (``horovod.torch.elastic``).

``TorchState(model, optimizer, sampler=..., epoch=0, batch=0)`` tracks a training loop's state:
``commit()`` copies it to host memory (deep copies of the state dicts) and checks for host updates,
``restore()`` puts the last commit back exactly, ``sync()`` makes every rank's state rank 0's.
``@hvd.elastic.run`` wraps the training function in the retry loop of :mod:`hvps.elastic.loop`;
``ElasticSampler`` splits a dataset over the ranks and, after a reset, splits what is left of the
epoch over the new ranks. Values of other types get handlers through the registry
(:func:`get_handler_registry` / :func:`set_handler_registry`, or :func:`register_handler`).
What works without an elastic launcher is in the README's "Elastic training".
"""

from __future__ import annotations

import copy
import math
import numbers
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
import torch.utils.data

import hvps
from hvps.adapters.common.controls import compression_of
from hvps.elastic import HostsUpdatedInterrupt, HostUpdateResult, ObjectState, State, notify_hosts_updated, run_fn
from hvps.elastic import reset as _reset
from hvps.elastic.state import SavedValue

from .elastic_sharding import FullyShardedStateHandler, ShardedOptimizerStateHandler
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .sharded_optimizer import ShardedOptimizer


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``func(state, *args, **kwargs)`` elastically: sync the state from rank 0 first, and on a host
    update (or, in elastic mode, a failed collective, after ``state.restore()``) re-initialize, run the
    state's reset callbacks, sync again and call ``func`` again. ``func`` must not start with a
    collective of its own (new workers would meet it while the others sync).

    Args:
        func: the training function, taking the state (a ``TorchState``) first.

    Returns:
        The wrapped function; see :func:`hvps.elastic.run_fn` for what it returns and raises.
    """
    return run_fn(func, _reset)


# ---------------------------------------------------------------------------------------------- sampler
def partition(length: int, processed: Iterable[int], epoch: int, seed: int, shuffle: bool, rank: int,
              size: int) -> tuple:
    """``(remaining, mine)``: the indices of ``range(length)`` not in ``processed`` (shuffled by
    ``seed + epoch`` when ``shuffle``), and this rank's share of them: every ``size``-th from ``rank``
    on, after the list is padded (by repeating it) to a multiple of ``size``."""
    done = set(processed)
    remaining = [index for index in range(length) if index not in done]
    if shuffle and remaining:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        remaining = [remaining[i] for i in torch.randperm(len(remaining), generator=generator).tolist()]
    per_rank = math.ceil(len(remaining) / size)
    total = per_rank * size
    padded = (remaining * math.ceil(total / len(remaining)))[:total] if remaining else []
    return remaining, padded[rank:total:size]


class ElasticSampler(torch.utils.data.Sampler):
    """A dataset split over the ranks that remembers what was processed in the epoch.

    Use it as ``DataLoader(dataset, sampler=ElasticSampler(dataset), ...)``, put it in the
    ``TorchState`` (``sampler=``), call ``record_batch(batch_idx, batch_size)`` after each batch and
    ``set_epoch(epoch)`` at each epoch's start. On ``sync()`` the ranks' processed indices are joined, and
    what is left of the epoch is split anew over the (possibly changed) number of ranks.

    Args:
        dataset: a dataset with ``len()`` (of constant size).
        shuffle: shuffle the indices each epoch (the same order on every rank).
        seed: shuffle seed; the same on every rank.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        try:
            len(dataset)
        except TypeError:
            raise TypeError(f"ElasticSampler needs a dataset with a length (len(dataset)), not "
                            f"{type(dataset).__name__}; an IterableDataset cannot be split by index") from None
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
            raise TypeError(f"ElasticSampler seed must be an int (the same on every rank), not {seed!r}")
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.processed_indices: set = set()
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list = []
        self.indices: list = []
        self._next_indices: list = []
        self._iterated = False
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    @property
    def processed_num(self) -> int:
        """How many distinct indices were recorded as processed this epoch (all ranks' after a sync)."""
        return len(self.processed_indices)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: forget the processed indices and shuffle anew.

        Args:
            epoch: the epoch (an int >= 0; it seeds the shuffle with ``seed``).

        Raises:
            ValueError: ``epoch`` is not an int >= 0.
        """
        if not isinstance(epoch, numbers.Integral) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, not {epoch!r}")
        self.epoch = int(epoch)
        self.processed_indices = set()
        self.reset()

    def get_indices(self, batch_idx: int, batch_size: int) -> list:
        """The indices of batch ``batch_idx`` (of ``batch_size``) of the share being iterated (the one the
        last ``iter()`` took; a reset re-splits for the next iteration, as in Horovod).

        Args:
            batch_idx: the batch's index in this epoch's share (>= 0).
            batch_size: samples per batch (>= 1).

        Returns:
            The dataset indices of that batch (fewer for the last one).

        Raises:
            ValueError: ``batch_idx`` or ``batch_size`` is not an int in range.
        """
        for name, value in (("batch_idx", batch_idx), ("batch_size", batch_size)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < (name == "batch_size"):
                raise ValueError(f"{name} must be an int >= {int(name == 'batch_size')}, not {value!r}")
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record batch ``batch_idx`` (of ``batch_size``) of this rank's share as processed.

        Args:
            batch_idx: as :meth:`get_indices`.
            batch_size: as :meth:`get_indices`.
        """
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices: Iterable[int]) -> None:
        """Record dataset ``indices`` as processed.

        Args:
            indices: indices into the dataset.
        """
        self.processed_indices.update(int(index) for index in indices)

    def state_dict(self) -> dict:
        """What a commit keeps of the sampler.

        Returns:
            ``{"epoch": ..., "processed_indices": {...}}`` (a copy of the set).
        """
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take ``state_dict``'s epoch and processed indices (copied) and split the rest anew.

        Args:
            state_dict: what :meth:`state_dict` returned.

        Raises:
            KeyError: ``state_dict`` lacks ``epoch`` or ``processed_indices``.
        """
        missing = {"epoch", "processed_indices"} - set(state_dict)
        if missing:
            raise KeyError(f"ElasticSampler state dict lacks {sorted(missing)}; give the dict state_dict() returned")
        self.epoch = int(state_dict["epoch"])
        self.processed_indices = set(int(i) for i in state_dict["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Split the epoch's unprocessed indices over the current ranks (``hvd.size()``, ``hvd.rank()``)."""
        self.num_replicas, self.rank = hvps.size(), hvps.rank()
        self.remaining_indices, self._next_indices = partition(len(self.dataset), self.processed_indices, self.epoch,
                                                               self.seed, self.shuffle, self.rank, self.num_replicas)
        self.num_samples = len(self._next_indices)
        self.total_size = self.num_samples * self.num_replicas
        if not self._iterated:
            self.indices = self._next_indices

    def __iter__(self) -> Iterator[int]:
        """This rank's share as split by the last reset; batches recorded from now on refer to it."""
        self._iterated = True
        self.indices = list(self._next_indices)
        return iter(list(self.indices))

    def __len__(self) -> int:
        return self.num_samples


# ---------------------------------------------------------------------------------------------- handlers
class StateHandler(SavedValue):
    """Saves, restores and syncs one value of a TorchState (``value``)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def set_value(self, value: Any) -> None:
        """A new value was assigned to the state's attribute: track it, and save it."""
        self.value = value
        self.save()


class _StateDictHandler(StateHandler):
    """A value with ``state_dict()``/``load_state_dict()``: saves deep copies, restores a copy of the save
    (so that in-place updates after a restore cannot change the save)."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), 0, name="elastic.state_dict"))


class ModelStateHandler(_StateDictHandler):
    """A ``torch.nn.Module``: parameters and buffers broadcast from rank 0."""

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)  # load_state_dict copies into the module's tensors

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    """A ``torch.optim.Optimizer``: hyper-parameters and buffers broadcast from rank 0.

    A ``hvd.DistributedOptimizer``'s restore goes through its ``load_state_dict``, which forgets the
    step the failure interrupted (``reset_step()``: handles in flight, countdowns, partial gradients).
    Its compression's error feedback (top-k, DGC, int8, PowerSGD) is saved and restored with it: the
    residual is the part of past gradients not yet applied to the parameters, so it belongs to the
    commit as the parameters do. Kept from an aborted step, it would count that step's gradient once
    more when the step runs again. It is this rank's own, so ``sync()`` leaves it alone (a worker that
    joins starts with none)."""

    def save(self) -> None:
        super().save()
        compression = compression_of(self.value)
        self._saved_compression = None if compression is None else copy.deepcopy(compression.state_dict())

    def restore(self) -> None:
        super().restore()
        compression = compression_of(self.value)
        if compression is not None and self._saved_compression is not None:
            compression.load_state_dict(copy.deepcopy(self._saved_compression))

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)



class LRSchedulerStateHandler(_StateDictHandler):
    """A learning-rate scheduler: its state dict broadcast from rank 0."""


class SamplerStateHandler(_StateDictHandler):
    """An ElasticSampler: sync joins every rank's processed indices, then takes rank 0's epoch."""

    def sync(self) -> None:
        processed = set().union(*allgather_object(self.value.processed_indices, name="elastic.sampler.processed"))
        state = self.value.state_dict()
        state["processed_indices"] = processed
        self.value.load_state_dict(broadcast_object(state, 0, name="elastic.sampler.state"))


_LR_SCHEDULER = getattr(torch.optim.lr_scheduler, "LRScheduler", torch.optim.lr_scheduler._LRScheduler)

_handler_registry: list = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (_LR_SCHEDULER, LRSchedulerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list:
    """The ``[(type, handler class)]`` list TorchState consults, first match wins."""
    return _handler_registry


def set_handler_registry(registry: Sequence) -> None:
    """Replace the registry by ``registry`` (``[(type, StateHandler subclass)]``)."""
    global _handler_registry
    checked = []
    for entry in registry:
        if (not isinstance(entry, tuple) or len(entry) != 2 or not isinstance(entry[0], type)
                or not (isinstance(entry[1], type) and issubclass(entry[1], StateHandler))):
            raise TypeError(f"handler registry entry {entry!r} is not a (type, StateHandler subclass) pair")
        checked.append(entry)
    _handler_registry = checked


def register_handler(value_type: type, handler: type) -> None:
    """Handle values of ``value_type`` with ``handler`` (before the built-in handlers)."""
    set_handler_registry([(value_type, handler)] + list(_handler_registry))


def _handler_for(value: Any) -> Any:
    if FullyShardedStateHandler.handles(value):  # before the registry: it is a torch.nn.Module too
        return FullyShardedStateHandler(value)
    if isinstance(value, ShardedOptimizer):  # and this a torch.optim.Optimizer
        return ShardedOptimizerStateHandler(value)
    for value_type, handler in _handler_registry:
        if isinstance(value, value_type):
            return handler(value)
    return None


# ---------------------------------------------------------------------------------------------- state
class TorchState(ObjectState):
    """A PyTorch training loop's state: ``model``, ``optimizer`` and any keyword attributes.

    Values with a registered handler (modules, optimizers, LR schedulers, ElasticSamplers, your own
    types) are saved through their state dicts and broadcast the way their type needs; the others are
    plain picklable objects (``epoch=0, batch=0``). Assigning a new handled value to an attribute
    (``state.model = other``) tracks and saves it.

    A model changed by ``hvd.fully_shard`` is saved shard by shard, with the optimizers over its shards, and
    so is a ``ShardedOptimizer``'s state: each commit also keeps a copy of the ring neighbour's shard, and
    after a rank is lost (or one joins) the survivors rebuild and re-shard in memory
    (:mod:`hvps.adapters.torch.elastic_sharding`).

    Args:
        model: the model (a ``torch.nn.Module``, fully sharded or not); ``state.model``.
        optimizer: its optimizer (plain, ``DistributedOptimizer`` or ``ShardedOptimizer``); ``state.optimizer``.
        **kwargs: more attributes: handled values (LR schedulers, ``ElasticSampler``) or picklable objects
            (``epoch=0, batch=0``).

    Raises:
        ValueError: an attribute's name starts with ``_`` or is one of the state's methods.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 **kwargs: Any) -> None:
        values = dict(kwargs)
        for name, value in (("model", model), ("optimizer", optimizer)):
            if value is not None:
                values[name] = value
        handlers, plain = {}, {}
        for name, value in values.items():
            if name.startswith("_") or hasattr(type(self), name):
                raise ValueError(f"elastic state attribute {name!r} would hide a method or internal attribute of "
                                 f"{type(self).__name__}; rename it")
            handler = _handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        for name, handler in list(handlers.items()):
            owner = next((h for h in handlers.values() if isinstance(h, FullyShardedStateHandler)
                          and isinstance(handler, OptimizerStateHandler) and h.owns(handler.value)), None)
            if owner is not None:
                handlers[name] = owner.adopt(handler.value)
        object.__setattr__(self, "_handlers", handlers)
        for name in ("model", "optimizer"):
            if name not in values:
                object.__setattr__(self, name, None)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=None, get_rank=None, **plain)

    @property
    def same_on_every_rank(self) -> bool:
        """False when the state holds a fully sharded model or a sharded optimizer: each rank holds its own
        shard, so every reset re-shards (a sync), removals included."""
        sharded = (FullyShardedStateHandler, ShardedOptimizerStateHandler)
        return not any(isinstance(h, sharded) for h in self._handlers.values())

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        """Broadcast every value from rank 0, then save, so that a restore before the next commit
        returns to the synced state (not to what this rank had before it)."""
        for handler in self._handlers.values():
            handler.sync()
            handler.save()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)


__all__ = [
    "run", "State", "ObjectState", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt", "HostUpdateResult",
    "notify_hosts_updated", "StateHandler", "ModelStateHandler", "OptimizerStateHandler", "LRSchedulerStateHandler",
    "SamplerStateHandler", "get_handler_registry", "set_handler_registry", "register_handler", "partition",
]
