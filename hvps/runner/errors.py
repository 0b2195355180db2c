"""The one exception hvpsrun raises for bad input; ``main`` prints it as one line and exits 2."""


class LaunchError(Exception):
    """Bad input or a missing prerequisite. The message says what is wrong and what to do."""

    exit_code = 2
