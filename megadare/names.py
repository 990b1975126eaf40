"""Torch-free name tables that a config is checked against before torch loads: the RL algorithms (``algo.name``)
and the linears LoRA can wrap (``lora.targets``). Each is the one list of its names: megadare.algos builds its
``REGISTRY`` from ``ALGORITHMS`` (tests/test_config_light.py asserts they agree) and models/lora.py wraps
``LORA_TARGETS``; the config layer (megadare/config/) refuses a name outside them without importing either."""

from __future__ import annotations

import difflib

from megadare.errors import ConfigError

# {algo.name: (module, class)}: the module is imported only when the algorithm is built (megadare.algos)
ALGORITHMS: dict[str, tuple[str, str]] = {
    "d1": ("megadare.algos.d1", "D1"),
    "coupled_grpo": ("megadare.algos.coupled_grpo", "CoupledGRPO"),
    "random_mask_rl": ("megadare.algos.random_mask_rl", "RandomMaskRL"),
    "tracerl": ("megadare.algos.tracerl", "TraceRL"),
    "cj_grpo": ("megadare.algos.cj_grpo", "CJGRPO"),
    "bgpo": ("megadare.algos.bgpo", "BGPO"),
    "ebpo": ("megadare.algos.ebpo", "EBPO"),
    "spg": ("megadare.algos.spg", "SPG"),
    "vrpo": ("megadare.algos.vrpo", "VRPO"),
    "mdpo": ("megadare.algos.mdpo", "MDPO"),
    "d_treerpo": ("megadare.algos.d_treerpo", "DTreeRPO"),
    "justgrpo": ("megadare.algos.justgrpo", "JustGRPO"),
    "espo": ("megadare.algos.espo", "ESPO"),
}

# megatron's linears in every family's attention and dense MLP (models/lora.py; MoE experts are never wrapped):
# the families share megatron's layer, so one table serves them all
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def check_algorithm_name(name: str, key: str = "algo.name") -> None:
    """``name`` is an algorithm of ``ALGORITHMS``; else one line naming ``key``, the value and the closest names."""
    if name in ALGORITHMS:
        return
    close = difflib.get_close_matches(str(name), list(ALGORITHMS), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(f'{key}={c}' for c in close)}?" if close else ""
    raise ConfigError(f"{key}={name!r} unknown{hint} (choose one of {', '.join(sorted(ALGORITHMS))})")
