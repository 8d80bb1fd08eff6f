"""argparse types with ranges for the example scripts' flags: a bad value exits with a message
naming the flag and the value (argparse prefixes "argument --flag: ")."""

from __future__ import annotations

import argparse
import math


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def int_at_least(minimum: int):
    """An int type accepting values >= minimum."""

    def parse(text: str) -> int:
        value = _int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        return value

    parse.__name__ = f"int >= {minimum}"  # argparse's "invalid <name> value" fallback
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def group_size(text: str) -> int:
    """A quantization group size: a positive int, or -1 for one group per output row."""
    value = _int(text)
    if value != -1 and value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be positive, or -1 (one group per row)")
    return value


def non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def probability_mass(text: str) -> float:
    """A nucleus mass in (0, 1]."""
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} must be in (0, 1]")
    return value
