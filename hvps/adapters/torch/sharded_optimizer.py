"""``ShardedOptimizer``: ZeRO stage 1-2 on hvps's collectives (each rank keeps 1/N of the optimizer state).

Why this API. A Horovod user already writes ``opt = hvd.DistributedOptimizer(opt, named_parameters=...)``
around an ordinary torch optimizer, then ``hvd.broadcast_parameters`` and a plain training loop. Sharding
changes where the optimizer's state lives, not how the loop reads, so it is reached the same way:
``hvd.DistributedOptimizer(opt, named_parameters=..., shard=True)`` (which delegates to this class, once
wired into ``hvps.adapters.torch``) or
``ShardedOptimizer(opt, named_parameters=...)`` directly, with the same keyword arguments
(``compression``, ``backward_passes_per_step``, ``op``, ``gradient_predivide_factor``,
``sparse_as_dense``, ``process_set``). It is its own class, not a flag inside ``DistributedOptimizer``,
because its state, ``step()`` and ``state_dict()`` mean different things (torch's
``ZeroRedundancyOptimizer`` is also its own class); unlike torch's, it takes the optimizer the user
already built (as Horovod does), not a class and its arguments.

What it does, per step:

1. **Buckets.** At construction the parameters that require gradients are laid out, group by group in
   the optimizer's order, into flat buckets of one dtype and device (at most ``bucket_cap_mb``), each
   padded to a multiple of N. Every rank owns the same contiguous block of every bucket: rank r holds
   elements ``[r * L/N, (r+1) * L/N)`` of a bucket of padded length L. The layout is checked across
   ranks once (one allgather of each parameter's name, shape and dtype): a disagreement raises
   ``HvpsError`` naming the parameter and the ranks.
2. **Backward.** A hook on every parameter fires when its gradient has been accumulated (after
   ``backward_passes_per_step`` passes). When every gradient of a bucket is in, the bucket's gradients
   are packed into one flat buffer, compressed (fp16/bf16) and reduce-scattered asynchronously (Average by
   default), overlapping the rest of backward. The parameters' own ``.grad`` are then released (set to
   None): after backward a rank keeps only its shard of the averaged gradients (stage 2). At most
   ``REDUCE_SCATTERS_IN_FLIGHT`` buckets travel at once: starting one more first waits for the oldest, so a
   rank whose reductions lag its backward does not hold every bucket's full-size flat gradient at once.
3. **step().** Waits for the reduce-scatters and decompresses this rank's gradient shard, copies this
   rank's block of the current parameters into the shard tensors, runs a torch optimizer over the shards
   only (its momentum or Adam moments exist for 1/N of the elements; it steps each shard in chunks of
   ``STEP_CHUNK_BYTES``, cache-sized tensors as a model's parameters are, since a step over a whole 12 MiB
   shard at once runs twice as slow from memory), and all-gathers the updated shards
   back into the parameters. The parameters are the truth: they are read at every step, so
   ``hvd.broadcast_parameters`` or ``model.load_state_dict`` after wrapping is seen.

The local optimizer is built as ``type(optimizer)(shard_groups, **optimizer.defaults)`` with each of the
user's groups' hyper-parameters; the user's ``param_groups`` stay this object's ``param_groups`` (so
LR schedulers work on it) and their hyper-parameters are copied to the shard groups before each step.
Element-wise optimizers only (SGD, Adam, AdamW, RMSprop, Adagrad, ...): an optimizer whose update
couples elements of one tensor (LAMB's trust ratio, Adafactor's factored moments) would see flat shards,
not tensors. Parameters that got no gradient on any rank are stepped with a zero gradient (as
``DistributedOptimizer`` does), not skipped.

``state_dict()`` is **consolidated** and collective: every rank must call it; every rank receives torch's
ordinary format for the full model (per-parameter state keyed by parameter index, the user's
``param_groups``), loadable into the unsharded optimizer or into a ``ShardedOptimizer`` at any rank count.
``load_state_dict()`` takes that format and keeps only this rank's shard (no communication).
For checkpoints prefer ``hvd.CheckpointManager.save(epoch, model=..., optimizer=this)``: each rank then
writes only its shard (1/N of the state, in memory and on disk) plus a manifest, loadable at any rank
count or into a plain optimizer (:mod:`hvps.adapters.torch.sharded_checkpoint`, which uses
:meth:`ShardedOptimizer.shard_layout`, :meth:`ShardedOptimizer.local_state` and
:meth:`ShardedOptimizer.load_local_state`).

Tiers: ``state_tier="disk", disk_dir=path`` keeps the shards' element-wise state (Adam's moments, SGD's
momentum) in a scratch file under ``path`` that the kernel pages (:mod:`hvps.adapters.torch.state_tier`),
read ahead one bucket before its step and written behind after it, so the state may exceed the memory a rank
may hold. Flat keywords rather than DeepSpeed's ``offload_optimizer={"device": "nvme", "nvme_path": ...}``
dict: the other options here are keywords too, the store already names its tiers ``tier="disk"`` and
``disk_dir=``, any filesystem serves (not only NVMe), and DeepSpeed's buffer counts and sizes tune its own
asynchronous-I/O engine, where here the page cache does the buffering. The bucket shards (the fp32 master
copy of this rank's block) stay in memory: they are 1/N of the parameters, which every rank holds whole.
``close()`` frees the file (it has no name from its creation on, so it goes with the process anyway).

Not supported (``ValueError`` at construction): ``op=Adasum``; compressions other than none, fp16 and
bf16 (int8, top-k, DGC, PowerSGD, Horovod-style compressors); ``torch.optim.SparseAdam``; an optimizer
that already has state from a step (state its class builds at construction, as Adagrad's accumulators,
is rebuilt for the shards from the same hyper-parameters). A sparse gradient met in backward raises
``ValueError`` unless
``sparse_as_dense=True``.

Exactness: with element-wise kernels (``foreach=False``, the CPU default) the shard update computes each
element with the same operations as the unsharded optimizer, so when the averaged gradients are the same
bits the parameters are the same bits.
"""

from __future__ import annotations

import collections
import contextlib
import os
from typing import Any, Iterable, Optional, Union

import torch

import hvps
from hvps import HvpsError, ProcessSet, global_process_set
from hvps.adapters.common.options import gradient_options
from hvps.adapters.common.sharding import (REDUCE_SCATTERS_IN_FLIGHT, Signature, check_same_everywhere,
                                          sharded_op)
from hvps.compression import summable
from hvps.compression.compressors import CastCompressor, NoneCompressor
from hvps.core.flat_shards import FlatLayout
from hvps.elastic.mode import joins_a_running_job

from .compression import OPS, as_gradient_compression
from .mpi_ops import (Average, Sum, allgather_async, allreduce_async, grouped_allgather_async,
                      reducescatter_async)
from .state_tier import DiskStateTier
from .step_sync import StepSynchronization

__all__ = ["ShardedOptimizer"]

#: a bucket's default capacity, as torch DDP's
DEFAULT_BUCKET_CAP_MB = 25.0
#: buckets whose parameters' all-gather may be in flight at once in step() (one overlaps the next bucket's step)
GATHERS_IN_FLIGHT = 2
#: bytes of one tensor the local optimizer steps: a bucket's shard is stepped in chunks of this size, as the unsharded
#: optimizer steps parameter by parameter, so that an element-wise update's passes over a chunk (Adam makes ~10 over
#: its parameter, gradient and two moments) run in the cache, not in memory. Measured (2026-12-07, one thread, this
#: 2-core VM: 1 MiB L2 per core, 32 MiB L3): Adam over 6.5M float32 elements in one tensor 80 ms, in chunks of 4 MiB
#: 37 ms, of 1 MiB 31 ms, of 256 KiB 38 ms (the per-tensor overhead); two such processes at once, over one 25 MiB
#: bucket's shard at 2 ranks (3.3M elements): 130-187 ms in one tensor, 37-122 ms in 1 MiB chunks. The disk tier
#: keeps one chunk per bucket: its slots are per optimizer parameter, and a bucket's state there must stay one
#: tensor (checkpoints read it in place).
STEP_CHUNK_BYTES = 1 << 20


def _stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` holds state from a step, not only what its class builds at construction (Adagrad's
    accumulators: every parameter's ``step`` still 0), which the shard optimizer rebuilds alike."""
    for entry in optimizer.state.values():
        step = entry.get("step")
        if step is None or float(step) != 0:
            return True
    return False


class _Bucket:
    """Parameters of one group, dtype and device, flattened into one padded buffer split evenly over ranks.

    ``slices[i]`` is ``(start, numel)`` of ``params[i]`` in the flat buffer; ``pieces`` are the parts of
    this rank's block: ``(param, offset in the parameter, offset in the shard, length)``. ``shard`` is this
    rank's block of the flat parameters; ``chunks`` are the tensors the local optimizer steps, consecutive views
    of ``shard`` of at most ``chunk_numel`` elements (``bounds``: their ``[start, end)`` in it). The bucket's
    state is one tensor per element-wise key (:meth:`merged_state`), each chunk's state a view of it.
    """

    def __init__(self, index: int, group_index: int, params: list, names: list, size: int, rank: int,
                 chunk_numel: Optional[int]) -> None:
        self.index, self.group_index, self.params, self.names = index, group_index, params, names
        layout = FlatLayout(tuple(p.numel() for p in params), size)
        self.slices, self.numel, self.shard_numel, self.padded = (layout.slices, layout.numel, layout.shard_numel,
                                                                  layout.padded)
        self.pieces = [(params[i], offset, at, n) for i, offset, at, n in layout.pieces(rank)]
        ref = params[0]
        self.shard = torch.zeros(self.shard_numel, dtype=ref.dtype, device=ref.device)
        step = chunk_numel or self.shard_numel
        self.bounds = [(a, min(a + step, self.shard_numel)) for a in range(0, self.shard_numel, step)]
        self.chunks = [self.shard[a:b] for a, b in self.bounds]
        self.name = f"shard.{names[0]}.{len(params)}"
        self.ready = 0
        self.handle: Optional[hvps.Handle] = None
        self.ctx: Any = None
        #: this rank's averaged gradient block once the reduce-scatter was waited for (before step())
        self.reduced: Optional[torch.Tensor] = None
        self.dense_nbytes = 0

    def pack_gradients(self, sparse_as_dense: bool) -> torch.Tensor:
        """The bucket's gradients as one flat, padded tensor (zeros where a parameter has none); the
        parameters' ``.grad`` are released."""
        parts = []
        for p, name in zip(self.params, self.names):
            grad = p.grad
            if grad is None:
                parts.append(torch.zeros(p.numel(), dtype=p.dtype, device=p.device))
                continue
            if grad.is_sparse:
                if not sparse_as_dense:
                    raise ValueError(f"parameter {name!r} has a sparse gradient: a sharded optimizer "
                                     "reduce-scatters dense buckets; pass sparse_as_dense=True")
                grad = grad.to_dense()
            parts.append(grad.reshape(-1))
            p.grad = None
        if self.padded > self.numel:
            ref = self.params[0]
            parts.append(torch.zeros(self.padded - self.numel, dtype=ref.dtype, device=ref.device))
        return torch.cat(parts)

    def read_parameters(self) -> None:
        """Copy this rank's block of the current parameter values into ``shard``."""
        for p, p_offset, s_offset, n in self.pieces:
            self.shard[s_offset : s_offset + n].copy_(p.detach().reshape(-1)[p_offset : p_offset + n])

    def write_parameters(self, flat: torch.Tensor) -> None:
        """Install the gathered flat parameters (every rank's block) into the parameters."""
        for p, (start, n) in zip(self.params, self.slices):
            p.data.copy_(flat[start : start + n].view_as(p))

    def set_gradient(self, grad: Optional[torch.Tensor]) -> None:
        """Give the chunks their parts of this rank's gradient block (None: take them away)."""
        for chunk, (a, b) in zip(self.chunks, self.bounds):
            chunk.grad = None if grad is None else grad[a:b]

    def _span(self, key: str, state: dict) -> Optional[torch.Tensor]:
        """The chunks' values of element-wise ``key`` as one tensor of ``shard_numel`` elements, a view of their
        storage when they lie one after another in it (else a concatenation); None when ``key`` is not
        element-wise (a value not shaped like its chunk, as a step count)."""
        parts = [state.get(c, {}).get(key) for c in self.chunks]
        if not all(torch.is_tensor(v) and v.shape == c.shape for v, c in zip(parts, self.chunks)):
            return None
        first = parts[0]
        if len(parts) == 1:
            return first
        base, at = first.untyped_storage().data_ptr(), first.storage_offset()
        if all(v.untyped_storage().data_ptr() == base and v.stride() == (1,) and v.storage_offset() == at + a
               for v, (a, _) in zip(parts, self.bounds)):
            return first.as_strided((self.shard_numel,), (1,), at)
        return torch.cat(parts)

    def merged_state(self, state: dict) -> dict:
        """The bucket's state from the local optimizer's ``state`` (per chunk): ``{key: value}``, element-wise
        values as one tensor of ``shard_numel`` elements (see :meth:`_span`), others (step counts, the same in
        every chunk) as the first chunk holds them."""
        merged = {}
        for key, value in state.get(self.chunks[0], {}).items():
            span = self._span(key, state)
            merged[key] = value if span is None else span
        return merged

    def split_state(self, merged: dict) -> list:
        """Per chunk, its state from the bucket's (:meth:`merged_state`'s form): views of the element-wise tensors,
        its own copy of every other tensor (a step count, which each chunk's step advances)."""
        out = []
        for a, b in self.bounds:
            entry = {}
            for key, value in merged.items():
                if torch.is_tensor(value) and value.dim() > 0 and value.numel() == self.shard_numel:
                    entry[key] = value.reshape(-1)[a:b]
                else:
                    entry[key] = value.clone() if torch.is_tensor(value) else value
            out.append(entry)
        return out

    def knit(self, state: dict) -> None:
        """Make each element-wise state of the chunks views of one tensor (once, after the step that created it
        chunk by chunk), so that :meth:`merged_state` copies nothing."""
        if len(self.chunks) == 1:
            return
        for key in list(state.get(self.chunks[0], {})):
            span = self._span(key, state)
            if span is not None and span.untyped_storage().data_ptr() != \
                    state[self.chunks[0]][key].untyped_storage().data_ptr():  # concatenated: a new tensor
                for chunk, (a, b) in zip(self.chunks, self.bounds):
                    state[chunk][key] = span[a:b]


class ShardedOptimizer(StepSynchronization, torch.optim.Optimizer):
    """Wraps ``optimizer`` so that gradients are reduce-scattered and each rank steps 1/N of the state.

    See the module's docstring for the step, the layout and what is supported.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Optional[Iterable] = None,
                 compression: Any = None, backward_passes_per_step: int = 1, op: Any = Average,
                 gradient_predivide_factor: float = 1.0, sparse_as_dense: bool = False,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, num_groups: int = 0, groups: Any = None,
                 process_set: ProcessSet = global_process_set, state_tier: str = "host",
                 disk_dir: Optional[Union[str, os.PathLike]] = None) -> None:
        """Lay out the buckets, check the layout across ranks, and build the local optimizer.

        Args:
            optimizer: a torch optimizer over the model's parameters, not stepped yet (no state).
            named_parameters: ``model.named_parameters()``, for names in errors and collectives.
            compression: ``hvd.Compression.none`` (default), ``.fp16`` or ``.bf16``.
            backward_passes_per_step: backward passes accumulated locally before the gradients travel.
            op: ``hvd.Average`` (default) or ``hvd.Sum``.
            gradient_predivide_factor: Horovod's predivide factor (Average only).
            sparse_as_dense: densify sparse gradients instead of refusing them.
            bucket_cap_mb: largest bucket, in MiB (a parameter larger than this gets a bucket of its own).
            num_groups: ``DistributedOptimizer``'s argument, refused: buckets replace groups.
            groups: ``DistributedOptimizer``'s argument, refused: buckets replace groups.
            process_set: the ranks that share the model; this rank must belong to it.
            state_tier: where the shards' element-wise optimizer state lives: ``"host"`` (memory, the
                default) or ``"disk"`` (a scratch file under ``disk_dir``, paged by the kernel; see
                :class:`~hvps.adapters.torch.state_tier.DiskStateTier`).
            disk_dir: the directory of the disk tier (``state_tier="disk"`` only), local to each rank.

        Raises:
            ValueError: an unsupported combination (Adasum, a non-cast compression, SparseAdam, an
                optimizer with state), bad arguments, or a rank outside ``process_set``.
            HvpsError: hvps is not initialized, the parameters differ across ranks, or the disk tier's
                directory is read-only or its filesystem lacks room for the state.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"ShardedOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
        op = sharded_op(op, "a sharded optimizer")
        if isinstance(optimizer, torch.optim.SparseAdam):
            raise ValueError("SparseAdam (sparse gradients) with a sharded optimizer is not supported: "
                             "shards are dense")
        if _stepped(optimizer):
            raise ValueError("the optimizer already has state: wrap it before its first step and load "
                             "checkpoints with ShardedOptimizer.load_state_dict")
        if num_groups or groups is not None:
            raise ValueError("groups/num_groups with a sharded optimizer is not supported: gradients travel in "
                             "buckets (bucket_cap_mb)")
        if bucket_cap_mb <= 0:
            raise ValueError("bucket_cap_mb must be positive")
        if state_tier not in ("host", "disk"):
            raise ValueError(f"unknown state_tier {state_tier!r}: choose 'host' or 'disk'")
        if (state_tier == "disk") != (disk_dir is not None):
            raise ValueError("state_tier='disk' needs disk_dir=..., and disk_dir is for state_tier='disk' only")
        self._disk_dir = disk_dir
        self.state_tier: Optional[DiskStateTier] = None
        op, self.compression, prescale, postscale = gradient_options(
            op, gradient_predivide_factor, compression, as_gradient_compression,
            backward_passes_per_step=backward_passes_per_step, ops=(Average, Sum))
        if not isinstance(self.compression.compressor, (NoneCompressor, CastCompressor)):
            raise ValueError(f"compression {self.compression!r} with a sharded optimizer is not supported: "
                             "only none, fp16 and bf16 (casts that a reduce-scatter can sum)")
        hvps.size()  # HvpsError before init
        if not process_set.included():
            raise ValueError("this rank is not in the sharded optimizer's process_set")
        self.process_set = process_set
        self._size, self._rank = process_set.size(), process_set.rank()
        self._scaling = (op, prescale, postscale)
        self._plan = self._reduction_plan()
        self._sparse_as_dense = sparse_as_dense
        self.backward_passes_per_step = backward_passes_per_step

        torch.optim.Optimizer.__init__(self, optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self._names = _name_parameters([p for g in self.param_groups for p in g["params"]], named_parameters)
        if not joins_a_running_job():  # a joiner's layout is compared by the elastic state's sync
            self._check_same_parameters_everywhere()
        self._buckets = self._lay_out(int(bucket_cap_mb * 2**20))
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._local_kind, self._local_defaults = type(optimizer), optimizer.defaults
        #: buckets whose reduce-scatter started, oldest first, until waited for
        self._in_flight: collections.deque = collections.deque()
        self._build_shard_optimizer()
        self._passes_left = {p: backward_passes_per_step for p in self._bucket_of}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._bucket_of]

    # -- setup ----------------------------------------------------------------------------
    def _reduction_plan(self) -> Any:
        """How the gradients are scaled and reduced at the process set's current size."""
        op, prescale, postscale = self._scaling
        return summable.summable_plan(self.compression.compressor, op, self.process_set.size, prescale, postscale)

    def _build_shard_optimizer(self) -> None:
        """The local optimizer over the buckets' shards (no state), and each user group's shard group."""
        #: user group -> its shard group (groups without trainable parameters have none)
        self._group_pairs: list = []
        shard_groups = []
        for gi, group in enumerate(self.param_groups):
            shards = [c for b in self._buckets if b.group_index == gi for c in b.chunks]
            if shards:
                shard_groups.append({**_hyper(group), "params": shards})
                self._group_pairs.append((group, gi))
        if not shard_groups:
            raise ValueError("the optimizer has no parameter that requires a gradient")
        self.shard_optimizer = self._local_kind(shard_groups, **self._local_defaults)
        if self.state_tier is not None:  # a relayout: the old shards' state goes (never copied to memory)
            self.state_tier.close(keep_state=False)
        if self._disk_dir is not None:
            self.state_tier = DiskStateTier(self.shard_optimizer, self._disk_dir)
        self._group_pairs = [(user, shard) for (user, _), shard in zip(self._group_pairs,
                                                                        self.shard_optimizer.param_groups)]

    def world(self) -> tuple:
        """The world the buckets are laid out for.

        Returns:
            ``(size, rank)``: its number of ranks and this rank in it.
        """
        return self._size, self._rank

    def relayout(self, size: int, rank: int) -> None:
        """Lay the buckets out for a world of ``size`` ranks in which this one is ``rank`` (elastic
        re-sharding; local). The local optimizer starts with no state: install it with
        :meth:`load_local_state`. The step in progress is forgotten.

        Args:
            size: the new number of ranks.
            rank: this rank in the new world.
        """
        self.reset_step()
        self._size, self._rank = size, rank
        self._buckets = [self._bucket(b.index, b.group_index, b.params) for b in self._buckets]
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._build_shard_optimizer()
        self._plan = self._reduction_plan()

    def _check_same_parameters_everywhere(self) -> None:
        """One allgather of (name, shape, dtype) per parameter; HvpsError naming the first difference."""
        mine = [Signature(self._names[p], tuple(p.shape), str(p.dtype), p.requires_grad)
                for g in self.param_groups for p in g["params"]]
        check_same_everywhere(mine, "shard.signature", "ShardedOptimizer", "parameter",
                              "every rank must wrap the same model with the same optimizer parameter order",
                              self.process_set)

    def _lay_out(self, cap_bytes: int) -> list:
        """The buckets: consecutive trainable parameters of one group, dtype and device, up to ``cap_bytes``."""
        buckets: list = []
        for gi, group in enumerate(self.param_groups):
            current: list = []
            nbytes = 0
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if p.is_sparse:
                    raise ValueError(f"parameter {self._names[p]!r} is sparse: a sharded optimizer needs "
                                     "dense parameters")
                same_kind = not current or (p.dtype == current[0].dtype and p.device == current[0].device)
                size = p.numel() * p.element_size()
                if current and (not same_kind or nbytes + size > cap_bytes):
                    buckets.append(self._bucket(len(buckets), gi, current))
                    current, nbytes = [], 0
                current.append(p)
                nbytes += size
            if current:
                buckets.append(self._bucket(len(buckets), gi, current))
        return buckets

    def _bucket(self, index: int, group_index: int, params: list) -> _Bucket:
        chunk = None if self._disk_dir is not None else max(1, STEP_CHUNK_BYTES // params[0].element_size())
        return _Bucket(index, group_index, params, [self._names[p] for p in params], self._size, self._rank, chunk)

    # -- backward ---------------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        left = self._passes_left[p] - 1
        bucket = self._bucket_of[p]
        if left < 0:
            raise HvpsError(f"the gradient of {self._names[p]!r} was computed more than backward_passes_per_step "
                            f"({self.backward_passes_per_step}) times before step(); increase "
                            "backward_passes_per_step to accumulate gradients locally")
        self._passes_left[p] = left
        if left == 0:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._start(bucket)

    def _start(self, bucket: _Bucket) -> None:
        """Pack, compress and start reduce-scattering ``bucket``'s gradients (the oldest in flight first finishes,
        when as many travel as may: its flat gradient goes before this one's comes)."""
        if len(self._in_flight) >= REDUCE_SCATTERS_IN_FLIGHT:
            self._finish(self._in_flight.popleft())
        flat = bucket.pack_gradients(self._sparse_as_dense)
        plan = self._plan
        scaled = flat if plan.before == 1.0 else OPS.scale(flat, plan.before)
        payload, bucket.ctx = summable.compress_tensor(self.compression, scaled, OPS)
        self.compression.record(flat.nbytes, [payload])
        bucket.handle = reducescatter_async(payload, name=bucket.name, op=plan.op, prescale_factor=plan.prescale,
                                            postscale_factor=plan.postscale, process_set=self.process_set)
        self._in_flight.append(bucket)

    def _finish(self, bucket: _Bucket) -> None:
        """Wait for ``bucket``'s reduce-scatter and keep this rank's averaged block (the flat input goes)."""
        out = bucket.handle.wait()
        if bucket in self._in_flight:
            self._in_flight.remove(bucket)
        grad = summable.decompress_tensor(self.compression, out, bucket.ctx, OPS)
        if self._plan.after != 1.0:
            grad = OPS.scale(grad, self._plan.after)
        bucket.reduced = grad.to(bucket.shard.dtype).view_as(bucket.shard)
        bucket.handle, bucket.ctx = None, None

    # -- the step ---------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every bucket's reduce-scatter (starting those backward did not) and install this rank's
        averaged gradient shard as the shard tensors' ``.grad``."""
        for bucket in self._buckets:
            if bucket.handle is None and bucket.reduced is None:  # unused parameters, or still accumulating
                self._start(bucket)
        try:
            for bucket in self._buckets:
                if bucket.reduced is None:
                    self._finish(bucket)
                bucket.shard.grad = bucket.reduced
        finally:
            self._forget_step()
        hvps.step_done()
        self._synchronized = True

    def _forget_step(self) -> None:
        for bucket in self._buckets:
            bucket.handle, bucket.ctx, bucket.ready, bucket.reduced = None, None, 0, None
        self._in_flight.clear()
        for p in self._passes_left:
            self._passes_left[p] = self.backward_passes_per_step

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the averaged gradient shards so that the whole gradient's 2-norm is at most ``max_norm``.

        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` cannot do it here: after
        ``synchronize()`` the parameters' ``.grad`` are released and each rank holds only its shard. Use
        ``optimizer.synchronize(); optimizer.clip_grad_norm_(m)`` then ``with optimizer.skip_synchronize():
        optimizer.step()`` (Horovod's pattern for clipping).

        Args:
            max_norm: the largest 2-norm of the gradient over all parameters.

        Returns:
            The 2-norm before clipping (the same on every rank).

        Raises:
            HvpsError: called before ``synchronize()``.
        """
        if not self._synchronized:
            raise HvpsError("clip_grad_norm_ needs the averaged gradients: call optimizer.synchronize() first")
        squares = torch.zeros(1, dtype=torch.float64)
        for bucket in self._buckets:
            if bucket.shard.grad is not None:
                squares += bucket.shard.grad.detach().double().square().sum().cpu()
        total = allreduce_async(squares, op=Sum, name="shard.grad_norm", process_set=self.process_set).wait()
        norm = total.sqrt()[0]
        factor = max_norm / (float(norm) + 1e-6)
        if factor < 1.0:
            for bucket in self._buckets:
                if bucket.shard.grad is not None:
                    bucket.shard.grad.mul_(factor)
        return norm

    def step(self, closure=None):
        """Synchronize (unless done or skipped), step this rank's shards, all-gather the parameters.

        Args:
            closure: re-evaluates the model and returns the loss (run before the gradients are reduced).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._synchronize_for_step()
        for user_group, shard_group in self._group_pairs:
            shard_group.update(_hyper(user_group))
        # bucket by bucket: the local optimizer skips shards whose .grad is None, so stepping it with one
        # bucket's gradient at a time updates that bucket only, and its all-gather overlaps the next one's step
        grads = [bucket.shard.grad for bucket in self._buckets]
        for bucket in self._buckets:
            bucket.shard.grad = None
        # at most GATHERS_IN_FLIGHT gathered buckets exist at once: a rank never holds a second copy of
        # every parameter (the gathered flats) beside the parameters themselves
        gathers: collections.deque = collections.deque()
        tier = self.state_tier
        with torch.no_grad():
            for i, (bucket, grad) in enumerate(zip(self._buckets, grads)):
                if tier is not None and i + 1 < len(self._buckets):
                    tier.prefetch(self._buckets[i + 1].chunks)  # read ahead while this bucket steps
                bucket.read_parameters()
                if grad is not None:  # the tier's step hook writes this bucket's state behind
                    bucket.set_gradient(grad)
                    self.shard_optimizer.step()
                    bucket.set_gradient(None)
                    bucket.knit(self.shard_optimizer.state)
                gathers.append((bucket, allgather_async(bucket.shard, name=f"{bucket.name}.gather",
                                                        process_set=self.process_set)))
                if len(gathers) > GATHERS_IN_FLIGHT:
                    done, handle = gathers.popleft()
                    done.write_parameters(handle.wait())
            for bucket, handle in gathers:
                bucket.write_parameters(handle.wait())
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients; refused while reduce-scatters are in flight.

        Args:
            set_to_none: set each ``p.grad`` to ``None`` (the default, as torch's) instead of zeroing it.

        Raises:
            HvpsError: called between ``backward()`` and ``step()``.
        """
        if any(b.handle is not None or b.reduced is not None for b in self._buckets):
            raise HvpsError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                            "or optimizer.synchronize(); gradients are still being reduce-scattered")
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()
        for bucket in self._buckets:
            bucket.shard.grad = None

    # -- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The consolidated state, in torch's format for the full model (collective: every rank calls it).

        Returns:
            ``{"state": {index: {key: value}}, "param_groups": [...]}`` with parameters numbered over the
            user's groups in order, as ``optimizer.state_dict()`` of the unsharded optimizer numbers them.
        """
        shard_state = self.local_state()
        gathered_keys, tensors = [], []
        for bucket in self._buckets:
            for key, value in sorted(shard_state.get(bucket.index, {}).items()):
                if torch.is_tensor(value) and value.numel() == bucket.shard_numel and value.dim() > 0:
                    gathered_keys.append((bucket, key))
                    tensors.append(value.detach().reshape(-1))
        flats = grouped_allgather_async(tensors, name="shard.state", process_set=self.process_set).wait() \
            if tensors else []
        full = {(b.index, key): flat for (b, key), flat in zip(gathered_keys, flats)}
        index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state: dict = {}
        for bucket in self._buckets:
            for key, value in shard_state.get(bucket.index, {}).items():
                flat = full.get((bucket.index, key))
                for p, (start, n) in zip(bucket.params, bucket.slices):
                    entry = state.setdefault(index[p], {})
                    if flat is not None:
                        entry[key] = flat[start : start + n].clone().view_as(p)
                    else:
                        entry[key] = value.clone() if torch.is_tensor(value) else value
        groups = [{**_hyper(g), "params": [index[p] for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a consolidated state (from :meth:`state_dict` at any rank count, or from the unsharded
        optimizer's ``state_dict()``), keeping this rank's shard; the step in progress is forgotten.

        Args:
            state_dict: torch's optimizer format for the full model.

        Raises:
            ValueError: the groups or parameters do not match, or the parameters of one bucket carry
                different non-element-wise state (such as ``step``).
        """
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the state has {len(groups)} parameter groups, the optimizer {len(self.param_groups)}")
        params = [p for g in self.param_groups for p in g["params"]]
        if sum(len(g["params"]) for g in groups) != len(params):
            raise ValueError("the state's parameter groups do not hold as many parameters as the optimizer's")
        for mine, theirs in zip(self.param_groups, groups):
            mine.update(_hyper(theirs))
        saved = {int(k): v for k, v in state_dict["state"].items()}
        index = {p: i for i, p in enumerate(params)}
        shard_state: dict = {}
        for bucket in self._buckets:
            entries = [saved.get(index[p], {}) for p in bucket.params]
            keys = sorted({k for e in entries for k in e})
            merged: dict = {}
            for key in keys:
                values = [e.get(key) for e in entries]
                sample = next(v for v in values if v is not None)
                if torch.is_tensor(sample) and sample.dim() > 0 and all(
                        v is None or (torch.is_tensor(v) and v.numel() == p.numel())
                        for v, p in zip(values, bucket.params)):
                    # this rank's block only, piece by piece (the layout's one rule: FlatLayout.pieces)
                    of_param = {id(p): v for p, v in zip(bucket.params, values)}
                    block = torch.zeros(bucket.shard_numel, dtype=sample.dtype, device=bucket.shard.device)
                    for p, p_offset, s_offset, n in bucket.pieces:
                        if of_param[id(p)] is not None:
                            block[s_offset : s_offset + n].copy_(of_param[id(p)].reshape(-1)[p_offset : p_offset + n])
                    merged[key] = block
                else:
                    distinct = [v for v in values if v is not None]
                    if any(not _same(v, sample) for v in distinct):
                        raise ValueError(f"state {key!r} differs between parameters of one bucket ({bucket.names}): "
                                         "a sharded optimizer keeps one value per bucket")
                    merged[key] = sample.clone() if torch.is_tensor(sample) else sample
            if merged:
                shard_state[len(shard_state)] = (bucket, merged)
        self._install({bucket.index: merged for bucket, merged in shard_state.values()})

    def _install(self, by_bucket: dict) -> None:
        """Make ``by_bucket`` (bucket index -> this rank's ``{key: value}``) the local optimizer's state."""
        shard_params = [p for g in self.shard_optimizer.param_groups for p in g["params"]]
        shard_index = {p: i for i, p in enumerate(shard_params)}
        chunk_states = {}
        for b, merged in by_bucket.items():
            bucket = self._buckets[b]
            chunk_states.update((shard_index[c], entry) for c, entry in zip(bucket.chunks, bucket.split_state(merged)))
        inner = {"state": chunk_states,
                 "param_groups": [{**_hyper(user), "params": [shard_index[p] for p in shard["params"]]}
                                  for user, shard in self._group_pairs]}
        self.reset_step()
        self.shard_optimizer.load_state_dict(inner)
        self._group_pairs = [(user, shard) for (user, _), shard in zip(self._group_pairs,
                                                                        self.shard_optimizer.param_groups)]

    # -- sharded checkpoints (hvps.adapters.torch.sharded_checkpoint) -------------------------------------
    def shard_layout(self) -> dict:
        """How the parameters lie in the buckets and the buckets over the ranks (JSON-able).

        Returns:
            ``{"world_size": N, "params": [[name, shape, dtype, requires_grad], ...], "buckets": [{"group": g,
            "numel": L, "shard_numel": s, "params": [[parameter index, start, numel], ...]}, ...]}``;
            parameters are numbered over the user's groups in order, as torch's ``state_dict()`` numbers them.
        """
        params = [p for g in self.param_groups for p in g["params"]]
        index = {p: i for i, p in enumerate(params)}
        return {"world_size": self._size,
                "params": [[self._names[p], list(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad]
                           for p in params],
                "buckets": [{"group": b.group_index, "numel": b.numel, "shard_numel": b.shard_numel,
                             "params": [[index[p], start, n] for p, (start, n) in zip(b.params, b.slices)]}
                            for b in self._buckets]}

    def local_state(self) -> dict:
        """This rank's shard of the optimizer state, not copied.

        Returns:
            ``{bucket index: {key: value}}``; element-wise state is a 1-D tensor of the bucket's ``shard_numel``
            elements (once stepped, the chunks' states are views of it), anything else (a step count) as the
            local optimizer keeps it for the bucket's first chunk.
        """
        state = self.shard_optimizer.state
        return {b.index: b.merged_state(state) for b in self._buckets if b.chunks[0] in state}

    def load_local_state(self, by_bucket: dict, param_groups: list) -> None:
        """Install this rank's shard of a state (no communication); the step in progress is forgotten.

        Args:
            by_bucket: ``{bucket index: {key: value}}`` in :meth:`local_state`'s form, for this optimizer's
                buckets (element-wise tensors of ``shard_numel`` elements).
            param_groups: the saved groups (hyper-parameters are taken from them).

        Raises:
            ValueError: the groups do not match, or a bucket index or tensor size is wrong.
        """
        if len(param_groups) != len(self.param_groups):
            raise ValueError(f"the state has {len(param_groups)} parameter groups, the optimizer "
                             f"{len(self.param_groups)}")
        for b, entry in by_bucket.items():
            if not 0 <= b < len(self._buckets):
                raise ValueError(f"no bucket {b}")
            for key, value in entry.items():
                if torch.is_tensor(value) and value.dim() > 0 and value.numel() != self._buckets[b].shard_numel:
                    raise ValueError(f"state {key!r} of bucket {b} has {value.numel()} elements, the shard "
                                     f"{self._buckets[b].shard_numel}")
        for mine, theirs in zip(self.param_groups, param_groups):
            mine.update(_hyper(theirs))
        device = {b.index: b.shard.device for b in self._buckets}
        self._install({b: {k: v.to(device[b]) if torch.is_tensor(v) and v.dim() > 0 else v for k, v in entry.items()}
                       for b, entry in by_bucket.items()})

    def reset_step(self) -> None:
        """Forget the step in progress (handles not waited for, countdowns full again)."""
        for bucket in self._buckets:
            if bucket.handle is not None and bucket.handle.poll():
                with contextlib.suppress(Exception):
                    bucket.handle.wait()
        self._forget_step()
        self._synchronized = False

    def add_param_group(self, param_group: dict) -> None:
        """Refused after construction: the layout is fixed (Optimizer.__init__'s own calls pass).

        Args:
            param_group: the group torch's ``Optimizer.__init__`` adds.

        Raises:
            ValueError: called on a constructed ShardedOptimizer.
        """
        if hasattr(self, "shard_optimizer"):
            raise ValueError("a ShardedOptimizer's parameter layout is fixed: add the group to the optimizer "
                             "before wrapping it")
        torch.optim.Optimizer.add_param_group(self, param_group)

    def close(self) -> None:
        """Give the disk tier's file back (its state moves to memory first); nothing to do with the host tier."""
        if self.state_tier is not None:
            self.state_tier.close()
            self.state_tier = None
            self._disk_dir = None

    def __repr__(self) -> str:
        return f"ShardedOptimizer({self.shard_optimizer!r}, shards={self._size}, buckets={len(self._buckets)})"


def _hyper(group: dict) -> dict:
    """A parameter group's hyper-parameters (everything but ``params``)."""
    return {k: v for k, v in group.items() if k != "params"}


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a.cpu(), b.cpu())
    return a == b


def _name_parameters(params: list, named_parameters: Optional[Iterable]) -> dict:
    """Parameter -> name (``param.<i>`` without ``named_parameters``)."""
    if named_parameters is None:
        return {p: f"param.{i}" for i, p in enumerate(params)}
    names = {}
    for item in named_parameters:
        if not isinstance(item, tuple):
            raise ValueError("named_parameters should be (name, parameter) tuples, as model.named_parameters() gives")
        name, p = item
        names.setdefault(p, name)
    missing = [i for i, p in enumerate(params) if p not in names]
    if missing:
        raise ValueError(f"named_parameters does not name {len(missing)} optimizer parameters (indices "
                         f"{missing[:5]}); pass model.named_parameters() of the optimized model")
    return {p: names[p] for p in params}
