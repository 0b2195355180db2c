"""Stand-ins for Horovod names hvps does not implement: using one raises NotImplementedError
with a message that names the alternative (the adapters' ``elastic`` modules)."""

from __future__ import annotations

from typing import Any, Callable


def refusing(message: str) -> Callable[..., Any]:
    """A function that raises ``NotImplementedError(message)`` whatever it is called with."""

    def refuse(*_: Any, **__: Any) -> Any:
        raise NotImplementedError(message)

    return refuse


class Unavailable:
    """Base for unimplemented Horovod classes: constructing one raises ``NotImplementedError(message)``."""

    message = "not implemented by hvps"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(self.message)
