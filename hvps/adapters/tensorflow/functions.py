"""Helpers that bring every rank to the root's variables and Python objects."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import hvps
from hvps import ProcessSet, global_process_set

from .mpi_ops import broadcast_


def broadcast_variables(variables: Iterable[Any], root_rank: int = 0,
                        process_set: ProcessSet = global_process_set, inplace: bool = True) -> Any:
    """Overwrite ``variables`` (tf.Variables or Keras 3 Variables) with the root's values.

    Every member must pass the same number of variables, in the same order, with
    the same shapes and dtypes (``model.variables``, ``optimizer.variables``);
    all of them travel as one batch of broadcasts. Works eagerly and in a tf.function.

    Args:
        variables: the variables.
        root_rank: the global rank whose values every member receives.
        process_set: the ranks that take part (default: all).
        inplace: Horovod's argument, accepted; the variables are always assigned in place.

    Returns:
        Their new values, a list (empty for no variables).
    """
    var_list = list(variables)
    if not var_list:
        return []
    return broadcast_(var_list, root_rank, name="broadcast_variables", process_set=process_set)


def broadcast_object(obj: Any = None, root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return the root's picklable ``obj`` on every member (``session`` is TF1's, ignored).

    Args:
        obj: the root's object (ignored elsewhere).
        root_rank: the global rank whose object every member receives.
        session: TF1's session, ignored.
        name: the collective's name, the same on every rank (default: numbered in call order).
        process_set: the ranks that take part (default: all).

    Returns:
        ``obj`` on the root, an unpickled copy of it elsewhere (see :func:`hvps.broadcast_object`).
    """
    return hvps.broadcast_object(obj, root_rank=root_rank, name=name, process_set=process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A function ``f(obj)`` that broadcasts ``obj`` from the root, as :func:`broadcast_object`."""
    def broadcast_fn(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, name=name, process_set=process_set)

    return broadcast_fn


def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Every member's picklable ``obj``, in rank order (``session`` is TF1's, ignored).

    Args:
        obj: this rank's object.
        session: TF1's session, ignored.
        name: the collective's name, the same on every rank (default: numbered in call order).
        process_set: the ranks that take part (default: all).

    Returns:
        The members' objects, a list in rank order (see :func:`hvps.allgather_object`).
    """
    return hvps.allgather_object(obj, name=name, process_set=process_set)
