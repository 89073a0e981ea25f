"""Bounded numbers for command-line options: one argparse type for every numeric option of masrl.

``bounded(int, 1, 10**6)`` and ``bounded(float, 0, 1e5, low_open=True)`` parse a value and refuse, as one
argparse error line (exit 2), anything that is not a number of that kind, not finite (``nan``, ``inf``,
``1e400``) or outside its range. The message names the value (truncated) and the range; argparse adds the
option's name. Bottom layer: imports nothing from masrl.
"""
from __future__ import annotations

import argparse
import math
from typing import Callable, Union

Number = Union[int, float]
MAX_TEXT = 40  # characters of a refused value shown in the message
MAX_DIGITS = 30  # longer numbers are refused before int() (Python stops at 4,300 digits; no bound is that large)
MAX_COUNT = 10 ** 6  # counts (devices, jobs, seeds, samples, episodes)
MAX_TOKENS = 10 ** 7  # lengths in tokens


def shown(text: object, limit: int = MAX_TEXT) -> str:
    """``text`` as a user sees it in one error line: a string quoted, anything else as its repr, at most
    ``limit`` characters (and then its length)."""
    quote = isinstance(text, str)
    text = text if quote else repr(text)
    if len(text) <= limit:
        return repr(text) if quote else text
    head = repr(text[:limit]) if quote else text[:limit]
    return f"{head}... ({len(text):,} characters)"


def _fmt(value: Number) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def describe_range(kind: type, low: Number | None, high: Number | None, low_open: bool = False,
                   high_open: bool = False) -> str:
    """``an integer in 1..1,000,000``, ``a finite number > 0 and <= 100,000``, ..."""
    what = "an integer" if kind is int else "a finite number"
    if low is not None and high is not None and not (low_open or high_open):
        return f"{what} in {_fmt(low)}..{_fmt(high)}"
    parts = ([f"{'>' if low_open else '>='} {_fmt(low)}"] if low is not None else []) + \
        ([f"{'<' if high_open else '<='} {_fmt(high)}"] if high is not None else [])
    return f"{what} {' and '.join(parts)}" if parts else what


def parse_number(kind: type, text: str) -> Number:
    """``text`` as an int (digits, optional sign) or a float; ``ValueError`` when it is not one."""
    text = text.strip()
    if kind is int:
        if len(text.lstrip("+-")) > MAX_DIGITS:
            raise ValueError("too many digits")
        return int(text)
    return float(text)


def bounded(kind: type, low: Number | None = None, high: Number | None = None, *,
            low_open: bool = False, high_open: bool = False) -> Callable[[str], Number]:
    """An argparse ``type=``: ``kind`` (int or float), finite, ``low <= value <= high`` (strict with
    ``low_open`` / ``high_open``). Every refusal is one ``argparse.ArgumentTypeError`` naming value and range."""
    if kind not in (int, float):
        raise TypeError(f"bounded() takes int or float, not {kind!r}")
    allowed = describe_range(kind, low, high, low_open, high_open)

    def parse(text: str) -> Number:
        try:
            value = parse_number(kind, text)
        except (ValueError, TypeError):
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{shown(text)} is not {what}; give {allowed}") from None
        below = low is not None and (value <= low if low_open else value < low)
        above = high is not None and (value >= high if high_open else value > high)
        if (kind is float and not math.isfinite(value)) or below or above:
            raise argparse.ArgumentTypeError(f"{shown(text)} is out of range; give {allowed}")
        return value

    parse.__name__ = f"bounded_{kind.__name__}"
    return parse
