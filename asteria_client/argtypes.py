"""Argument types for the command line: numbers parsed and range-checked in one place."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N", int, float)


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
