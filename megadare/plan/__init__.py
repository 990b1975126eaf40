"""``megadare plan``: parameter counts and per-GPU memory of a training / RL layout, before anything starts.

    report = plan(cfg, arch)          # pure: PlanReport (report.as_dict() for JSON)
    print(format_report(report))

params.py counts parameters (whole model, active per token, per GPU), memory.py the trainer's weights,
gradients, optimizer states and activations (megatron DistributedOptimizer accounting; Korthikanti et al. 2022
activation formulas), report.py the rollout engines and the verdict, advise.py which knob to turn when it does
not fit, table.py the printed plan. Every formula is in its module's docstring.
"""

from __future__ import annotations

import sys
from typing import Optional

from megadare.config import Config
from megadare.models.family import ModelArch
from megadare.plan.params import ParamCounts, count_params, rank_params
from megadare.plan.advise import plan
from megadare.plan.report import PlanReport
from megadare.plan.table import format_report

__all__ = ["ParamCounts", "PlanReport", "count_params", "format_report", "plan", "rank_params", "run_plan_command"]


def run_plan_command(cfg: Config, arch: Optional[ModelArch]) -> int:
    """Print the plan table; 0 when it fits, 1 when it does not (DOES NOT FIT), 2 without a model."""
    if arch is None:
        print(
            "megadare: error: megadare plan needs a model: set model.hf_path to a directory holding config.json "
            "(e.g. examples/configs/hf/SDAR-30B-A3B) or model.family",
            file=sys.stderr,
        )
        return 2
    report = plan(cfg, arch)
    print(format_report(report))
    return 0 if report.fits else 1
