"""The optimiser settings a resumed run takes from its config, not from its checkpoint.

torch's ``Optimizer.load_state_dict`` gives every param group back the settings it was saved with: megatron's
``max_lr`` / ``min_lr`` (the scheduler computes each step's lr from the group's, not its own), Adam's betas and
eps. A run resumed with another ``optim.lr`` said ``lr 0.003 -> 0.001`` and trained on with 0.003.
"""

from __future__ import annotations

from typing import Any

_SAID = {"betas": "adam betas", "eps": "adam eps"}  # the ones named when they change (the lr ones: the scheduler's)


def _groups(optimizer) -> list[dict[str, Any]]:
    return [g for o in getattr(optimizer, "chained_optimizers", [optimizer]) for g in o.optimizer.param_groups]


def group_settings(optimizer) -> list[dict[str, Any]]:
    """Each param group's settings (all but its parameters and its current lr, which the scheduler sets)."""
    return [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in _groups(optimizer)]


def restore_group_settings(optimizer, settings: list[dict[str, Any]]) -> list[str]:
    """Put ``settings`` (``group_settings`` before the load) back into the loaded param groups; returns
    ``'<setting> <checkpoint's> -> <run's>'`` for the Adam settings that changed."""
    changes: list[str] = []
    for g, mine in zip(_groups(optimizer), settings):
        for key, name in _SAID.items():
            said = any(c.startswith(name + " ") for c in changes)
            if key in mine and g.get(key) != mine[key] and not said:
                changes.append(f"{name} {g.get(key)} -> {mine[key]}")
        g.update(mine)
    return changes
