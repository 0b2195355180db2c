"""Warnings that point at the user's line, whatever path inside hvps led to them.

A fixed ``stacklevel`` is right for one call path only: a wrapper added later (a timing decorator, an
adapter calling the core) silently moves the reported location into hvps. :func:`warn` walks the stack to the
first frame outside the package instead, as Python 3.12's ``warnings.warn(skip_file_prefixes=...)`` does.
"""

from __future__ import annotations

import os
import sys
import warnings

#: the directory of the hvps package, with a trailing separator
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn(message: str, category: type = UserWarning, through: tuple = ()) -> None:
    """Issue ``message`` as a warning located at the nearest caller outside hvps.

    Args:
        message: the warning's text.
        category: its class, a subclass of ``Warning``.
        through: more source files (or directories, with a trailing separator) to look past: a framework's
            layer between the user and hvps, such as the wrapper torch puts around every optimizer's ``step``.
    """
    skipped = (_PACKAGE, *through)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
