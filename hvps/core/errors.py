"""Exceptions raised by hvps."""


class HvpsError(RuntimeError):
    """A collective failed: not initialized, mismatched submissions, a stalled rank."""


class DataPlaneStall(HvpsError):
    """A transfer moved no data for the stall time (HVPS_STALL_CHECK_TIME_SECONDS): a peer died, stopped or is
    unreachable, or waits for one that did. The live ranks stuck in the same transfer stall at about the same
    time, so the engine then asks the control plane which ranks stopped (a roll call, ``control/liveness.py``)."""


#: Horovod's name for a failed collective (what elastic training catches); the same class here.
HorovodInternalError = HvpsError


class DuplicateNameError(HvpsError, ValueError):
    """A collective was submitted under a name that is still in flight on this rank.

    A ValueError too, as Horovod raises for this argument error; nothing was submitted.
    """


NOT_INITIALIZED = "hvps is not initialized: call hvps.init()"


class NotInitializedError(HvpsError, ValueError):
    """hvps was used before ``init`` or after ``shutdown``.

    A ValueError too, as Horovod raises for this (``Horovod has not been initialized; use hvd.init().``):
    code written for Horovod that catches ValueError keeps working.
    """
