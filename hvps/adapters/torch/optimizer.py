"""The gradient allreduce kind of ``DistributedOptimizer`` (op Average or Sum): averages gradients
over ranks while backward still runs.

A hook on every parameter fires once its gradient has been accumulated and
starts an asynchronous allreduce, so communication overlaps the rest of the
backward pass; ``step()`` waits for the outstanding handles and then steps the
wrapped optimizer.

A dense gradient's path from its hook to ``Engine.submit_all`` is four Python
frames (the hook, ``_start``, ``allreduce_gradients_async``, ``submit_all``), with
one dtype check, one handle and one finisher (:class:`_Install`); the compression
and its scaling plan are resolved once, in ``__init__``.  The public class, the factory
and what this kind shares with the Adasum kind are in :mod:`.optimizer_base`.
"""

from __future__ import annotations

from typing import Any

import torch

import hvps
from hvps import HvpsError
from hvps import metrics as _metrics
from hvps.api.collectives import allreduce_gradients_async
from hvps.compression import summable
from hvps.core.views import as_tensor

from .compression import OPS
from .mpi_ops import Average, Sum, grouped_allreduce_async_, sparse_allreduce_handle
from .optimizer_base import DistributedOptimizer, _group_params
from .tensors import core_view, host_buffer, to_numpy


class GradientAllreduceOptimizer(DistributedOptimizer, reduces=(Average, Sum)):
    """The ``DistributedOptimizer`` for Average and Sum: each gradient's allreduce starts from a hook
    as soon as backward has accumulated it; ``step()`` waits for them, installs the averages and
    steps the wrapped optimizer (see :class:`DistributedOptimizer` for the arguments)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Check the arguments (:class:`DistributedOptimizer`), plan the reduction and hook every
        parameter that takes part.

        Args:
            args: as :class:`DistributedOptimizer`.
            kwargs: as :class:`DistributedOptimizer`.
        """
        super().__init__(*args, **kwargs)
        #: summable compressions: the scaling around the fused allreduce (the predivide factor's
        #: prescale and postscale, the casts' overflow guard), planned once
        self._plan = summable.summable_plan(self.compression.compressor, self._op, self.process_set.size,
                                            self._prescale, self._postscale)
        self._summable = self.compression.summable
        #: parameters whose sparse gradient travels dense this step (made sparse again once reduced)
        self._densified: set = set()
        self._delay: dict = {}
        self._handles: dict = {}
        self._group_ready: dict = {}
        self._hooks: list = []
        for p in self._params():
            self._hook(p)

    def _hook(self, p: torch.Tensor) -> None:
        """Start ``p``'s countdown and, where this rank takes part, hook its gradient."""
        self._delay[p] = self.backward_passes_per_step
        if p.requires_grad and self._included:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

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
            # bucketed: it may wait for the next gradients, to travel with them (synchronize() sends it)
            handle = allreduce_gradients_async(install.views, install.dtype, name, plan.op, plan.prescale,
                                               plan.postscale, self.process_set, install.ready,
                                               bucketed=True).finish_with(install)
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
        if not self._included:  # outside the process set: local gradients
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

    def _update(self, closure: Any = None) -> Any:
        return self._inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients; refused while allreduces are in flight (their results would be lost)."""
        if any(h is not None for h in self._handles.values()):
            raise HvpsError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(); gradients are still being reduced"
            )
        self._inner.zero_grad(set_to_none=set_to_none)

    # -- the step in progress ---------------------------------------------------------
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
        super().reset_step()

    def add_param_group(self, param_group: dict) -> None:
        """Add ``param_group`` to the wrapped optimizer, with hooks on its parameters."""
        if not hasattr(self, "_inner"):  # called by Optimizer.__init__ for the shared groups
            return torch.optim.Optimizer.add_param_group(self, param_group)
        super().add_param_group(param_group)
        for p in _group_params(param_group):
            self._hook(p)


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

    def __init__(self, opt: GradientAllreduceOptimizer, members: tuple) -> None:
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


__all__ = ["DistributedOptimizer", "GradientAllreduceOptimizer"]
