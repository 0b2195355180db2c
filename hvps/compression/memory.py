"""Error feedback: residual memory (top-k, Aji & Heafield 2017) and DGC's momentum correction."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..runtime import state as runtime
from .base import Memory


def _load(target: dict, state: dict, kind: str) -> None:
    prefix = f"{kind}/"
    target.clear()
    target.update({key[len(prefix):]: np.array(value) for key, value in state.items() if key.startswith(prefix)})


class NoMemory(Memory):
    """No error feedback: what compression drops is lost."""

    def compensate(self, array, name):
        return array

    def update(self, compensated, name, compressor, payloads, ctx):
        pass


class ResidualMemory(Memory):
    """Adds back what the previous compression of the same tensor left out.

    After each step ``residual == compensated - decompress(compress(compensated))``.

    ``in_place=True`` adds ``array`` into the stored residual's own buffer (no allocation per
    step: the residual is dead until ``update`` stores the next one) and has ``state_dict``
    return copies; the compressor's ``residual`` should then work in place too (PowerSGD's does).
    """

    def __init__(self, in_place: bool = False) -> None:
        self.residuals: dict = {}
        self.in_place = in_place

    def compensate(self, array, name):
        residual = self.residuals.get(name)
        if residual is None:
            return array.copy()
        if self.in_place and residual.shape == array.shape and residual.dtype == array.dtype:
            return np.add(residual, array, out=residual)
        return array + residual

    def update(self, compensated, name, compressor, payloads, ctx):
        self.residuals[name] = compressor.residual(compensated, payloads, ctx)

    def forget(self, name):
        self.residuals.pop(name, None)

    def state_dict(self):
        copy = np.copy if self.in_place else (lambda value: value)
        return {f"residual/{name}": copy(value) for name, value in self.residuals.items()}

    def load_state_dict(self, state):
        _load(self.residuals, state, "residual")


class DgcMemory(Memory):
    """Deep Gradient Compression's local state (Lin et al., ICLR 2018).

    - momentum correction: ``u = m*u + g``, ``v = v + u``; ``v`` is what gets sparsified;
    - local gradient clipping: ``g`` is clipped to ``clip_norm / sqrt(size)`` before use;
    - momentum factor masking: entries that were sent are cleared from ``u`` and ``v``.

    The wrapped optimizer should then run without momentum of its own.
    """

    def __init__(self, momentum: float = 0.9, clip_norm: Optional[float] = None) -> None:
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if clip_norm is not None and clip_norm <= 0:
            raise ValueError(f"clip_norm must be positive, got {clip_norm}")
        self.momentum = momentum
        self.clip_norm = clip_norm
        self.velocities: dict = {}
        self.accumulations: dict = {}

    def compensate(self, array, name):
        grad = array.astype(np.float32, copy=True)
        if self.clip_norm is not None:
            limit = self.clip_norm / math.sqrt(runtime.size())
            norm = float(np.linalg.norm(grad))
            if norm > limit:
                grad *= limit / norm
        u = self.velocities.get(name)
        u = grad if u is None else np.add(self.momentum * u, grad, out=u)
        self.velocities[name] = u
        v = self.accumulations.get(name)
        v = u.copy() if v is None else np.add(v, u, out=v)
        self.accumulations[name] = v
        return v.astype(array.dtype, copy=False)

    def update(self, compensated, name, compressor, payloads, ctx):
        sent = payloads[0]
        self.velocities[name].reshape(-1)[sent] = 0
        self.accumulations[name].reshape(-1)[sent] = 0

    def forget(self, name):
        self.velocities.pop(name, None)
        self.accumulations.pop(name, None)

    def state_dict(self):
        state = {f"velocity/{n}": v for n, v in self.velocities.items()}
        state.update({f"accumulation/{n}": v for n, v in self.accumulations.items()})
        return state

    def load_state_dict(self, state):
        _load(self.velocities, state, "velocity")
        _load(self.accumulations, state, "accumulation")
