"""Exceptions raised by hvps."""


class HvpsError(RuntimeError):
    """A collective failed: not initialized, mismatched submissions, a stalled rank."""


NOT_INITIALIZED = "hvps is not initialized: call hvps.init()"
