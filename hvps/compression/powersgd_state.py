"""PowerSGD's state, keyed by tensor name: warm-start Q, error feedback, step counts.

Kept apart from the hyper-parameters (``lowrank.PowerSGDCompressor``) so that a checkpoint holds
exactly what a resumed run needs to continue bit-exactly: Q and the steps are the same on every
rank (they come out of allreduces), the error buffers are this rank's own.
"""

from __future__ import annotations

import numpy as np

from .base import Memory
from .memory import NoMemory, ResidualMemory


class PowerSGDState:
    """``qs[name]``: the Q of the last step (warm start); ``steps[name]``: how many times the tensor
    was exchanged; ``draws[name]``: how many Q starts it drew; ``memory``: the error feedback
    (``ResidualMemory``, or ``NoMemory`` without it)."""

    def __init__(self, error_feedback: bool = True) -> None:
        self.memory: Memory = ResidualMemory(in_place=True) if error_feedback else NoMemory()
        self.qs: dict = {}
        self.steps: dict = {}
        self.draws: dict = {}
        #: tensors reset after a non-finite P or Q (this process; not saved)
        self.resets: dict = {}

    def next_step(self, name: str) -> int:
        """This tensor's step number (0 first) and count it."""
        step = self.steps.get(name, 0)
        self.steps[name] = step + 1
        return step

    def next_draw(self, name: str) -> int:
        """The number of this tensor's next fresh Q draw, counted."""
        draw = self.draws.get(name, 0)
        self.draws[name] = draw + 1
        return draw

    def reset(self, name: str) -> None:
        """Forget ``name``'s Q and error (after a NaN or Inf): the next step starts afresh."""
        self.qs.pop(name, None)
        self.memory.forget(name)
        self.resets[name] = self.resets.get(name, 0) + 1

    def state_dict(self) -> dict:
        """Arrays keyed ``"powersgd.q/<name>"``, ``"powersgd.step/<name>"``, ``"powersgd.draw/<name>"``
        and the memory's ``"residual/<name>"``."""
        state = {f"powersgd.q/{n}": q for n, q in self.qs.items()}
        state.update({f"powersgd.step/{n}": np.array(s, dtype=np.int64) for n, s in self.steps.items()})
        state.update({f"powersgd.draw/{n}": np.array(d, dtype=np.int64) for n, d in self.draws.items()})
        state.update(self.memory.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (torch tensors are accepted too)."""
        arrays = {k: np.array(v.numpy() if hasattr(v, "numpy") else v) for k, v in state.items()}
        self.qs = {k[len("powersgd.q/"):]: v for k, v in arrays.items() if k.startswith("powersgd.q/")}
        self.steps = {k[len("powersgd.step/"):]: int(v) for k, v in arrays.items() if k.startswith("powersgd.step/")}
        self.draws = {k[len("powersgd.draw/"):]: int(v) for k, v in arrays.items() if k.startswith("powersgd.draw/")}
        self.memory.load_state_dict({k: v for k, v in arrays.items() if not k.startswith("powersgd.")})


__all__ = ["PowerSGDState"]
