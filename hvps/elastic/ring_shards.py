"""The elastic state of a sharded state, framework-neutral: each commit keeps this rank's blocks and a copy of
another rank's (host memory), a restore puts its own back, a sync rebuilds every block of the new world from
the survivors' saves and re-shards.

A subclass says what its flat groups are and moves its state in and out as bytes (numpy ``uint8`` arrays of
``[shard elements, bytes per element]``, one per flat group: every channel of an element, parameters or
optimizer state, side by side); everything else is here. A commit's ring exchange sends this rank's blocks to
rank ``r + s`` (an alltoall with one non-empty split), where the stride ``s`` comes from
:func:`~hvps.elastic.shard_recovery.copy_stride`; a sync gathers what each rank holds, lets
:func:`~hvps.elastic.shard_recovery.block_providers` pick who gives each old block and moves the elements to
their ranks of the new layout with one alltoall (:func:`~hvps.elastic.shard_recovery.transfers`). The Keras
``ShardedOptimizer``'s elastic state (``hvps.adapters.tensorflow.elastic``) is built on it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .. import api
from ..core.errors import HvpsError
from ..runtime.bootstrap import elastic_session
from ..runtime.process_sets import global_process_set
from .shard_recovery import block_providers, copy_stride, transfers
from .state import SavedValue

__all__ = ["RingSave", "RingShardsHandler"]

log = logging.getLogger("hvps")


@dataclass
class RingSave:
    """One saved commit of a sharded state (see the module's docstring)."""

    size: int
    rank: int
    round: int
    version: int
    #: how far from each block its copy is kept (:func:`copy_stride`)
    stride: int
    #: per flat group, this rank's block as bytes: ``[shard elements, bytes per element]``
    blocks: list
    #: the blocks of rank ``rank - stride`` (same shapes), or None before the first exchange
    neighbour: Optional[list]
    #: what the subclass needs besides the blocks to install them (state keys, step counts, hyper-parameters)
    structure: Any
    #: what every rank holds alike, restored locally and synced from the first rank (a model's buffers)
    replicated: Any = None

    def claim(self) -> tuple:
        """What the ranks compare to know who holds the same save: ``(round, version, size, stride, rank, copy
        valid)``."""
        return self.round, self.version, self.size, self.stride, self.rank, self.neighbour is not None


class RingShardsHandler(SavedValue):
    """Saves, restores and syncs a sharded state over the ranks of ``process_set`` (every rank by default).

    A subclass provides :meth:`_layout`, :meth:`_world`, :meth:`_capture`, :meth:`_row_bytes`,
    :meth:`_install` and :meth:`_apply_hyperparameters` (and, for what every rank holds alike,
    :meth:`_restore_replicated` and :meth:`_sync_replicated`), and calls :meth:`_start` once it can capture.
    """

    #: names the collectives and the errors
    what = "sharded state"
    #: the ranks that hold the state: their collectives carry the exchange and the rebuild
    process_set: Any = global_process_set

    def _start(self) -> None:
        self._saved = self._snapshot(version=0)

    # -- what a subclass provides ---------------------------------------------------------------------------
    def _layout(self) -> list:
        """``[(name, element counts, dtype name)]`` per flat group, the same on every rank."""
        raise NotImplementedError

    def _world(self) -> tuple:
        """``(size, rank)`` of the layout the live blocks are in."""
        raise NotImplementedError

    def _capture(self) -> tuple:
        """``(blocks as bytes, structure, replicated)`` of the live state."""
        raise NotImplementedError

    def _row_bytes(self, structure: Any) -> list:
        """The bytes per element of each group's block under ``structure``."""
        raise NotImplementedError

    def _install(self, blocks: list, size: int, rank: int, structure: Any) -> None:
        """Make ``blocks`` (bytes) this rank's blocks of a ``size``-rank layout, with ``structure``."""
        raise NotImplementedError

    def _apply_hyperparameters(self, structure: Any) -> None:
        """Take ``structure``'s (the first rank's) hyper-parameters."""
        raise NotImplementedError

    def _restore_replicated(self, replicated: Any) -> None:
        """Put back what every rank holds alike."""

    def _sync_replicated(self) -> None:
        """Make what every rank holds alike the first rank's (a collective)."""

    # -- save, restore, sync ------------------------------------------------------------------------------
    def _members(self) -> tuple:
        """``(size, rank, first global rank)`` of the process set now."""
        return self.process_set.size(), self.process_set.rank(), self.process_set.ranks[0]

    def _snapshot(self, version: int) -> RingSave:
        blocks, structure, replicated = self._capture()
        size, rank = self._world()
        stride = 1
        if api.is_initialized():
            stride = copy_stride(self.process_set.size(), api.local_size(), api.cross_size())
        return RingSave(size, rank, elastic_session.round, version, stride, blocks, None, structure, replicated)

    def save(self) -> None:
        """Keep this rank's blocks, and a copy of rank ``rank - stride``'s (one alltoall: a collective)."""
        saved = self._saved
        version = saved.version + 1 if saved.round == elastic_session.round else 1
        snapshot = self._snapshot(version)
        snapshot.neighbour = self._exchange(snapshot.blocks, snapshot.stride)
        self._saved = snapshot

    def _exchange(self, blocks: list, stride: int) -> list:
        """Send this rank's blocks to rank ``rank + stride`` and receive those of ``rank - stride`` (same shapes)."""
        size, rank, _ = self._members()
        payload = np.concatenate([b.reshape(-1) for b in blocks]) if blocks else np.zeros(0, np.uint8)
        splits = [0] * size
        splits[(rank + stride) % size] = payload.size
        received, _ = api.alltoall(payload, splits, name=f"elastic.{self.what}.neighbour_copy",
                                   process_set=self.process_set)
        copies, at = [], 0
        for block in blocks:
            copies.append(np.array(received[at : at + block.size]).reshape(block.shape))
            at += block.size
        return copies

    def restore(self) -> None:
        """Return to the last save: this rank's own blocks, in the layout they were saved in (local)."""
        saved = self._saved
        self._install(saved.blocks, saved.size, saved.rank, saved.structure)
        self._restore_replicated(saved.replicated)

    def sync(self) -> None:
        """Rebuild every rank's blocks of the new world from the survivors' saves and re-shard (a collective
        of the process set). Nothing moves when the world and its ranks are those of the save.

        Raises:
            HvpsError: a shard is lost (its owner and its copy's keeper are both gone), or the ranks' saves or
                layouts disagree (raised on every rank).
        """
        began = time.monotonic()
        size, rank, root = self._members()
        saved = self._saved
        layout = self._layout()
        widths = [block.shape[1] for block in saved.blocks]
        gathered = api.allgather_object((saved.claim(), layout, widths), name=f"elastic.{self.what}.claims",
                                        process_set=self.process_set)
        for other, (_, theirs, _) in enumerate(gathered):
            if theirs != layout:
                raise HvpsError(f"elastic {self.what}: rank {other}'s layout differs from rank {rank}'s ({theirs} vs "
                                f"{layout}): every rank must wrap the same model the same way")
        structure = api.broadcast_object(saved.structure if rank == 0 else None, root,
                                         name=f"elastic.{self.what}.structure", process_set=self.process_set)
        claims = [claim for claim, _, _ in gathered]
        reference = claims[0]
        holders = [(claim[4], claim[5]) if claim[:4] == reference[:4] else None for claim in claims]
        row_bytes = self._row_bytes(structure)
        for other, (held, (_, _, theirs)) in enumerate(zip(holders, gathered)):
            if held is not None and theirs != row_bytes:  # every rank sees it: all raise, none waits in the alltoall
                raise HvpsError(f"elastic {self.what}: rank {other}'s save has other state than rank 0's (bytes "
                                f"per element of each group: {theirs} vs {row_bytes}); the ranks must step the "
                                "same optimizers")
        old_size, stride = reference[2], reference[3]
        if old_size == size and all(held is not None and held[0] == j for j, held in enumerate(holders)):
            self._apply_hyperparameters(structure)
        else:
            blocks = self._rebuild(holders, old_size, stride, size, rank, row_bytes)
            self._install(blocks, size, rank, structure)
            log.info("hvps: rebuilt the %s from %d rank(s)' saves for %d rank(s) in %.3f s", self.what,
                     sum(held is not None for held in holders), size, time.monotonic() - began)
        self._sync_replicated()

    def _rebuild(self, holders: list, old_size: int, stride: int, size: int, rank: int, row_bytes: list) -> list:
        """This rank's blocks (bytes, one per flat group) of the ``size``-rank layout, from the holders' saves."""
        providers = block_providers(holders, old_size, stride)
        numels = [sum(sizes) for _, sizes, _ in self._layout()]
        plans = [transfers(numel, old_size, size, providers) for numel in numels]
        saved = self._saved
        parts, splits = [], [0] * size
        for dest in range(size):
            for g, plan in enumerate(plans):
                for move in plan:
                    if move.source == rank and move.dest == dest:
                        source = saved.neighbour[g] if move.from_copy else saved.blocks[g]
                        parts.append(source[move.offset : move.offset + move.length].reshape(-1))
                        splits[dest] += parts[-1].size
        payload = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
        received, _ = api.alltoall(payload, splits, name=f"elastic.{self.what}.rebuild", process_set=self.process_set)
        received = np.asarray(received)
        blocks = [np.zeros((-(-numel // size), width), np.uint8) for numel, width in zip(numels, row_bytes)]
        at = 0
        for source in range(size):
            for g, plan in enumerate(plans):
                for move in plan:
                    if move.source == source and move.dest == rank:
                        n = move.length * row_bytes[g]
                        piece = received[at : at + n].reshape(move.length, row_bytes[g])
                        blocks[g][move.at : move.at + move.length] = piece
                        at += n
        return blocks
