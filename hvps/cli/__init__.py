"""The ``hvps`` command: a registry of subcommands, each a ``register(subparsers)`` in the room it
belongs to.

A subcommand's ``register`` adds its parser and sets ``func=run`` (``run(args)`` returns the exit
status). Shipped: ``hvps ckpt`` (``hvps.checkpoint.cli``) and ``hvps doctor`` (``hvps.doctor.cli``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

from ..checkpoint import cli as checkpoint_cli
from ..doctor import cli as doctor_cli
from ..version import __version__

#: subcommand name -> the function that adds its parser
SUBCOMMANDS: dict[str, Callable] = {"ckpt": checkpoint_cli.register, "doctor": doctor_cli.register}


class _Parser(argparse.ArgumentParser):
    """argparse that tells the user what to do on bad input, naming the (sub)command that got it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.set_defaults(_parser=self)  # the deepest subcommand's parser wins: main() reports leftovers with it

    def error(self, message: str):  # noqa: D401
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\nRun '{self.prog} --help' to see every option.\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hvps", description="hvps command-line tools.")
    parser.add_argument("--version", action="version", version=f"hvps {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in sorted(SUBCOMMANDS):
        SUBCOMMANDS[name](sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # e.g. `hvps ckpt list DIR | head`
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
