"""The RL algorithm zoo: ``REGISTRY[name](overrides)`` builds an algorithm (chosen by ``algo.name``).

Each file states its paper, objective, estimator and published defaults; shared parts live in base.py
(samples, rows, slots), advantages.py and policy_loss.py; the views, corruption samplers and trace replay they
draw on are in megadare/diffusion/.
"""

from __future__ import annotations

import importlib

from megadare.algos.algorithm import Algorithm
from megadare.names import ALGORITHMS, check_algorithm_name

# built from the torch-free name table (megadare/names.py), the one list of the algorithms: the config layer
# refuses an unknown algo.name from it before torch loads
REGISTRY: dict[str, type[Algorithm]] = {
    name: getattr(importlib.import_module(module), cls) for name, (module, cls) in ALGORITHMS.items()
}


def build_algorithm(name: str, overrides: dict | None = None) -> Algorithm:
    check_algorithm_name(name)
    return REGISTRY[name](overrides)
