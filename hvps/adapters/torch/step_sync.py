"""The rule every torch gradient wrapper's ``step()`` follows: synchronize once, unless told otherwise.

``optimizer.synchronize()`` may run before ``step()`` (to clip the averaged gradients); then ``step()`` must
not reduce them again, and Horovod's contract is that the user says so with ``skip_synchronize()``. A
``step()`` after ``synchronize()`` without it reduces nothing twice and warns, as Horovod does.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from hvps.core.user_warnings import warn

#: torch wraps every optimizer's ``step`` (its profiling hooks): a warning from a step points past that layer
_TORCH_STEP_WRAPPER = (inspect.getfile(torch.optim.Optimizer),)


class StepSynchronization:
    """Mixin: ``skip_synchronize()`` and the synchronize-once rule. The class defines ``synchronize()``, which
    sets ``_synchronized`` when it completes, and calls :meth:`_synchronize_for_step` in its ``step()``."""

    #: whether this step's gradients are already synchronized (``synchronize()`` ran since the last step)
    _synchronized: bool = False
    #: False inside ``skip_synchronize()``
    _should_synchronize: bool = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside, ``step()`` does not synchronize: call ``synchronize()`` yourself first (to clip the averaged
        gradients, say).

        Returns:
            A context manager: ``with opt.skip_synchronize(): opt.step()``.
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def _synchronize_for_step(self) -> None:
        """Synchronize now unless ``synchronize()`` already ran (then warn) or ``skip_synchronize()`` is in
        force; either way the next step starts unsynchronized."""
        if self._should_synchronize:
            if self._synchronized:
                warn("optimizer.step() called without optimizer.skip_synchronize() after optimizer.synchronize(); "
                     "gradients are reduced once only", through=_TORCH_STEP_WRAPPER)
            else:
                self.synchronize()
        self._synchronized = False
