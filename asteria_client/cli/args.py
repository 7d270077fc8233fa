"""What every ``asteria`` command shares: the parser class, exit codes, and argument types.

Numbers are parsed and range-checked here, in one place; a bad value is one line on stderr and
exit code 2 (:class:`UsageError`), never a usage dump.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn, TypeVar

PROG = "asteria"
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

#: What a command's ``register`` returns: the function that runs it on the parsed arguments.
Handler = Callable[[argparse.Namespace], int]

if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction["ArgumentParser"]

N = TypeVar("N", int, float)


class UsageError(Exception):
    """Bad command-line input; reported as one line, exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (and exit code 2), not usage plus error."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (see `{self.prog} --help`)")


def bounded(
    convert: Callable[[str], N], expected: str, in_range: Callable[[N], bool], problem: str
) -> Callable[[str], N]:
    """An argparse ``type``: ``convert`` the text, then require ``in_range`` of the value."""

    def parse(text: str) -> N:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not in_range(value):
            raise argparse.ArgumentTypeError(f"{problem}, got {text}")
        return value

    return parse


positive_int = bounded(int, "an integer", lambda v: v >= 1, "must be a positive integer")
non_negative_int = bounded(int, "an integer", lambda v: v >= 0, "must be 0 or more")
positive_float = bounded(
    float, "a number", lambda v: 0 < v < math.inf, "must be a positive finite number"
)
non_negative_float = bounded(
    float, "a number", lambda v: 0 <= v < math.inf, "must be a finite number >= 0"
)


def positive_float_list(text: str) -> tuple[float, ...]:
    """An argparse ``type``: comma-separated positive finite numbers (``1e-3,3e-3``)."""
    items = [item.strip() for item in text.split(",")]
    try:
        if not all(items):
            raise argparse.ArgumentTypeError("an empty item")
        return tuple(positive_float(item) for item in items)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive numbers like 1e-3,3e-3, got {text!r} ({exc})"
        ) from None


positive_seconds = bounded(
    float, "seconds", lambda v: 0 < v < math.inf, "must be a positive number of seconds"
)
