"""A view: one corrupted copy of prompt ++ response, the unit every likelihood estimator produces.

``tokens`` is the model input x_t; ``coef`` and ``slot`` say which positions are scored, with which coefficient
c_{v,k}, and into which slot (a quantity the objective puts in a ratio: a token or a whole sequence) each scored
position's log-prob adds. Corruption samplers (corruption.py) and trace replay (trace_replay.py) return
views; algos/base.py lays them out as training rows.
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class View:
    """One corrupted copy of prompt ++ response (possibly cut after ``length`` positions)."""

    tokens: torch.Tensor  # [n] model input x_t (n <= P + L)
    coef: torch.Tensor  # [n] float, c_{v,k} (0 where not scored)
    slot: torch.Tensor  # [n] long, slot of each scored position (-1 = not scored)
    labels: Optional[torch.Tensor] = None  # [n] targets when not the response itself (MDPO's intermediate x0)
    adv: Optional[torch.Tensor] = None  # [n] advantages when they differ per view (MDPO's step advantages)


_ARRAY_CODE = {torch.long: "q", torch.float32: "f", torch.float64: "d"}


def list_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` for a flat list of Python numbers, through a C array (~4x faster on
    short lists: rows and views are built from lists per sample per step); the same values (a float is rounded to
    float32 as torch rounds it), a tensor of its own."""
    code = _ARRAY_CODE.get(dtype)
    if code is None or not values:
        return torch.tensor(values, dtype=dtype)
    return torch.frombuffer(array.array(code, values), dtype=dtype)
