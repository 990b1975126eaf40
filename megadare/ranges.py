"""Intervals written as text (``"[0, 1)"``, ``"(0, inf)"``): the one reading of them that the config's field
bounds (config/loading.py ``RANGES``) and the algorithms' hyper-parameter bounds (algos ``PARAM_RANGES``) share.
On the ground floor of the import layers with errors.py: it imports nothing, so the config reads it torch-free."""

from __future__ import annotations


def in_range(v: float, bounds: str) -> bool:
    """Whether ``v`` lies within ``bounds``, an interval written "[lo, hi)" ("[" / "]" inclusive, "inf" allowed)."""
    lo, hi = (float(x) for x in bounds[1:-1].split(","))
    return (v >= lo if bounds[0] == "[" else v > lo) and (v <= hi if bounds[-1] == "]" else v < hi)
