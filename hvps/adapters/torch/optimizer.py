"""``DistributedOptimizer``: averages gradients over ranks while backward still runs.

A hook on every parameter fires once its gradient has been accumulated and
starts an asynchronous allreduce, so communication overlaps the rest of the
backward pass; ``step()`` waits for the outstanding handles and then steps the
wrapped optimizer.

A dense gradient's path from its hook to ``Engine.submit_all`` is four Python
frames (the hook, ``_start``, ``allreduce_gradients_async``, ``submit_all``), with
one dtype check, one handle and one finisher (:class:`_Install`); the compression
and its scaling plan are resolved once, in ``__init__``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Optional

import torch

import hvps
from hvps import HvpsError, ProcessSet, global_process_set
from hvps import metrics as _metrics
from hvps.adapters.common.controls import CompressionControls
from hvps.adapters.common.options import gradient_options
from hvps.api.collectives import allreduce_gradients_async
from hvps.compression import summable
from hvps.core.views import as_tensor

from .compression import OPS, as_gradient_compression
from .mpi_ops import Adasum, Average, Sum, grouped_allreduce_async_, sparse_allreduce_handle
from .tensors import core_view, host_buffer, to_numpy


class DistributedOptimizer(CompressionControls, torch.optim.Optimizer):
    """Wraps ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    The result is an instance of ``type(optimizer)`` too (a subclass made for it, named like
    it), as Horovod's is. It shares ``param_groups`` and ``state`` with the wrapped optimizer,
    so LR schedulers and checkpoints see one optimizer, and ``state_dict()`` is the wrapped
    optimizer's own.

    With ``process_set``, gradients are averaged over that set's ranks; on ranks outside it
    the optimizer steps on local gradients. With ``op=Adasum`` (Horovod's delta optimizer),
    each rank steps locally and the parameter updates are combined by Adasum.

    ``gradient_predivide_factor`` f scales gradients by 1/f before the sum and by f/size after
    (Horovod's overflow guard for fp16 sums). With int8, top-k or DGC compression the values
    travel compressed and are averaged after decompression, so f would cancel out and is not applied.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "DistributedOptimizer":
        if cls is not DistributedOptimizer:  # already the subclass (copies, pickles)
            return super().__new__(cls)
        optimizer = args[0] if args else kwargs.get("optimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
        return super().__new__(_wrapper_class(type(optimizer)))

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Optional[Iterable] = None,
                 compression: Any = None, backward_passes_per_step: int = 1, op=Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                 sparse_as_dense: bool = False, process_set: ProcessSet = global_process_set) -> None:
        if num_groups and groups is None:  # Horovod's deprecated spelling of groups=<int>
            groups = num_groups
        # Adasum reduces parameter updates, uncompressed: any compression is accepted with it
        op, self.compression, prescale, postscale = gradient_options(
            op, gradient_predivide_factor, compression, as_gradient_compression,
            backward_passes_per_step=backward_passes_per_step, ops=(Average, Sum, Adasum),
            compressed_ops=(Average, Sum, Adasum))
        hvps.size()  # raises HvpsError before init
        torch.optim.Optimizer.__init__(self, optimizer.param_groups, optimizer.defaults)
        self._inner = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.process_set = process_set
        if process_set is not global_process_set and not self.compression.summable:
            raise ValueError(f"process sets need a summable compression (none, fp16, bf16), not {self.compression!r}")
        if groups is not None and not self.compression.summable:
            raise ValueError(f"groups needs a summable compression (none, fp16, bf16), not {self.compression!r}")
        self._op = op
        #: summable compressions: the scaling around the fused allreduce (the predivide factor's
        #: prescale and postscale, the casts' overflow guard), planned once
        self._plan = summable.summable_plan(self.compression.compressor, op, process_set.size, prescale, postscale)
        self._summable = self.compression.summable
        self._sparse_as_dense = sparse_as_dense
        #: parameters whose sparse gradient travels dense this step (made sparse again once reduced)
        self._densified: set = set()
        self.backward_passes_per_step = backward_passes_per_step
        #: parameter -> its name (Horovod's attribute name)
        self._parameter_names = self._name_parameters(named_parameters)
        self.compression.prepare({f"grad.{n}": tuple(p.shape) for p, n in self._parameter_names.items()})
        self._groups = self._group_map(groups)
        self._delay: dict = {}
        self._handles: dict = {}
        self._group_ready: dict = {}
        self._hooks: list = []
        self._synchronized = False
        self._should_synchronize = True
        #: whether this rank takes part (not: it steps on its local gradients, as Horovod)
        self._included = process_set is global_process_set or process_set.included()
        for p in self._params():
            self._delay[p] = backward_passes_per_step
            if p.requires_grad and self._communicates:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    # -- setup --------------------------------------------------------------------
    def _params(self) -> list:
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def _communicates(self) -> bool:
        """Whether gradients are reduced as backward runs (not outside the set, not for Adasum's deltas)."""
        return self._included and self._op is not Adasum

    def _name_parameters(self, named_parameters: Optional[Iterable]) -> dict:
        params = self._params()
        if named_parameters is None:
            return {p: f"param.{i}" for i, p in enumerate(params)}
        named = list(named_parameters)
        if named and not isinstance(named[0], tuple):
            raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, as "
                             "model.named_parameters() gives")
        names = {}
        for name, p in named:
            if p in names:
                raise ValueError(f"parameter {name!r} appears twice in named_parameters")
            names[p] = name
        missing = [i for i, p in enumerate(params) if p not in names]
        if missing:
            raise ValueError(f"named_parameters does not name {len(missing)} optimizer parameters "
                             f"(indices {missing[:5]}...); pass model.named_parameters() of the optimized model")
        if len(set(names.values())) != len(names):
            raise ValueError("parameter names in named_parameters must be unique")
        return names

    def _group_map(self, groups: Any) -> dict:
        """Parameter -> its group (a tuple of parameters reduced together), from ``groups``."""
        if groups is None:
            return {}
        params = [p for p in self._params() if p.requires_grad]
        if isinstance(groups, int):
            if groups < 1:
                raise ValueError("groups must be a positive int or a list of lists of parameters")
            size = -(-len(params) // groups)
            partition = [tuple(params[i : i + size]) for i in range(0, len(params), size)]
        else:
            partition = [tuple(group) for group in groups]
        mapping = {}
        for group in partition:
            for p in group:
                mapping[p] = group
        return mapping

    # -- the backward hook --------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        delay = self._delay[p] - 1
        if delay < 0 and self._handles.get(p) is not None:
            raise HvpsError(
                "gradients were computed more than backward_passes_per_step times before step(); "
                "increase backward_passes_per_step to accumulate gradients locally"
            )
        self._delay[p] = delay
        if delay == 0:
            self._start(p)
        else:
            self._handles.setdefault(p, None)

    def _start(self, p: torch.Tensor) -> None:
        """Start reducing ``p``'s gradient, or its group's once every member is ready."""
        group = self._groups.get(p) if self._groups else None
        if group is None:
            members, name = (p,), f"grad.{self._parameter_names[p]}"
        else:
            ready = self._group_ready.setdefault(group, set())
            ready.add(p)
            self._handles[p] = None
            if len(ready) < len(group):
                return
            del self._group_ready[group]
            first = self._parameter_names[group[0]]
            members, name = group, (f"grad.{first}" if len(group) == 1 else f"grad.group.{first}.{len(group)}")
        install = _Install(self, members)
        if install.views is None:  # sparse, int8/top-k/DGC, or a group of several dtypes
            handle = self._start_unfused(members, install, name)
        else:
            plan = self._plan
            handle = allreduce_gradients_async(install.views, install.dtype, name, plan.op, plan.prescale,
                                               plan.postscale, self.process_set, install.ready).finish_with(install)
        if group is None:
            self._handles[p] = handle
            return
        for member in group:
            self._handles[member] = handle

    def _start_unfused(self, members: tuple, install: "_Install", name: str) -> hvps.Handle:
        """The paths besides one fused allreduce: sparse gradients (allgathered), numpy compressors
        (int8, top-k, DGC) and groups whose gradients have different dtypes or devices."""
        p, grad = members[0], install.grads[0]
        if grad.is_sparse:  # sparse_allreduce_handle averages
            return sparse_allreduce_handle(grad, name, self._op, self.process_set).then(
                lambda reduced: setattr(p, "grad", reduced.coalesce()))
        if not self.compression.summable:
            # int8, top-k, DGC: numpy compressors exchange float32 values and average after
            # decompressing, so a predivide factor would cancel out: none is applied.
            buffer = host_buffer(grad)
            return self.compression.start(to_numpy(buffer), name, self._op).then(
                lambda result: _install(p, as_tensor(result).view(buffer.shape)))
        plan = self._plan
        return grouped_allreduce_async_(install.payloads, name=name, op=plan.op, prescale_factor=plan.prescale,
                                        postscale_factor=plan.postscale, process_set=self.process_set).then(install)

    def _prepare_grad(self, p: torch.Tensor) -> torch.Tensor:
        if p.grad is None:  # not used this step on this rank; other ranks may have a gradient
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse and self._sparse_as_dense:
            p.grad = p.grad.to_dense()
            self._densified.add(p)
        return p.grad

    # -- synchronisation ---------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every gradient's allreduce (starting any not yet started) and install the averages."""
        _metrics.on_sync_start()
        if not self._communicates:
            self._synchronized = True
            return
        for p in self._params():  # start what backward did not: unused or still-accumulating gradients
            if p.requires_grad and self._handles.get(p) is None:
                self._start(p)
        try:
            for handle in self._handles.values():  # a group's members share one handle: it installs once
                handle.wait()
            for p in self._densified:  # the optimizer expects the layout its gradients had (SparseAdam)
                p.grad = p.grad.to_sparse()
        finally:
            self._densified.clear()
            self._handles.clear()
            self._group_ready.clear()
            for p in self._delay:
                self._delay[p] = self.backward_passes_per_step
        _metrics.on_sync_end(self.compression)
        hvps.step_done()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside, ``step()`` does not synchronize: call ``synchronize()`` yourself first."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Synchronize gradients (unless already done or skipped), then step the wrapped optimizer."""
        _metrics.on_step()
        if self._should_synchronize:
            if self._synchronized:
                import warnings

                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() after optimizer.synchronize(); "
                    "gradients are reduced once only",
                    stacklevel=2,
                )
            else:
                self.synchronize()
        self._synchronized = False
        if self._op is Adasum and self._included:
            return self._adasum_step(closure)
        return self._inner.step(closure)

    def _adasum_step(self, closure=None):
        """Step locally, then replace every parameter's update by the Adasum of all ranks' updates."""
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients; refused while allreduces are in flight (their results would be lost)."""
        if any(h is not None for h in self._handles.values()):
            raise HvpsError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(); gradients are still being reduced"
            )
        self._inner.zero_grad(set_to_none=set_to_none)

    # -- delegate state to the wrapped optimizer -------------------------------------
    def state_dict(self) -> dict:
        """The wrapped optimizer's ``state_dict()`` (torch's integer keys, nothing of the wrapper's)."""
        return self._inner.state_dict()

    def reset_step(self) -> None:
        """Forget the step in progress, so that the next ``backward()`` starts a fresh one.

        What a step keeps between its first gradient hook and the end of ``step()`` goes: the handles
        of gradients in flight (not waited for: after an elastic reset they belong to a shut-down
        engine, which has failed them), every ``backward_passes_per_step`` countdown (full again),
        groups partly ready, gradients densified this step and the "already synchronized" flag (the
        next ``step()`` synchronizes). The gradients themselves stay, as in Horovod (some may be
        averaged already, others not): ``zero_grad()``, which a step starts with, clears them.
        ``skip_synchronize()``'s flag is its context manager's to restore, and the compression's
        error feedback is state that ``hvd.elastic.TorchState`` commits and restores with the
        optimizer. ``load_state_dict`` calls this (as Horovod's does), so an elastic ``restore()``
        leaves the optimizer ready for the next step, wherever the failure interrupted the last one.

        Call it between steps or after a failed collective: collectives that are still running on a
        healthy engine keep their names in use until they finish.
        """
        full = self.backward_passes_per_step
        for handle in self._handles.values():  # claim the finished ones: their names are free again
            if handle is not None and handle.poll():
                try:
                    handle.wait()
                except Exception:  # noqa: BLE001 - the failure that ended the step, reported where it happened
                    pass
        self._handles.clear()
        self._group_ready.clear()
        self._densified.clear()
        for p in self._delay:
            self._delay[p] = full
        self._synchronized = False

    def load_state_dict(self, state_dict: dict) -> None:
        """Load into the wrapped optimizer and share its new groups and state again; the step in
        progress, if any, is forgotten (:meth:`reset_step`)."""
        self.reset_step()
        self._inner.load_state_dict(state_dict)
        self.param_groups = self._inner.param_groups
        self.state = self._inner.state

    def add_param_group(self, param_group: dict) -> None:
        """Add ``param_group`` to the wrapped optimizer, with hooks on its parameters."""
        if not hasattr(self, "_inner"):  # called by Optimizer.__init__ for the shared groups
            return torch.optim.Optimizer.add_param_group(self, param_group)
        self._inner.add_param_group(param_group)
        for p in param_group["params"] if isinstance(param_group["params"], list) else [param_group["params"]]:
            self._parameter_names.setdefault(p, f"param.{len(self._parameter_names)}")
            self._delay[p] = self.backward_passes_per_step
            if p.requires_grad and self._communicates:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._inner!r})"


def _install(p: torch.Tensor, grad: torch.Tensor) -> None:
    """Make ``p.grad`` hold ``grad``'s values (nothing to do when they are the same memory)."""
    if grad.data_ptr() != p.grad.data_ptr() or grad.device != p.grad.device:
        p.grad.copy_(grad)


class _Install:
    """A gradient's (or a group's) one finisher: prepared in the hook, run by the handle's ``wait()``.

    In the hook it takes the members' gradients (``_prepare_grad``) and, for a summable
    compression, scales and compresses them (``payloads``) and finds what the core moves for
    each (``views``, sharing the payloads' memory or staged on the host) and their dtype, checked
    once. ``views`` stays None where one fused allreduce cannot take them (sparse, non-summable,
    dtypes or devices that differ). Called with the collective's result, it counts the exchange
    in the compression's stats, copies staged values back, decompresses, scales and installs
    every member's gradient.
    """

    __slots__ = ("members", "grads", "payloads", "ctxs", "buffers", "views", "dtype", "pipeline", "after", "ready")

    def __init__(self, opt: DistributedOptimizer, members: tuple) -> None:
        self.members = members
        self.views = None
        pipeline = self.pipeline = opt.compression
        before = opt._plan.before
        self.after = opt._plan.after
        grads, payloads, ctxs, views, buffers, kinds = [], [], [], [], [], set()
        #: CUDA gradients staged to the host (non-CUDA-aware planes) are copied asynchronously; the engine
        #: waits for these events, autograd's thread does not (issue 43, finding 6)
        self.ready: list = []
        for p in members:
            grad = opt._prepare_grad(p)
            grads.append(grad)
            if grad.is_sparse or not opt._summable:
                continue
            payload, ctx = summable.compress_tensor(pipeline, grad if before == 1.0 else OPS.scale(grad, before), OPS)
            view, buffer, dtype = core_view(payload, self.ready)
            payloads.append(payload)
            ctxs.append(ctx)
            views.append(view)
            buffers.append(buffer)
            kinds.add((dtype, buffer.device))
        self.grads, self.payloads, self.ctxs, self.buffers = grads, payloads, ctxs, buffers
        if len(payloads) < len(members):  # sparse, or a numpy compressor (int8, top-k, DGC)
            if len(members) > 1:
                raise ValueError("groups cannot reduce sparse gradients: pass sparse_as_dense=True")
            return
        if len(kinds) == 1:
            self.views, self.dtype = views, kinds.pop()[0]

    def __call__(self, _result: Any) -> None:
        self.pipeline.record(sum(g.nbytes for g in self.grads), self.payloads)
        staged = self.views is not None
        for i, member in enumerate(self.members):
            payload = self.payloads[i]
            if staged:  # the core reduced the view in place: staged copies go back first
                buffer = self.buffers[i]
                if buffer.data_ptr() != payload.data_ptr() or buffer.device != payload.device:
                    payload.copy_(buffer, non_blocking=True)  # from pinned memory: the host does not wait
            grad = summable.decompress_tensor(self.pipeline, payload, self.ctxs[i], OPS)
            _install(member, grad if self.after == 1.0 else OPS.scale(grad, self.after))


#: wrapped optimizer class -> its DistributedOptimizer subclass
_WRAPPER_CLASSES: dict = {}


def _wrapper_class(base: type) -> type:
    """The class of ``DistributedOptimizer(optimizer)`` for an optimizer of class ``base``: a subclass of
    both, named like ``base`` (as Horovod names it), so that ``isinstance(opt, base)`` holds."""
    if issubclass(base, DistributedOptimizer):
        return base
    cls = _WRAPPER_CLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (DistributedOptimizer, base),
                   {"__module__": DistributedOptimizer.__module__, "__doc__": DistributedOptimizer.__doc__,
                    "__qualname__": f"DistributedOptimizer[{base.__qualname__}]"})
        _WRAPPER_CLASSES[base] = cls
    return cls
