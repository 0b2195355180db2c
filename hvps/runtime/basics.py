"""Horovod's ``HorovodBasics`` internals that scripts and Horovod's own tests reach for
(``hvd.mpi_ops._basics._get_process_set_ids_and_ranks()``): answered from hvps's process-set registry."""

from __future__ import annotations

from typing import Dict, List

from . import process_sets as _sets


def _get_process_set_ids_and_ranks() -> Dict[int, List[int]]:
    """Every registered process set: ``{process set id: its global ranks, ascending}``.

    Raises:
        NotInitializedError: before ``init``.
    """
    return _sets.ids_and_ranks()


def _process_set_size(process_set_id: int) -> int:
    """The number of ranks in the registered set ``process_set_id``.

    Raises:
        ValueError: no such set is registered.
    """
    return len(_ranks(process_set_id))


def _process_set_rank(process_set_id: int) -> int:
    """This rank's index in the registered set ``process_set_id`` (-1 when it is not a member).

    Raises:
        ValueError: no such set is registered.
    """
    ranks = _ranks(process_set_id)
    me = _sets.runtime.rank()
    return ranks.index(me) if me in ranks else -1


def _ranks(process_set_id: int) -> List[int]:
    table = _sets.ids_and_ranks()
    if process_set_id not in table:
        raise ValueError(f"process set {process_set_id} is not registered (registered: {sorted(table)})")
    return table[process_set_id]
