"""Bounded staleness (Persia's hybrid mode in miniature: rows read stale, gradients applied exactly): reuse rows
up to k steps old.

A member remembers the rows it pulled; for ``k`` steps after a pull it serves those ids from
its copy instead of asking their owners again, so a step pulls only ids it has not seen
recently.  Gradients still go to the owners every step, so the owners' rows stay exact; only
what this member reads may lag by up to ``k`` steps.
"""

from __future__ import annotations

import torch


class StaleRows:
    """Rows pulled within the last ``staleness`` steps, by id."""

    def __init__(self, staleness: int, dim: int) -> None:
        if staleness < 1:
            raise ValueError(f"staleness must be >= 1 to keep rows, got {staleness}")
        self.staleness = int(staleness)
        self.step = 0
        self.ids = torch.empty(0, dtype=torch.int64)
        self.rows = torch.empty(0, dim)
        self.born = torch.empty(0, dtype=torch.int64)
        self.reused = 0
        self.pulled = 0

    def advance(self, lag: int = 0) -> None:
        """Start a step: forget rows that would be older than the bound when used ``lag`` steps on."""
        self.step += 1
        keep = self.born >= self.step - self.staleness + lag
        self.ids, self.rows, self.born = self.ids[keep], self.rows[keep], self.born[keep]

    def find(self, ids: torch.Tensor) -> tuple:
        """``(known mask, their rows)`` for sorted distinct ``ids``."""
        if not self.ids.numel():
            return torch.zeros(ids.numel(), dtype=torch.bool), self.rows[:0]
        at = torch.searchsorted(self.ids, ids).clamp(max=self.ids.numel() - 1)
        known = self.ids[at] == ids
        self.reused += int(known.sum())
        return known, self.rows[at[known]]

    def remember(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Keep freshly pulled ``rows`` of ``ids`` (not already known)."""
        self.pulled += int(ids.numel())
        self.rows = self.rows.to(rows.device)
        ids = torch.cat([self.ids, ids])
        order = torch.argsort(ids)
        self.ids = ids[order]
        self.rows = torch.cat([self.rows, rows])[order]
        self.born = torch.cat([self.born, torch.full((rows.shape[0],), self.step, dtype=torch.int64)])[order]
