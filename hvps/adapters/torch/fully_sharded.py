"""``fully_shard``: ZeRO stage 3 on hvps's collectives (each rank stores 1/N of every parameter).

Why this API. A Horovod user keeps an ordinary model and an ordinary torch optimizer; a user of torch's
FSDP2 calls ``fully_shard(block)`` on each block and ``fully_shard(model)`` on the root, then builds the
optimizer over ``model.parameters()``. ``hvd.fully_shard(model, units=...)`` is that second idiom in one
call: it changes ``model`` in place and returns it (no wrapper module, so ``state_dict()`` keys, attribute
access and the training loop stay as they were), and every registered parameter becomes this rank's shard
of itself. ``torch.optim.Adam(model.parameters())`` then steps shards only: its state is 1/N by
construction, and no ``DistributedOptimizer`` is needed (gradients are already averaged when
``backward()`` returns). One call with ``units`` instead of one call per block lets hvps know every unit
when it lays out the shards, checks them across ranks once, and orders the prefetches.

Units. ``units`` names the modules whose parameters are gathered and freed together: a list of submodules,
or module classes (every submodule of one of those classes, as FSDP1's ``transformer_layer_cls``). Each
parameter belongs to the innermost unit around it; the parameters no unit claims form the root unit (the
model itself). Without ``units`` the whole model is one unit. A unit's forward must run through its
``__call__`` (a ``ModuleList`` is not a unit: its blocks are).

Layout. A unit's parameters of one dtype and device are flattened into one buffer padded to a multiple of
N; rank r stores the contiguous block ``[r * L/N, (r+1) * L/N)`` (as ``ShardedOptimizer``'s buckets).
The registered ``nn.Parameter`` of each parameter is this rank's part of that block, a 1-D view of the
unit's shard buffer (its size differs across ranks and may be 0), so one all-gather of the buffer yields
the whole unit and the full parameters are views of the gathered buffer (no copies either way).

Per step:

1. **Forward.** A unit's forward pre-hook waits for its all-gather (started by the previous unit's hook
   as a prefetch, or now), points the module's parameters at full tensors, and starts the all-gather of
   the next unit in the order recorded during the first forward. Its forward hook frees the full
   parameters again (the root unit's stay gathered when a backward will follow: it is the first needed).
2. **Backward.** A hook on the unit's outputs gathers it again before its backward and prefetches the
   unit before it. When the last of a unit's gradients is accumulated, its gradients are packed into one
   flat buffer and reduce-scattered asynchronously (Average by default), and the full parameters and
   gradients are freed. At most ``REDUCE_SCATTERS_IN_FLIGHT`` travel at once (starting one more waits for
   the oldest: each holds a full-size flat gradient until then); at the end of ``backward()`` the rest are
   waited for. Each shard's ``.grad`` is its block of the averaged gradient (added to an existing ``.grad``:
   accumulation works as in torch). Parameters no rank used get a zero gradient (all ranks must reduce-scatter the same buffers).
3. **Step.** Any element-wise torch optimizer over ``model.parameters()`` (SGD, Adam, AdamW, RMSprop, ...).

Between steps a rank holds its shards, their gradients and the optimizer's state for them: about 1/N of
the replicated bytes. ``FullyShardedModel.of(model)`` reaches the controller:
``clip_grad_norm_`` (the whole gradient's norm) and ``full_parameters()`` (gather everything, e.g. to
evaluate or save a full ``state_dict()``).

At wrap time the parameters' names, shapes and dtypes are compared across ranks (``HvpsError`` naming the
parameter and the ranks) and, by default, every parameter and buffer is broadcast from rank 0, as DDP does
at construction (``broadcast_parameters`` cannot run on the shards afterwards: their sizes differ by rank).
A worker that joins an elastic job in progress leaves both out (the running workers are not wrapping): its
``hvd.elastic.TorchState``'s sync brings its shards and compares the layouts
(:mod:`hvps.adapters.torch.elastic_sharding`).

Not supported (``ValueError`` at construction): ``op=Adasum``; compressions other than none, fp16 and bf16
(top-k, PowerSGD, int8, DGC: they cannot be reduce-scattered); sparse gradients (an ``Embedding`` or
``EmbeddingBag`` with ``sparse=True``); a parameter shared by two units (tied weights must share a unit).

Exactness: with element-wise optimizer kernels (``foreach=False``) each shard element is updated with the
same operations as in an unsharded run, so when the averaged gradients are the same bits the parameters
are too.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import torch
import torch.utils.weak

import hvps
from hvps import ProcessSet, global_process_set
from hvps.adapters.common.options import gradient_options
from hvps.adapters.common.sharding import (REDUCE_SCATTERS_IN_FLIGHT, Signature, check_same_everywhere,
                                          sharded_op)
from hvps.compression import summable
from hvps.compression.compressors import CastCompressor, NoneCompressor
from hvps.core.flat_shards import FlatLayout
from hvps.core.views import as_array, resizable_view
from hvps.elastic.mode import joins_a_running_job

from .compression import OPS, as_gradient_compression
from .mpi_ops import Average, Sum, allreduce_async, broadcast_async_, reducescatter_async
from .tensors import core_input, from_core, takes_tensor

__all__ = ["fully_shard", "FullyShardedModel"]

_CONTROLLER = "_hvps_fully_sharded"
#: every shard parameter -> a weak reference to its model's controller (for a holder of the shards alone, such as
#: an optimizer loaded from a checkpoint without its model); the shards stay the same objects through relayouts
_OWNERS = torch.utils.weak.WeakIdKeyDictionary()


class _FlatGroup:
    """One unit's parameters of one dtype and device, flattened, padded to a multiple of N, and sharded.

    ``full[i]`` is the original ``nn.Parameter``, for good a view of ``full_flat``, the unit's gathered
    buffer, whose storage is allocated while the unit is gathered and resized to nothing when it is freed
    (so the views of the full parameters that autograd saves in forward, such as a linear layer's
    ``weight.t()``, never keep a gathered copy alive until backward: the unit is gathered into the same
    storage again before its backward, as FSDP2 does); ``shards[i]`` is the registered shard parameter, a view
    of ``shard_flat``; ``slices[i]`` is ``(start, numel)`` of parameter i in the flat buffer and
    ``pieces[i]`` ``(start, numel)`` of its shard in ``shard_flat``.
    """

    def __init__(self, name: str, names: list, params: list, size: int, rank: int) -> None:
        self.name, self.names, self.full = name, names, params
        self.shapes = [p.shape for p in params]
        layout = FlatLayout(tuple(p.numel() for p in params), size)
        self.slices, self.numel, self.shard_numel, self.padded = (layout.slices, layout.numel, layout.shard_numel,
                                                                  layout.padded)
        # (offset in the parameter, offset in the block, length); (0, 0, 0): none of it is in this rank's block
        mine = {i: piece for i, *piece in layout.pieces(rank)}
        ref = params[0]
        self.dtype, self.device = ref.dtype, ref.device
        with torch.no_grad():
            self.shard_flat = torch.zeros(self.shard_numel, dtype=ref.dtype, device=ref.device)
            self.pieces, self.shards = [], []
            for i, p in enumerate(params):
                offset, at, n = mine.get(i, (0, 0, 0))
                piece = self.shard_flat[at : at + n]
                piece.copy_(p.detach().reshape(-1)[offset : offset + n])
                self.pieces.append((at, n))
                self.shards.append(torch.nn.Parameter(piece, requires_grad=p.requires_grad))
        self.trainable = [p for p in params if p.requires_grad]
        self._new_full_buffer()
        self.gather_handle: Optional[hvps.Handle] = None
        self.reduce_handle: Optional[hvps.Handle] = None
        self.reduce_ctx: Any = None
        #: whether this backward started its reduce-scatter (it may be finished already)
        self.reduce_started = False
        self.grads_in = 0

    def relayout(self, block: torch.Tensor, size: int, rank: int) -> None:
        """Hold ``block`` as this rank's block of a layout over ``size`` ranks (elastic re-sharding): the
        shard parameters stay the same objects (an optimizer built over them keeps working) and become
        views of the new block; their gradients are dropped."""
        layout = FlatLayout(tuple(shape.numel() for shape in self.shapes), size)
        self.slices, self.numel, self.shard_numel, self.padded = (layout.slices, layout.numel, layout.shard_numel,
                                                                  layout.padded)
        mine = {i: piece for i, *piece in layout.pieces(rank)}
        self.shard_flat = block.to(dtype=self.dtype, device=self.device).reshape(-1).contiguous()
        self.pieces = []
        for i, shard in enumerate(self.shards):
            _, at, n = mine.get(i, (0, 0, 0))
            shard.data = self.shard_flat[at : at + n]
            shard.grad = None
            self.pieces.append((at, n))
        self._new_full_buffer()

    def _new_full_buffer(self) -> None:
        """Make the full parameters views of a new ``full_flat`` of the layout's padded length, unallocated."""
        self.full_flat = torch.empty(self.padded, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for p, shape, (start, n) in zip(self.full, self.shapes, self.slices):
                p.data = self.full_flat[start : start + n].view(shape)
        self.free()

    def free(self) -> None:
        """Release the full parameters' storage (the shards stay; the views keep their shapes)."""
        self.full_flat.untyped_storage().resize_(0)

    def start_gather(self, process_set: ProcessSet) -> None:
        """Start all-gathering the shards of every rank into ``full_flat``, allocated again (a no-op while one
        is in flight). The data plane writes into it directly wherever it can reach its memory (CPU tensors;
        device tensors on a backend that moves them); elsewhere :meth:`finish_gather` copies its output in."""
        if self.gather_handle is not None:
            return
        storage = self.full_flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.padded * self.full_flat.element_size())
        # autograd's saved views of the full parameters must see the values they were saved with, not a change
        self._kept_version = torch.autograd._unsafe_preserve_version_counter(self.full_flat)
        if self.device.type == "cpu":  # a numpy view of full_flat would make its storage fixed-size: not this one
            source, out = as_array(self.shard_flat), resizable_view(self.full_flat)
        elif takes_tensor(self.full_flat):  # a device tensor the backend moves itself (NCCL)
            source, out = self.shard_flat, self.full_flat
        else:  # staged through host memory
            source, out = core_input(self.shard_flat), None
        self._gathers_in_place = out is not None
        self.gather_handle = hvps.allgather_async(source, f"{self.name}.gather", process_set, out=out)

    def finish_gather(self) -> None:
        """Wait for the all-gather (and copy its output into ``full_flat`` where it could not write there)."""
        flat = self.gather_handle.wait()
        self.gather_handle = None
        if not self._gathers_in_place:
            with torch.no_grad():
                self.full_flat.copy_(from_core(flat, self.device))
        self._kept_version.__exit__(None, None, None)

    def drop_gather(self) -> None:
        """Wait for the gather in flight, if any, and free ``full_flat``. After a failed gather a new buffer takes
        its place (the failed transfer may still hold the old one) and the error goes on up."""
        handle, self.gather_handle = self.gather_handle, None
        if handle is None:
            return
        try:
            handle.wait()
        except BaseException:
            self._new_full_buffer()
            raise
        self.free()

    def pack_gradients(self) -> torch.Tensor:
        """The full gradients as one flat padded tensor (zeros where there is none); the full ``.grad``
        are released."""
        parts = []
        for p, name, (_, n) in zip(self.full, self.names, self.slices):
            grad = p.grad
            if grad is None:
                parts.append(torch.zeros(n, dtype=self.dtype, device=self.device))
                continue
            if grad.is_sparse:
                raise ValueError(f"parameter {name!r} has a sparse gradient: fully_shard reduce-scatters dense "
                                 "buffers")
            parts.append(grad.reshape(-1))
            p.grad = None
        if self.padded > self.numel:
            parts.append(torch.zeros(self.padded - self.numel, dtype=self.dtype, device=self.device))
        return torch.cat(parts)

    def install_gradient(self, shard_grad: torch.Tensor) -> None:
        """Give each trainable shard its block of ``shard_grad`` (added to an existing ``.grad``)."""
        for shard, (start, n) in zip(self.shards, self.pieces):
            if not shard.requires_grad:
                continue
            piece = shard_grad[start : start + n]
            if shard.grad is None:
                shard.grad = piece
            else:
                shard.grad.add_(piece)


class _Unit:
    """A module whose parameters are gathered before its forward and backward and freed after them."""

    def __init__(self, name: str, module: torch.nn.Module, is_root: bool) -> None:
        self.name, self.module, self.is_root = name, module, is_root
        #: (owning module, attribute name, index of the group, index in the group) per registration
        self.registrations: list = []
        self.groups: list = []
        self.gathered = False
        self.reducing = False
        self.all_trainable = True

    @property
    def gathering(self) -> bool:
        return any(g.gather_handle is not None for g in self.groups)

    def show(self, full: bool) -> None:
        """Register the full parameters (``full``) or the shards on the owning modules."""
        for module, attr, gi, pi in self.registrations:
            group = self.groups[gi]
            module._parameters[attr] = group.full[pi] if full else group.shards[pi]


class FullyShardedModel:
    """The controller of a model changed by :func:`fully_shard` (``FullyShardedModel.of(model)``).

    It owns the hooks, the units and their collectives; see the module's docstring.
    """

    def __init__(self, model: torch.nn.Module, units: Any = None, compression: Any = None, op: Any = Average,
                 gradient_predivide_factor: float = 1.0, prefetch: bool = True, broadcast_from: Optional[int] = 0,
                 process_set: ProcessSet = global_process_set) -> None:
        """Shard ``model``'s parameters in place and install the hooks (see :func:`fully_shard`)."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"fully_shard takes a torch.nn.Module, not {type(model).__name__}")
        if getattr(model, _CONTROLLER, None) is not None:
            raise ValueError("this model is already fully sharded")
        op = sharded_op(op, "fully_shard")
        op, self.compression, prescale, postscale = gradient_options(
            op, gradient_predivide_factor, compression, as_gradient_compression, ops=(Average, Sum))
        if not isinstance(self.compression.compressor, (NoneCompressor, CastCompressor)):
            raise ValueError(f"compression {self.compression!r} with fully_shard is not supported: only none, "
                             "fp16 and bf16 (casts that a reduce-scatter can sum)")
        for name, module in model.named_modules():
            if getattr(module, "sparse", False) is True and isinstance(module, (torch.nn.Embedding,
                                                                                torch.nn.EmbeddingBag)):
                raise ValueError(f"sparse gradients with fully_shard are not supported: {name or 'the model'} "
                                 f"({type(module).__name__}) has sparse=True; shards are dense")
        for name, p in model.named_parameters():
            if p.is_sparse:
                raise ValueError(f"sparse parameter {name!r} with fully_shard is not supported")
        self.units = self._claim(model, _unit_modules(model, units))
        hvps.size()  # HvpsError before init
        if not process_set.included():
            raise ValueError("this rank is not in fully_shard's process_set")
        self.model, self.process_set, self.prefetch = model, process_set, prefetch
        self._size, self._rank = process_set.size(), process_set.rank()
        self._scaling = (op, prescale, postscale)
        self._plan = self._reduction_plan()
        if not joins_a_running_job():  # a joiner's shards come from the elastic state's sync (and its check)
            self._check_same_parameters_everywhere()
            if broadcast_from is not None:
                self._broadcast(broadcast_from)
        for unit in self.units:
            self._lay_out(unit)  # each flat group starts freed (_FlatGroup._new_full_buffer)
            unit.show(full=False)
        self._forward_order: list = []
        self._order_known = False
        self._in_backward = False
        #: flat groups whose reduce-scatter is in flight, oldest first (at most REDUCE_SCATTERS_IN_FLIGHT)
        self._reducing: collections.deque = collections.deque()
        self._hooks = []
        for unit in self.units:
            self._hooks.append(unit.module.register_forward_pre_hook(self._pre_forward_hook(unit)))
            self._hooks.append(unit.module.register_forward_hook(self._post_forward_hook(unit)))
            for group in unit.groups:
                for p in group.trainable:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(unit, group)))
        setattr(model, _CONTROLLER, self)

    def _reduction_plan(self) -> Any:
        """How the gradients are scaled and reduced at the process set's current size."""
        op, prescale, postscale = self._scaling
        return summable.summable_plan(self.compression.compressor, op, self.process_set.size, prescale, postscale)

    @staticmethod
    def of(model: torch.nn.Module) -> "FullyShardedModel":
        """The controller of a model that :func:`fully_shard` changed.

        Args:
            model: the model given to ``fully_shard``.

        Returns:
            Its ``FullyShardedModel``.

        Raises:
            ValueError: the model is not fully sharded.
        """
        controller = getattr(model, _CONTROLLER, None)
        if controller is None:
            raise ValueError("this model is not fully sharded: call hvd.fully_shard(model) first")
        return controller

    @staticmethod
    def owning(parameter: torch.Tensor) -> Optional["FullyShardedModel"]:
        """The controller of the model whose shard ``parameter`` is.

        Args:
            parameter: any tensor (an optimizer's parameter).

        Returns:
            The ``FullyShardedModel``, or None when ``parameter`` is no shard of a live fully sharded model.
        """
        owner = _OWNERS.get(parameter)
        return None if owner is None else owner()

    # -- setup -------------------------------------------------------------------------------------
    def _claim(self, model: torch.nn.Module, unit_modules: list) -> list:
        """The units, root first: every parameter registration goes to the innermost unit around it."""
        root = _Unit("root", model, is_root=True)
        units = {id(model): root}
        for name, module in model.named_modules():
            if module is not model and any(module is m for m in unit_modules):
                units[id(module)] = _Unit(name, module, is_root=False)
        owner: dict = {}  # parameter -> (unit, its qualified name)
        self._params: dict = {}  # unit -> [(qualified name, parameter)] in registration order

        def walk(module: torch.nn.Module, prefix: str, unit: _Unit) -> None:
            unit = units.get(id(module), unit)
            for attr, p in module._parameters.items():
                if p is None:
                    continue
                qualified = f"{prefix}{attr}"
                if p in owner and owner[p][0] is not unit:
                    raise ValueError(f"parameter {owner[p][1]!r} is also {qualified!r} in another unit (tied "
                                     f"weights in units {owner[p][0].name!r} and {unit.name!r}): put the modules "
                                     "that share it in one unit")
                if p not in owner:
                    owner[p] = (unit, qualified)
                    self._params.setdefault(unit, []).append((qualified, p))
                unit.registrations.append((module, attr, p))
            for child_name, child in module._modules.items():
                if child is not None:
                    walk(child, f"{prefix}{child_name}.", unit)

        walk(model, "", root)
        return list(units.values())

    def _check_same_parameters_everywhere(self) -> None:
        """One allgather of each parameter's unit, name, shape and dtype; HvpsError naming the first difference."""
        mine = [Signature(name, tuple(p.shape), str(p.dtype), p.requires_grad, unit.name)
                for unit in self.units for name, p in self._params.get(unit, [])]
        check_same_everywhere(mine, "fully_shard.signature", "fully_shard", "parameter",
                              "every rank must wrap the same model with the same units", self.process_set)

    def _broadcast(self, root_rank: int) -> None:
        tensors = [(f"{unit.name}.{name}", p.data) for unit in self.units for name, p in self._params.get(unit, [])]
        tensors += [(f"buffer.{name}", b) for name, b in self.model.named_buffers()]
        handles = [broadcast_async_(t, root_rank, name=f"fully_shard.{name}", process_set=self.process_set)
                   for name, t in tensors]
        for handle in handles:
            handle.wait()

    def _lay_out(self, unit: _Unit) -> None:
        """Group ``unit``'s parameters by dtype and device, shard each group and index the registrations."""
        kinds: dict = {}
        for name, p in self._params.get(unit, []):
            kinds.setdefault((p.dtype, p.device), []).append((name, p))
        where = {}
        for gi, entries in enumerate(kinds.values()):
            group = _FlatGroup(f"fully_shard.{unit.name}.{gi}", [n for n, _ in entries], [p for _, p in entries],
                               self._size, self._rank)
            unit.groups.append(group)
            for shard in group.shards:
                _OWNERS[shard] = weakref.ref(self)
            unit.all_trainable &= len(group.trainable) == len(group.full)
            for pi, (_, p) in enumerate(entries):
                where[p] = (gi, pi)
        unit.registrations = [(module, attr, *where[p]) for module, attr, p in unit.registrations]

    # -- gathering ---------------------------------------------------------------------------------
    def _start_gather(self, unit: _Unit) -> None:
        if not unit.gathered:
            for group in unit.groups:
                group.start_gather(self.process_set)

    def _gather(self, unit: _Unit) -> None:
        """Make ``unit``'s full parameters available (waiting for a prefetch, or gathering now)."""
        if unit.gathered:
            return
        self._start_gather(unit)
        for group in unit.groups:
            group.finish_gather()
        unit.gathered = True

    def _free(self, unit: _Unit) -> None:
        if unit.gathering:  # a prefetch nobody used: its output is dropped
            for group in unit.groups:
                group.drop_gather()
        if unit.gathered:
            for group in unit.groups:
                group.free()
            unit.gathered = False

    def _neighbour(self, unit: _Unit, step: int) -> Optional[_Unit]:
        if not (self.prefetch and self._order_known):
            return None
        order = self._forward_order
        i = order.index(unit) + step if unit in order else -1
        return order[i] if 0 <= i < len(order) else None

    # -- forward -----------------------------------------------------------------------------------
    def _pre_forward_hook(self, unit: _Unit):
        def hook(module: torch.nn.Module, args: Any) -> None:
            if unit.is_root:
                self._order_known = bool(self._forward_order)
                if self._in_backward:  # the last backward raised before its end: drop what it left
                    self._abandon_backward()
                self._free(unit)  # kept from a forward that no backward followed: the shards may have moved
            if not self._order_known and unit not in self._forward_order:
                self._forward_order.append(unit)
            self._gather(unit)
            unit.show(full=True)
            following = self._neighbour(unit, +1)
            if following is not None:
                self._start_gather(following)
        return hook

    def _post_forward_hook(self, unit: _Unit):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            unit.show(full=False)
            outputs = [t for t in _tensors(output) if t.requires_grad]
            if outputs and torch.is_grad_enabled():
                torch.autograd.graph.register_multi_grad_hook(outputs, lambda grads: self._pre_backward(unit),
                                                              mode="any")
            if not (unit.is_root and outputs and torch.is_grad_enabled()):
                self._free(unit)
            if unit.is_root:
                for other in self.units:
                    if other is not unit:
                        self._free(other)  # prefetches the forward did not use
        return hook

    # -- backward ----------------------------------------------------------------------------------
    def _pre_backward(self, unit: _Unit) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if unit.reducing:  # a second use of the unit's outputs in this backward: already done
            return
        self._gather(unit)
        previous = self._neighbour(unit, -1)
        if previous is not None and not previous.reducing:
            self._start_gather(previous)

    def _grad_hook(self, unit: _Unit, group: _FlatGroup):
        def hook(p: torch.Tensor) -> None:
            group.grads_in += 1
            if group.grads_in == len(group.trainable):
                self._start_reduce(group)
                if all(g.reduce_started or not g.trainable for g in unit.groups):
                    unit.reducing = True
                    if unit.all_trainable:  # frozen parameters may still be needed by this backward
                        self._free(unit)
        return hook

    def _start_reduce(self, group: _FlatGroup) -> None:
        if len(self._reducing) >= REDUCE_SCATTERS_IN_FLIGHT:  # the oldest's flat gradient goes before this one comes
            self._finish_reduce(self._reducing.popleft())
        flat = group.pack_gradients()
        plan = self._plan
        scaled = flat if plan.before == 1.0 else OPS.scale(flat, plan.before)
        payload, group.reduce_ctx = summable.compress_tensor(self.compression, scaled, OPS)
        self.compression.record(flat.nbytes, [payload])
        group.reduce_handle = reducescatter_async(payload, name=f"{group.name}.reduce", op=plan.op,
                                                  prescale_factor=plan.prescale, postscale_factor=plan.postscale,
                                                  process_set=self.process_set)
        group.reduce_started = True
        self._reducing.append(group)

    def _finish_reduce(self, group: _FlatGroup) -> None:
        """Wait for ``group``'s reduce-scatter and give its shards their gradients."""
        out, group.reduce_handle = group.reduce_handle.wait(), None
        grad = summable.decompress_tensor(self.compression, out, group.reduce_ctx, OPS)
        if self._plan.after != 1.0:
            grad = OPS.scale(grad, self._plan.after)
        with torch.no_grad():
            group.install_gradient(grad.to(group.dtype).reshape(-1))

    def _finish_backward(self) -> None:
        """End of ``backward()``: reduce-scatter what is left, install the shard gradients, free everything."""
        try:
            for unit in self.units:
                for group in unit.groups:
                    if group.trainable and not group.reduce_started:
                        self._start_reduce(group)  # parameters without a gradient on this rank
            while self._reducing:
                self._finish_reduce(self._reducing.popleft())
        finally:
            self._abandon_backward()
        hvps.step_done()

    def _abandon_backward(self) -> None:
        for unit in self.units:
            for group in unit.groups:
                if group.reduce_handle is not None:
                    with contextlib.suppress(Exception):
                        group.reduce_handle.wait()
                group.reduce_handle, group.reduce_ctx, group.grads_in = None, None, 0
                group.reduce_started = False
            unit.reducing = False
            self._free(unit)
        self._reducing.clear()
        self._in_backward = False

    # -- tools -------------------------------------------------------------------------------------
    def sharded_parameters(self) -> Iterator[torch.nn.Parameter]:
        """Every shard parameter (what ``model.parameters()`` yields outside forward)."""
        for unit in self.units:
            for group in unit.groups:
                yield from group.shards

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the shard gradients so that the whole gradient's 2-norm is at most ``max_norm`` (collective).

        Args:
            max_norm: the largest 2-norm of the gradient over all parameters.

        Returns:
            The 2-norm before clipping (the same on every rank).
        """
        squares = torch.zeros(1, dtype=torch.float64)
        grads = [s.grad for s in self.sharded_parameters() if s.grad is not None]
        for grad in grads:
            squares += grad.detach().double().square().sum().cpu()
        total = allreduce_async(squares, op=Sum, name="fully_shard.grad_norm", process_set=self.process_set).wait()
        norm = total.sqrt()[0]
        factor = max_norm / (float(norm) + 1e-6)
        if factor < 1.0:
            for grad in grads:
                grad.mul_(factor)
        return norm

    @contextlib.contextmanager
    def full_parameters(self, writeback: bool = False) -> Iterator[torch.nn.Module]:
        """Inside, the model holds its full parameters (collective: every rank enters it).

        Args:
            writeback: copy each rank's block of the full parameters back into its shards on exit (for
                ``model.load_state_dict(full_state)`` inside).

        Yields:
            The model.
        """
        for unit in self.units:
            self._start_gather(unit)
        for unit in self.units:
            self._gather(unit)
            unit.show(full=True)
        try:
            yield self.model
        finally:
            for unit in self.units:
                unit.show(full=False)
                if writeback:
                    with torch.no_grad():
                        for group in unit.groups:
                            for p, shard, (start, n), (piece, m) in zip(group.full, group.shards, group.slices,
                                                                        group.pieces):
                                lo = self._rank * group.shard_numel + piece - start
                                shard.copy_(p.detach().reshape(-1)[lo : lo + m])
                self._free(unit)

    def flat_groups(self) -> list:
        """Every unit's flat groups, in unit order (the order of :meth:`relayout`'s blocks)."""
        return [group for unit in self.units for group in unit.groups]

    def world(self) -> tuple:
        """``(size, rank)`` of the layout the shards are in."""
        return self._size, self._rank

    def drop_collectives(self) -> None:
        """Forget what a failed step left behind (local: no collective): gathers and reduce-scatters in
        flight, gathered parameters, full gradients, the shown full parameters. For an elastic restore."""
        for unit in self.units:
            for group in unit.groups:
                with contextlib.suppress(Exception):
                    group.drop_gather()
                if group.reduce_handle is not None:
                    with contextlib.suppress(Exception):
                        group.reduce_handle.wait()
                group.reduce_handle = group.reduce_ctx = None
                group.grads_in, group.reduce_started = 0, False
                for p in group.full:
                    p.grad = None
            unit.reducing = False
            unit.show(full=False)
            self._free(unit)
        self._reducing.clear()
        self._in_backward = False

    def relayout(self, blocks: Sequence[torch.Tensor], size: int, rank: int) -> None:
        """Re-shard for a world of ``size`` ranks in which this one is ``rank`` (local: the caller brings the
        data, e.g. the elastic state that rebuilt it).

        Args:
            blocks: for each of :meth:`flat_groups`, this rank's block of the new layout (its
                ``FlatLayout(sizes, size).shard_numel`` elements).
            size: the new number of ranks.
            rank: this rank in the new world.

        Raises:
            ValueError: a block of the wrong length, or not one per flat group.
        """
        groups = self.flat_groups()
        if len(blocks) != len(groups):
            raise ValueError(f"relayout takes one block per flat group ({len(groups)}), not {len(blocks)}")
        for group, block in zip(groups, blocks):
            wanted = FlatLayout(tuple(shape.numel() for shape in group.shapes), size).shard_numel
            if block.numel() != wanted:
                raise ValueError(f"{group.name}: a block of {block.numel()} elements where {wanted} are held at "
                                 f"{size} ranks")
        self.drop_collectives()
        for group, block in zip(groups, blocks):
            group.relayout(block, size, rank)
        self._size, self._rank = size, rank
        self._plan = self._reduction_plan()  # an average's division (with a cast's guard) depends on the size

    def remove(self) -> None:
        """Remove the hooks (the parameters stay sharded)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def __repr__(self) -> str:
        return f"FullyShardedModel(units={len(self.units)}, shards={self._size})"


def fully_shard(model: torch.nn.Module, units: Union[None, Iterable[torch.nn.Module], Sequence[type]] = None, *,
                compression: Any = None, op: Any = Average, gradient_predivide_factor: float = 1.0,
                prefetch: bool = True, broadcast_from: Optional[int] = 0,
                process_set: ProcessSet = global_process_set) -> torch.nn.Module:
    """Shard ``model``'s parameters over the ranks (ZeRO stage 3), in place; build the optimizer afterwards.

    Args:
        model: the model; every rank passes the same architecture.
        units: submodules gathered and freed together (a list of modules, or of module classes: every
            submodule of those classes); the parameters left over form the root unit. Default: one unit.
        compression: ``hvd.Compression.none`` (default), ``.fp16`` or ``.bf16`` for the gradients.
        op: ``hvd.Average`` (default) or ``hvd.Sum`` for the gradients.
        gradient_predivide_factor: Horovod's predivide factor (Average only).
        prefetch: start the next unit's all-gather while the current unit computes.
        broadcast_from: the rank whose parameters and buffers every rank starts from (None: no broadcast).
        process_set: the ranks that share the model.

    Returns:
        ``model`` itself, whose registered parameters are now this rank's shards.

    Raises:
        ValueError: an unsupported combination (Adasum, a non-cast compression, sparse gradients, weights tied
            across units) or bad arguments.
        HvpsError: hvps is not initialized, or the parameters differ across ranks.
    """
    FullyShardedModel(model, units, compression=compression, op=op,
                      gradient_predivide_factor=gradient_predivide_factor, prefetch=prefetch,
                      broadcast_from=broadcast_from, process_set=process_set)
    return model


def _unit_modules(model: torch.nn.Module, units: Any) -> list:
    if units is None:
        return []
    units = list(units)
    if all(isinstance(u, type) for u in units):
        classes = tuple(units)
        return [m for m in model.modules() if isinstance(m, classes) and m is not model]
    inside = {id(m) for m in model.modules()}
    for u in units:
        if not isinstance(u, torch.nn.Module):
            raise TypeError(f"units are modules or module classes, not {type(u).__name__}")
        if id(u) not in inside:
            raise ValueError(f"unit {type(u).__name__} is not a submodule of the model")
        if isinstance(u, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            raise ValueError(f"a {type(u).__name__} cannot be a unit: its forward never runs; pass its modules")
    return units


def _tensors(output: Any) -> list:
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []
