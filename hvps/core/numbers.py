"""Numeric command-line values: one validator for every ``type=`` of hvps's argument parsers
(hvpsrun, ``hvps doctor``), so a bad number gets the same one-line error everywhere."""

from __future__ import annotations

import argparse
from typing import Callable, Optional


def number(kind: type = int, *, minimum: Optional[float] = None, above: Optional[float] = None) -> Callable:
    """An argparse ``type``: ``kind(text)``, at least ``minimum`` and greater than ``above`` when given;
    an ``ArgumentTypeError`` (``'x' is not a whole number``, ``'-1' must be >= 0``) otherwise."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if kind is int else ''}number") from None
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= {minimum:g}")
        if above is not None and value <= above:
            raise argparse.ArgumentTypeError(f"{text!r} must be > {above:g}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


#: a count of at least one (ranks, slots, resets)
positive = number(int, minimum=1)
#: a count that may be zero
non_negative = number(int, minimum=0)
#: seconds, megabytes, ... that may be zero
non_negative_float = number(float, minimum=0)
#: an interval that must not be zero
positive_float = number(float, above=0)
