"""Which launcher started this job, as far as elastic training cares.

- ``elastic_mode()``: an elastic launcher (``hvpsrun`` with ``--min-np``/``--max-np``/
  ``--host-discovery-script``) started this worker and sets ``HVPS_ELASTIC=1``: a failed collective is
  retried in place (restore, re-initialize, sync). Otherwise (every MPI job, ``hvpsrun`` without those
  flags, a plain ``torchrun``) re-initializing the same fixed world cannot bring a lost rank back, so
  ``hvd.elastic.run`` re-raises the failure with a message naming the elastic mode and the checkpoint
  alternative.
- ``torchrun_restarts()``: torchrun with restarts restarts every worker from scratch on a failure or a
  membership change, which would silently throw the in-memory state away: ``hvd.elastic.run`` refuses.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

from ..core.errors import HvpsError
from ..core.settings import env_choice
from ..runtime.bootstrap import elastic_session

ELASTIC_FLAGS = "hvpsrun --min-np N --max-np M --host-discovery-script SCRIPT"
CHECKPOINT_ALTERNATIVE = ("or save checkpoints (hvd.CheckpointManager) and restart the whole job from the latest "
                          "(hvpsrun --max-restarts N)")


def elastic_mode() -> bool:
    """Whether an elastic launcher started this job.

    Returns:
        True for ``HVPS_ELASTIC=1``; False for ``0`` or unset.
    """
    return env_choice("HVPS_ELASTIC", "0", ("0", "1")) == "1"


def joins_a_running_job() -> bool:
    """Whether this worker joined an elastic job in progress: the first membership it joined was not the
    job's first, and it had no slot in the one before (a worker added or brought back, not one of the first
    workers whose first membership failed to form). Its state then comes from the others' (``hvd.elastic``'s
    sync), so wrap-time collectives that the running workers already did are left out.

    Returns:
        True for such a worker of an elastic job; False otherwise (and outside elastic mode).
    """
    return elastic_mode() and elastic_session.joined_late


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env.get(name) or 0)
    except ValueError:
        return 0


def torchrun_restarts(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why torchrun would restart this worker from scratch (its ``--max-restarts`` > 0, or this is
    already a restarted worker), or None. torchrun's ``--nnodes MIN:MAX`` leaves no trace in the
    workers' environment, so an elastic torchrun job with ``--max-restarts 0`` cannot be told apart
    from a static one here (its first membership change restarts every worker all the same).

    Args:
        env: the environment to read (default: ``os.environ``).

    Returns:
        The reason, or None when torchrun (if it launched this worker) will not restart it.
    """
    env = os.environ if env is None else env
    if not env.get("TORCHELASTIC_RUN_ID"):
        return None
    if _int(env, "TORCHELASTIC_RESTART_COUNT") > 0:
        return f"this worker is torchrun's restart number {_int(env, 'TORCHELASTIC_RESTART_COUNT')}"
    if _int(env, "TORCHELASTIC_MAX_RESTARTS") > 0:
        return f"torchrun was started with --max-restarts {_int(env, 'TORCHELASTIC_MAX_RESTARTS')}"
    return None


def refuse_torchrun_restarts(env: Optional[Mapping[str, str]] = None) -> None:
    """Refuse ``hvd.elastic.run`` when torchrun would restart the workers (see :func:`torchrun_restarts`).

    Args:
        env: the environment to read (default: ``os.environ``).

    Raises:
        HvpsError: torchrun would restart the workers; the message names the alternatives.
    """
    why = torchrun_restarts(env)
    if why is not None:
        raise HvpsError(f"hvd.elastic.run refuses to run under torchrun with restarts ({why}): torchrun restarts "
                        "every worker from scratch on a failure or a membership change, so the in-memory state "
                        f"that hvd.elastic commits would be lost silently. Start the job with {ELASTIC_FLAGS} "
                        "(hvps's elastic mode: survivors keep their state and re-initialize in place), run "
                        f"torchrun with --max-restarts 0 and a fixed --nnodes, {CHECKPOINT_ALTERNATIVE}")


def not_elastic_error(error: BaseException) -> HvpsError:
    """The error ``hvd.elastic.run`` raises for a failed collective outside elastic mode."""
    return HvpsError(f"{error} -- hvd.elastic.run cannot recover from this: the job was not started in elastic "
                     "mode, and re-initializing a fixed world cannot bring a lost rank back. For elastic training "
                     f"start it with {ELASTIC_FLAGS}, {CHECKPOINT_ALTERNATIVE}")
