"""A module that reads a variable when imported, as Ray reads RAY_AUTH_MODE (tests/test_parallel_cpu.py)."""

from __future__ import annotations

import os

SEEN = os.environ.get("MEGADARE_TEST_LATE")


def seen_at_import(rank: int, world: int):
    return SEEN
