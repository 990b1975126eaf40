"""Value types of command-line options (argparse ``type=``): a count or a size outside its range is argparse's
one-line usage error (``megadare: error: argument --nproc: 0 must be a positive integer``), not a default taken
in its place or a traceback later. Shared by ``megadare``'s own parser (cli.py) and the demo's (demo.py)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """A count (steps, processes, records): a positive integer (0 would mean 'the default' or 'none')."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text} must be a positive integer")
    return n


def positive_number(text: str) -> float:
    """A size: a finite number > 0 (``--max-shard-gb`` 0 or less wrote one shard per tensor; nan / inf raised)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return x
