"""The retry loop behind ``hvd.elastic.run`` (Horovod's ``run_fn``), and the reset it performs.

Each pass: the sync point (``state.sync()``, from rank 0), then ``func(state, ...)``. A
``HostsUpdatedInterrupt`` (raised by ``commit()`` on every rank at once) resets and goes round again;
a failed collective (``HorovodInternalError``, hvps's ``HvpsError``) restores the last commit, resets and
goes round again, in elastic mode only (see :mod:`hvps.elastic.mode`). Reset: ``shutdown()``,
``init()`` (the elastic launcher's new world), then the state's reset callbacks.

Two things differ from Horovod, both to be safe where it is not:

- the sync after a reset is skipped only when every rank agrees (one small allreduce in elastic mode):
  Horovod skips it on the survivors of a removal while workers that joined meanwhile sync, and the job
  deadlocks (Horovod issue 3494);
- a loop that keeps failing without completing a commit in between gives up after
  :data:`MAX_RESETS_WITHOUT_COMMIT` resets (``HVPS_ELASTIC_RESETS_WITHOUT_COMMIT``, which
  ``hvpsrun --resets-without-commit N`` sets), with the last error; under hvpsrun's elastic driver the
  whole job then fails with that one-line reason. A commit counts once its check for host updates has
  passed: a commit interrupted every time (a notice that keeps coming) is no progress.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

import numpy as np

from .. import api
from ..core.errors import DuplicateNameError, HvpsError
from ..core.settings import env_text
from .mode import elastic_mode, not_elastic_error, refuse_torchrun_restarts
from .notification import HostsUpdatedInterrupt, notification_manager
from ..runtime.bootstrap import elastic_session
from .state import State

#: resets in a row, with no completed commit between them, after which the loop gives up (the default of
#: HVPS_ELASTIC_RESETS_WITHOUT_COMMIT)
MAX_RESETS_WITHOUT_COMMIT = 8

log = logging.getLogger("hvps")


def reset() -> None:
    """Leave the old world and join the new one: ``shutdown()`` then ``init()`` (in elastic mode the
    launcher's next membership; a worker that has no place in it leaves with status 0)."""
    api.shutdown()
    api.init()


def _anyone_wants_sync(wanted: bool) -> bool:
    """Whether any rank wants the sync (a workers that just joined always does)."""
    flag = api.allreduce(np.array([1 if wanted else 0], dtype=np.int32), op=api.Max, name="hvps.elastic.sync_wanted")
    return bool(flag[0])


def _rejoin(reset: Callable[[], None], elastic: bool) -> None:
    """``reset()``; in elastic mode again while the new world fails to form (a member died while it
    joined: the launcher then publishes the next membership), at most MAX_RESETS_WITHOUT_COMMIT times."""
    for _ in range(MAX_RESETS_WITHOUT_COMMIT):
        try:
            return reset()
        except HvpsError as error:
            if not elastic:
                raise
            last = error
            log.warning("hvps: re-initializing failed (%s); joining the next membership", error)
            api.shutdown()
    raise HvpsError(f"hvd.elastic.run could not re-initialize in {MAX_RESETS_WITHOUT_COMMIT} tries; the last "
                    f"error: {last}") from last


def resets_without_commit() -> int:
    """The bound on resets in a row without a completed commit (HVPS_ELASTIC_RESETS_WITHOUT_COMMIT)."""
    text = env_text("HVPS_ELASTIC_RESETS_WITHOUT_COMMIT", "")
    if not text:
        return MAX_RESETS_WITHOUT_COMMIT
    if not text.isdigit() or int(text) < 1:
        raise HvpsError(f"HVPS_ELASTIC_RESETS_WITHOUT_COMMIT={text!r}: give a whole number of resets, at least 1")
    return int(text)


def _check_state(state: Any) -> None:
    if not isinstance(state, State):
        raise TypeError(f"the first argument of a function wrapped by hvd.elastic.run must be an elastic state "
                        f"(hvd.elastic.TorchState, ObjectState, ...), not {type(state).__name__}")


def run_fn(func: Callable[..., Any], reset: Callable[[], None] = reset,
           translate: Optional[Callable[[BaseException], Optional[HvpsError]]] = None) -> Callable[..., Any]:
    """``func(state, *args, **kwargs)`` wrapped in the elastic retry loop; ``reset`` re-initializes.

    Args:
        func: the training function, taking the state first.
        reset: re-initializes hvps after a failure or a change of hosts (default: ``shutdown()``, ``init()``).
        translate: ``translate(error)`` may turn a framework's error into the HvpsError it stands for
            (TensorFlow wraps a failed collective inside a graph in its own error type), or return None to
            leave it alone.

    Returns:
        ``wrapper(state, *args, **kwargs)``, which returns what ``func`` returns once it completes, and raises
        HvpsError for a failed collective outside elastic mode, or after ``HVPS_ELASTIC_RESETS_WITHOUT_COMMIT``
        resets in a row without a completed commit.

    Raises:
        TypeError: ``func`` is not callable.
    """
    if not callable(func):
        raise TypeError(f"hvd.elastic.run wraps a function taking the state first, not {func!r}")

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        _check_state(state)
        refuse_torchrun_restarts()
        elastic = elastic_mode()
        notification_manager.register_listener(state)
        limit = resets_without_commit()
        try:
            want_sync, fruitless, commits = True, 0, state._commits
            while True:
                if want_sync or elastic:
                    if not elastic or _anyone_wants_sync(want_sync):
                        state.sync()
                try:
                    return _call(func, translate, state, *args, **kwargs)
                except DuplicateNameError:
                    raise  # an argument error, not a failed collective: retrying cannot help
                except HvpsError as error:
                    if not elastic:
                        raise not_elastic_error(error) from error
                    log.warning("hvps: a collective failed (%s); restoring the last commit and re-initializing",
                                error)
                    elastic_session.report_failure(str(error))
                    state.restore()
                    want_sync, last_error = True, error
                except HostsUpdatedInterrupt as interrupt:
                    want_sync, last_error = not (interrupt.skip_sync and state.same_on_every_rank), interrupt
                fruitless = fruitless + 1 if state._commits == commits else 0
                commits = state._commits
                if fruitless > limit:
                    reason = (f"hvd.elastic.run gave up after {fruitless} resets in a row with no completed commit "
                              f"between them (HVPS_ELASTIC_RESETS_WITHOUT_COMMIT={limit}, hvpsrun "
                              f"--resets-without-commit); the last error: {last_error}")
                    elastic_session.give_up(reason)
                    raise HvpsError(reason) from last_error
                _rejoin(reset, elastic)
                state.on_reset()
        finally:
            notification_manager.remove_listener(state)

    return wrapper


def _call(func: Callable[..., Any], translate: Optional[Callable[[BaseException], Optional[HvpsError]]],
          state: State, *args: Any, **kwargs: Any) -> Any:
    if translate is None:
        return func(state, *args, **kwargs)
    try:
        return func(state, *args, **kwargs)
    except (HvpsError, HostsUpdatedInterrupt):
        raise
    except Exception as error:
        translated = translate(error)
        if translated is None:
            raise
        raise translated from error
