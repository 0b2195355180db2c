"""Gradients kept in one flat buffer per dtype, as DDP's ``gradient_as_bucket_view`` does.

Parameters are laid out in reverse registration order, the order backward
produces their gradients, so gradients that become ready together lie back to
back in memory and the engine reduces a fused group in place, without copying
it into and out of a fusion buffer.
"""

from __future__ import annotations

import torch


class GradientBuckets:
    """Flat per-dtype gradient storage for CPU parameters; ``p.grad`` is a view into it."""

    def __init__(self, params: list) -> None:
        eligible = [p for p in reversed(params)
                    if p.requires_grad and p.device.type == "cpu" and p.layout == torch.strided]
        self._views: dict = {}
        self._flats: list = []
        by_dtype: dict = {}
        for p in eligible:
            by_dtype.setdefault(p.dtype, []).append(p)
        for dtype, members in by_dtype.items():
            flat = torch.zeros(sum(p.numel() for p in members), dtype=dtype)
            offset = 0
            for p in members:
                self._views[p] = flat[offset : offset + p.numel()].view(p.shape)
                offset += p.numel()
            self._flats.append(flat)
        for p in eligible:
            self.adopt(p)

    def holds(self, p: torch.Tensor) -> bool:
        """Whether ``p.grad`` is its view into the flat buffer."""
        view = self._views.get(p)
        return view is not None and p.grad is not None and p.grad.data_ptr() == view.data_ptr()

    def adopt(self, p: torch.Tensor) -> None:
        """Make ``p.grad`` the view again (copying the gradient in) after something replaced it."""
        view = self._views.get(p)
        if view is None or p.grad is None or self.holds(p) or p.grad.is_sparse:
            return
        view.copy_(p.grad)
        p.grad = view

    def zero(self) -> None:
        """Zero every bucketed gradient (one memset per buffer); the views stay."""
        for flat in self._flats:
            flat.zero_()
