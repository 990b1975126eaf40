"""The RL algorithm zoo: ``REGISTRY[name](overrides)`` builds an algorithm (chosen by ``algo.name``).

Each file states its paper, objective, estimator and published defaults; shared parts live in base.py
(samples, rows, slots), advantages.py and policy_loss.py; the views, corruption samplers and trace replay they
draw on are in megadare/diffusion/.
"""

from __future__ import annotations

from megadare.algos.algorithm import Algorithm
from megadare.errors import ConfigError
from megadare.algos.bgpo import BGPO
from megadare.algos.cj_grpo import CJGRPO
from megadare.algos.coupled_grpo import CoupledGRPO
from megadare.algos.d1 import D1
from megadare.algos.d_treerpo import DTreeRPO
from megadare.algos.ebpo import EBPO
from megadare.algos.espo import ESPO
from megadare.algos.justgrpo import JustGRPO
from megadare.algos.mdpo import MDPO
from megadare.algos.random_mask_rl import RandomMaskRL
from megadare.algos.spg import SPG
from megadare.algos.tracerl import TraceRL
from megadare.algos.vrpo import VRPO

REGISTRY: dict[str, type[Algorithm]] = {
    cls.name: cls
    for cls in (D1, CoupledGRPO, RandomMaskRL, TraceRL, CJGRPO, BGPO, EBPO, SPG, VRPO, MDPO, DTreeRPO, JustGRPO, ESPO)
}


def build_algorithm(name: str, overrides: dict | None = None) -> Algorithm:
    if name not in REGISTRY:
        raise ConfigError(f"algo.name={name!r} unknown; choose one of {sorted(REGISTRY)}")
    return REGISTRY[name](overrides)
