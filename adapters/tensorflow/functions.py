"""Helpers that bring every rank to the root's variables and Python objects."""

from __future__ import annotations

from typing import Any, Iterable, Optional

import hvps

from .mpi_ops import broadcast_

allgather_object = hvps.allgather_object


def broadcast_variables(variables: Iterable[Any], root_rank: int = 0, process_set: Any = None,
                        inplace: bool = True) -> Any:
    """Overwrite ``variables`` (tf.Variables or Keras 3 Variables) with the root's values.

    Every rank must pass the same number of variables, in the same order, with
    the same shapes and dtypes (``model.variables``, ``optimizer.variables``);
    all of them travel as one batch of broadcasts. Works eagerly and in a tf.function.
    """
    var_list = list(variables)
    if not var_list:
        return []
    return broadcast_(var_list, root_rank, name="broadcast_variables", process_set=process_set)


def broadcast_object(obj: Any = None, root_rank: int = 0, name: Optional[str] = None, process_set: Any = None) -> Any:
    """Return the root's picklable ``obj`` on every rank."""
    if process_set is not None:
        raise NotImplementedError("hvps runs collectives on the global process set only; pass process_set=None")
    return hvps.broadcast_object(obj, root_rank=root_rank, name=name)
