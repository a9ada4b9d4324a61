"""Command-line parsing for the gate's commands: a mistake is one line naming the flag and
what it accepts, exit status 2, never argparse's usage dump or a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn


class FlagError(ValueError):
    """A flag's value that parsed but cannot be used (the message names the flag)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, with errors as one line: ``embedserve quality: --k must be ...``."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def at_least(least: float, kind: type[int] | type[float] = int) -> Callable[[str], float]:
    """An argparse ``type=`` that refuses values under ``least``."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"wants {'an integer' if kind is int else 'a number'}"
                                             f" >= {least:g}, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"wants a value >= {least:g}, got {text!r}")
        return value

    return parse


def fraction(text: str) -> float:
    """An argparse ``type=`` for a share within 0-1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a number within 0-1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"wants a number within 0-1, got {text!r}")
    return value


def parse(parser: OneLineParser, argv: list[str] | None) -> argparse.Namespace | int:
    """The parsed flags, or the exit status argparse chose (0 after --help, 2 on a mistake)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
