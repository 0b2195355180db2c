"""``DistributedOptimizer``: the public wrapper class, what its two kinds share, and the factory.

``hvd.DistributedOptimizer(optimizer, ..., op=...)`` returns one of two kinds, as Horovod's
factory does: for Average and Sum the gradient allreduce optimizer
(:mod:`hvps.adapters.torch.optimizer`), which reduces gradients while backward still runs; for
Adasum the delta optimizer (:mod:`hvps.adapters.torch.adasum_optimizer`), which steps locally and
combines the parameter updates.  Both are subclasses of :class:`DistributedOptimizer`, which holds
what they share: the checks of the arguments, the wrapped optimizer (whose ``param_groups`` and
``state`` are shared), the parameter names, ``step()``'s order (synchronize, then update),
``skip_synchronize()`` and the state delegation.

The object returned is an instance of ``type(optimizer)`` too (a subclass made for the pair and
cached, named like the wrapped class, as Horovod's is), so ``isinstance(opt, torch.optim.SGD)``
and ``isinstance(opt, hvd.DistributedOptimizer)`` both hold.
"""

from __future__ import annotations

from typing import Any, ClassVar, Iterable, Optional

import torch

import hvps
from hvps import ProcessSet, ReduceOp, global_process_set
from hvps import metrics as _metrics
from hvps.adapters.common.controls import CompressionControls
from hvps.adapters.common.ops import resolve_op
from hvps.adapters.common.options import gradient_options

from .compression import as_gradient_compression
from .mpi_ops import Adasum, Average, Sum
from .step_sync import StepSynchronization

#: the op (resolved) -> the kind of DistributedOptimizer that reduces with it; each kind registers
#: itself with ``reduces=`` in its class statement
_KINDS: dict = {}


class DistributedOptimizer(CompressionControls, StepSynchronization, torch.optim.Optimizer):
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

    #: the wrapped optimizer's class, in the classes made for a (kind, wrapped class) pair
    _wraps: ClassVar[Optional[type]] = None
    #: how the classes made for a wrapped class are qualified: ``DistributedOptimizer[SGD]``
    _qualname_prefix: ClassVar[str] = "DistributedOptimizer"

    def __init_subclass__(cls, reduces: tuple = (), **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for op in reduces:
            _KINDS[op] = cls

    def __new__(cls, *args: Any, **kwargs: Any) -> "DistributedOptimizer":
        if cls._wraps is not None:  # already the class made for the pair (copies, pickles)
            return super().__new__(cls)
        if kwargs.get("shard"):  # not an instance of cls: Python then skips DistributedOptimizer.__init__
            from .sharded_optimizer import ShardedOptimizer

            return ShardedOptimizer(*args, **{k: v for k, v in kwargs.items() if k != "shard"})
        optimizer = args[0] if args else kwargs.get("optimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
        kind = cls if cls is not DistributedOptimizer else _kind_for(args[4] if len(args) > 4 else
                                                                    kwargs.get("op", Average))
        return super().__new__(_wrapper_class(kind, type(optimizer)))

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Optional[Iterable] = None,
                 compression: Any = None, backward_passes_per_step: int = 1, op: Any = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                 sparse_as_dense: bool = False, process_set: ProcessSet = global_process_set, *,
                 shard: bool = False) -> None:
        """Check the arguments and share the wrapped optimizer's groups and state.

        Args:
            optimizer: the ``torch.optim.Optimizer`` to wrap.
            named_parameters: ``model.named_parameters()``, naming every parameter of ``optimizer``.
            compression: ``hvd.Compression.none`` / ``fp16`` / ``bf16``, or a GradientCompression.
            backward_passes_per_step: backward passes accumulated locally per step.
            op: Average, Sum or Adasum.
            gradient_predivide_factor: scale by 1/f before the sum, f/size after (Average only).
            num_groups: Horovod's deprecated spelling of ``groups=<int>``.
            groups: an int (that many groups) or lists of parameters reduced together.
            sparse_as_dense: reduce sparse gradients as dense tensors.
            process_set: the ranks that reduce together.
            shard: ``True`` returns a :class:`~hvps.adapters.torch.sharded_optimizer.ShardedOptimizer` instead
                (ZeRO stage 1-2: each rank keeps and steps 1/N of the optimizer state), with these arguments and
                any of its own (``state_tier="disk", disk_dir=...``: the disk tier).

        Raises:
            HvpsError: before ``hvps.init()``.
            TypeError: when ``optimizer`` or ``compression`` is of the wrong kind.
            ValueError: for an invalid combination of arguments.
        """
        if num_groups and groups is None:  # Horovod's deprecated spelling of groups=<int>
            groups = num_groups
        # Adasum reduces parameter updates, uncompressed: any compression is accepted with it
        op, self.compression, self._prescale, self._postscale = gradient_options(
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
        self.backward_passes_per_step = backward_passes_per_step
        #: parameter -> its name (Horovod's attribute name)
        self._parameter_names = self._name_parameters(named_parameters)
        self.compression.prepare({f"grad.{n}": tuple(p.shape) for p, n in self._parameter_names.items()})
        self._groups = self._group_map(groups)
        self._sparse_as_dense = sparse_as_dense
        #: whether this rank takes part (not: it steps on its local gradients, as Horovod)
        self._included = process_set is global_process_set or process_set.included()

    # -- setup --------------------------------------------------------------------
    def _params(self) -> list:
        return [p for group in self.param_groups for p in group["params"]]

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

    # -- what each kind does ------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish this step's communication of gradients (each kind says what that is).

        Raises:
            HvpsError: a gradient's collective failed (on every rank that submitted it).
        """
        raise NotImplementedError

    def _update(self, closure: Any = None) -> Any:
        """Apply this step's update to the parameters; returns the wrapped optimizer's loss."""
        raise NotImplementedError

    # -- the step -------------------------------------------------------------------------
    def step(self, closure=None):
        """Synchronize gradients (unless already done or skipped), then step the wrapped optimizer.

        Args:
            closure: re-evaluates the model and returns the loss, passed to the wrapped optimizer.

        Returns:
            What the wrapped optimizer's ``step`` returns (the loss with a closure).

        Raises:
            HvpsError: the gradients' collectives failed.
        """
        _metrics.on_step()
        self._synchronize_for_step()
        return self._update(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the wrapped optimizer's gradients.

        Args:
            set_to_none: set each ``p.grad`` to ``None`` (the default, as torch's) instead of zeroing it.
        """
        self._inner.zero_grad(set_to_none=set_to_none)

    # -- delegate state to the wrapped optimizer -------------------------------------
    def state_dict(self) -> dict:
        """The wrapped optimizer's state.

        Returns:
            The wrapped optimizer's ``state_dict()`` (torch's integer keys, nothing of the wrapper's).
        """
        return self._inner.state_dict()

    def reset_step(self) -> None:
        """Forget the step in progress: the next ``step()`` synchronizes again."""
        self._synchronized = False

    def load_state_dict(self, state_dict: dict) -> None:
        """Load into the wrapped optimizer and share its new groups and state again; the step in
        progress, if any, is forgotten (:meth:`reset_step`).

        Args:
            state_dict: a ``state_dict()`` of this optimizer or of the plain optimizer it wraps.
        """
        self.reset_step()
        self._inner.load_state_dict(state_dict)
        self.param_groups = self._inner.param_groups
        self.state = self._inner.state

    def add_param_group(self, param_group: dict) -> None:
        """Add ``param_group`` to the wrapped optimizer and name its parameters.

        Args:
            param_group: a torch parameter group (``{"params": [...], "lr": ...}``).
        """
        if not hasattr(self, "_inner"):  # called by Optimizer.__init__ for the shared groups
            return torch.optim.Optimizer.add_param_group(self, param_group)
        self._inner.add_param_group(param_group)
        for p in _group_params(param_group):
            self._parameter_names.setdefault(p, f"param.{len(self._parameter_names)}")

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._inner!r})"


def _group_params(param_group: dict) -> list:
    """The parameters of a param group as ``add_param_group`` received them."""
    params = param_group["params"]
    return params if isinstance(params, list) else [params]


def _kind_for(op: Any) -> type:
    """The kind of DistributedOptimizer for ``op``; an op that names none gets the allreduce kind,
    whose checks then raise the ValueError that says so."""
    try:
        resolved = resolve_op(None, op)
    except ValueError:
        resolved = ReduceOp.Average
    return _KINDS.get(resolved, _KINDS[ReduceOp.Average])


#: (kind, wrapped optimizer class) -> the class of the DistributedOptimizer made for them
_WRAPPER_CLASSES: dict = {}


def _wrapper_class(kind: type, base: type) -> type:
    """The class of a ``kind`` wrapping an optimizer of class ``base``: a subclass of both, named like
    ``base`` (as Horovod names it), so that ``isinstance(opt, base)`` holds."""
    if issubclass(base, DistributedOptimizer):
        return base
    cls = _WRAPPER_CLASSES.get((kind, base))
    if cls is None:
        cls = type(base.__name__, (kind, base),
                   {"__module__": kind.__module__, "__doc__": DistributedOptimizer.__doc__, "_wraps": base,
                    "__qualname__": f"{kind._qualname_prefix}[{base.__qualname__}]"})
        _WRAPPER_CLASSES[(kind, base)] = cls
    return cls


__all__ = ["DistributedOptimizer"]
