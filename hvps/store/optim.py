"""Row-wise sparse optimizers, applied by a row's owner to the rows a step touched.

Each optimizer keeps its per-row state in the row's record, after the embedding
(``state_width`` values per embedding value), so the state is created with the row, cached
with it and checkpointed with it, and only touched rows are updated (lazily, as TorchRec's
fused row-wise optimizers and ``torch.optim.SparseAdam`` do).  The update arithmetic
follows ``torch.optim`` step for step: SGD and Adagrad give the same bits as the dense
``torch.optim`` versions on an untouched row's zero gradient (which leaves the row as it
is), Adam matches ``torch.optim.SparseAdam`` (bias correction from a global step count).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Mapping, Union

import torch


class RowOptimizer(ABC):
    """Hyper-parameters plus one global step count; row state lives in the records."""

    name = ""
    state_width = 0  # state values per embedding value

    def __init__(self, lr: float) -> None:
        if not lr > 0:
            raise ValueError(f"{type(self).__name__}: lr must be > 0, got {lr}")
        self.lr = float(lr)
        self.steps = 0

    def step(self, records: torch.Tensor, grads: torch.Tensor, dim: int) -> torch.Tensor:
        """Update ``records`` ([rows, dim * (1 + state_width)]) with ``grads`` ([rows, dim]); returns them."""
        weight = records[:, :dim].contiguous()
        state = [records[:, dim * (1 + k): dim * (2 + k)].contiguous() for k in range(self.state_width)]
        self._update(weight, state, grads)
        return torch.cat([weight, *state], dim=1) if state else weight

    def begin_step(self) -> None:
        """Advance the global step (called once per optimizer step on every rank)."""
        self.steps += 1

    @abstractmethod
    def _update(self, weight: torch.Tensor, state: list, grad: torch.Tensor) -> None:
        """Update ``weight`` and ``state`` tensors in place."""

    def hyperparameters(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "steps"}

    def state_dict(self) -> dict:
        return {"name": self.name, "steps": self.steps, **self.hyperparameters()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps = int(state["steps"])


class RowSGD(RowOptimizer):
    """Plain SGD: ``w -= lr * g``."""

    name = "sgd"

    def _update(self, weight, state, grad) -> None:
        weight.add_(grad, alpha=-self.lr)


class RowAdagrad(RowOptimizer):
    """Adagrad with a per-value accumulator, as ``torch.optim.Adagrad``."""

    name = "adagrad"
    state_width = 1

    def __init__(self, lr: float = 0.01, lr_decay: float = 0.0, eps: float = 1e-10) -> None:
        super().__init__(lr)
        self.lr_decay = float(lr_decay)
        self.eps = float(eps)

    def _update(self, weight, state, grad) -> None:
        (accumulator,) = state
        clr = self.lr / (1 + (self.steps - 1) * self.lr_decay)
        accumulator.addcmul_(grad, grad, value=1)
        std = accumulator.sqrt().add_(self.eps)
        weight.addcdiv_(grad, std, value=-clr)


class RowAdam(RowOptimizer):
    """Lazy Adam (moments of touched rows only), as ``torch.optim.SparseAdam``."""

    name = "adam"
    state_width = 2

    def __init__(self, lr: float = 0.001, betas: tuple = (0.9, 0.999), eps: float = 1e-8) -> None:
        super().__init__(lr)
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"RowAdam: betas must lie in [0, 1), got {betas}")
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)

    def _update(self, weight, state, grad) -> None:
        exp_avg, exp_avg_sq = state
        beta1, beta2 = self.betas
        exp_avg.add_(grad.sub(exp_avg).mul_(1 - beta1))
        exp_avg_sq.add_(grad.pow(2).sub_(exp_avg_sq).mul_(1 - beta2))
        denom = exp_avg_sq.sqrt().add_(self.eps)
        step_size = self.lr * math.sqrt(1 - beta2 ** self.steps) / (1 - beta1 ** self.steps)
        weight.add_(-step_size * exp_avg.div(denom))


OPTIMIZERS = {cls.name: cls for cls in (RowSGD, RowAdagrad, RowAdam)}


def make_optimizer(spec: Union[str, RowOptimizer, Mapping[str, Any]], lr: float = 0.01) -> RowOptimizer:
    """An optimizer from an instance, a name ("sgd", "adagrad", "adam") or ``{"name": ..., **hyper}``."""
    if isinstance(spec, RowOptimizer):
        return spec
    if isinstance(spec, str):
        spec = {"name": spec, "lr": lr}
    spec = dict(spec)
    name = spec.pop("name", None)
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown row optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[name](**spec)
