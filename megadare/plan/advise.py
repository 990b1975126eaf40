"""Which knob to turn when a plan does not fit, with its estimated effect.

Every candidate is one config change that the model and the GPU count allow (``Layout.check_model``); the plan is
recomputed with it and the change in the fullest GPU's memory is its estimated effect. Candidates are listed
cheapest first (by the cost stated with each), fitting ones before the rest. When no single change fits, the
changes are chained greedily (largest saving first, up to ``MAX_STEPS``) and the chain is reported too.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from megadare.config import Config
from megadare.errors import ConfigError
from megadare.models.family import ModelArch
from megadare.plan.memory import GIB, QUADRATIC
from megadare.plan.report import PlanReport, plan_memory

MAX_STEPS = 10
Change = dict[str, Any]


def _set(cfg: Config, changes: Change) -> Config:
    new = copy.deepcopy(cfg)
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(new, section), name, value)
    return new


def _candidates(cfg: Config, arch: ModelArch, bottleneck: str) -> list[tuple[Change, str]]:
    """(changes, cost) pairs, cheapest first."""
    p, t, pl = cfg.parallel, cfg.train, cfg.plan
    out: list[tuple[Change, str]] = []
    if bottleneck == "rollout":
        tp = cfg.rollout.engine_tp
        if tp * 2 <= pl.gpus_per_node:
            out.append(({"rollout.engine_tp": tp * 2}, "fewer, wider rollout engines"))
        if pl.rollout_batch > 1:
            out.append(({"plan.rollout_batch": pl.rollout_batch // 2}, "fewer concurrent rollouts per engine"))
        if pl.rollout_gpus == 0:
            out.append(({"plan.rollout_gpus": pl.gpus_per_node}, "engines on GPUs of their own (fewer for training)"))
    if not cfg.optim.distributed_optimizer:
        out.append(({"optim.distributed_optimizer": True}, "none (optimizer state sharded over DP)"))
    if p.tp > 1 and not p.sp:
        out.append(({"parallel.sp": True}, "none (same communication volume as TP)"))
    if t.recompute == "none" and cfg.model.attention_backend in QUADRATIC:
        out.append(({"train.recompute": "selective"}, "a few % compute (core attention recomputed)"))
    if arch.is_moe:
        out.append(({"parallel.ep": p.ep * 2}, "more expert all-to-all traffic"))
    if t.micro_batch_size > 1:
        out.append(({"train.micro_batch_size": t.micro_batch_size // 2}, "smaller GEMMs, more micro-batches"))
    if t.recompute != "full":
        out.append(({"train.recompute": "full"}, "~33% more compute (one extra forward)"))
    tp_change: Change = {"parallel.tp": p.tp * 2, "parallel.sp": True}
    if arch.is_moe and p.ep > 1:  # experts keep their split; only the dense layers widen
        tp_change["parallel.etp"] = p.tp if p.etp is None else p.etp
    out.append((tp_change, f"TP all-reduces every layer; keep tp <= plan.gpus_per_node={pl.gpus_per_node}"))
    out.append(({"parallel.pp": p.pp * 2}, "pipeline bubble ~ (pp-1)/micro-batches"))
    out.append(({"parallel.cp": p.cp * 2}, "all-to-all of attention heads every layer"))
    out.append(({"plan.nodes": pl.nodes * 2}, "twice the GPUs (optimizer state over twice the DP ranks)"))
    return out


def _try(cfg: Config, arch: ModelArch, changes: Change) -> Optional[Any]:
    new = _set(cfg, changes)
    if new.parallel.tp > new.plan.gpus_per_node:
        return None
    if new.train.seq_length % new.parallel.cp:
        return None
    try:
        return plan_memory(new, arch)
    except ConfigError:
        return None


def _describe(changes: Change) -> str:
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changes.items())


def advise_knobs(cfg: Config, arch: ModelArch, report: PlanReport) -> list[dict[str, Any]]:
    """Single changes that lower the peak (fitting ones first, cheapest first), then a greedy chain if needed."""
    base = report.peak
    options = []
    for order, (changes, cost) in enumerate(_candidates(cfg, arch, report.bottleneck)):
        new = _try(cfg, arch, changes)
        if new is None or new.peak >= base - 0.01 * GIB:
            continue
        options.append(
            {
                "change": _describe(changes),
                "peak_gb": round(new.peak / GIB, 2),
                "saves_gb": round((base - new.peak) / GIB, 2),
                "fits": new.fits,
                "cost": cost,
                "_order": order,
            }
        )
    options.sort(key=lambda o: (not o["fits"], o["_order"] if o["fits"] else -o["saves_gb"]))
    for o in options:
        del o["_order"]
    if options and not options[0]["fits"]:
        chain = _greedy(cfg, arch)
        if chain is not None:
            options.insert(0, chain)
    return options


def _greedy(cfg: Config, arch: ModelArch) -> Optional[dict[str, Any]]:
    """Apply the largest single saving repeatedly until the plan fits; None when it never does."""
    applied: Change = {}
    current = plan_memory(cfg, arch)
    start = current.peak
    for _ in range(MAX_STEPS):
        best = None
        for changes, _cost in _candidates(_set(cfg, applied), arch, current.bottleneck):
            new = _try(cfg, arch, {**applied, **changes})
            if new is not None and new.peak < current.peak - 0.01 * GIB and (best is None or new.peak < best[1].peak):
                best = (changes, new)
        if best is None:
            return None
        applied.update(best[0])
        current = best[1]
        if current.fits:
            return {
                "change": _describe(applied),
                "peak_gb": round(current.peak / GIB, 2),
                "saves_gb": round((start - current.peak) / GIB, 2),
                "fits": True,
                "cost": "combined: each change's cost",
            }
    return None


def plan(cfg: Config, arch: ModelArch, advise: bool = True) -> PlanReport:
    """The memory plan of ``cfg`` for ``arch``; when it does not fit (and ``advise``), the knobs that fix it."""
    report = plan_memory(cfg, arch)
    if advise and not report.fits:
        report.advice = advise_knobs(cfg, arch, report)
    return report
