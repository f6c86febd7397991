"""Command-line value types shared by the roles' parsers."""

import argparse


def seconds(text: str) -> float:
    """A positive, finite number of seconds (NaN, inf and 0 would disable a timeout)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < 1e6:
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return value
