"""The algorithm base class: an RL algorithm states its estimator (views), its objective (slot loss), its rollout
contract and its published defaults; a new algorithm is one small file overriding what differs.

Hyper-parameters resolve as: the algorithm's ``defaults`` (as published), then the non-null keys of the config
section ``algo`` and its ``algo.params`` dict. Unknown ``algo.params`` keys are errors naming the valid ones.

The default objective is the token-level clipped policy gradient shared by most of the zoo (GRPO form):

    L = sum_s w_s [ -min(rho_s A_s, clip(rho_s, 1 - eps_low, 1 + eps_high) A_s) + beta KL_k(pi_theta || anchor) ]
        / sum w,      rho_s = exp(l_s - l_s^old)

with l_s the algorithm's likelihood estimate of slot s (algos/base.py) and the KL anchor named by the algorithm
(the reference model, the old policy, or none).
"""

from __future__ import annotations

import difflib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

import torch

from megadare.algos.base import (
    LOSS_AGG,
    STEP_WIDTH,
    RLSample,
    SampleColumns,
    SlotObjective,
    Slots,
    aggregation,
    views_to_row,
)
from megadare.algos.policy_loss import KL_ESTIMATORS, PPOClip, check_dual_clip, kl_penalty, ppo_clip_loss
from megadare.errors import ConfigError
from megadare.ranges import in_range
from megadare.models.family import ModelArch
from megadare.data.rows import Row
from megadare.diffusion.views import View

COMMON = {
    "eps_low": 0.2,
    "eps_high": None,
    "dual_clip": None,
    "kl_coef": 0.0,
    "kl_estimator": "k3",
    "kl_anchor": "none",
    "loss_agg": "token_mean",
    "log_ratio_clamp": 20.0,
}


# {parameter: (range, what it is)}: a value outside is refused in one line when the algorithm is built; a parameter
# an algorithm does not have is not checked here ("[" / "]" inclusive bounds)
PARAM_RANGES: dict[str, tuple[str, str]] = {
    "eps_low": (
        "[0, 1)",
        "the ratio is clipped below at 1 - eps_low; negative inverts the clip range, 1 or more clips at a ratio <= 0 "
        "(a ratio is > 0), so never",
    ),
    "eps_high": ("[0, inf)", "the ratio is clipped above at 1 + eps_high; negative inverts the clip range"),
    "kl_coef": ("[0, inf)", "a negative KL coefficient rewards drifting from the anchor"),
    "log_ratio_clamp": ("(0, inf)", "0 clamps every log-ratio to 0, so every ratio is 1"),
    "n_mc": ("[1, inf)", "Monte-Carlo masks per response"),
    "n_views": ("[0, inf)", "masked views per response; 0 / null: the family's default"),
    "top_k_steps": ("[1, inf)", "steps scored per response"),
    "block": ("[1, inf)", "tokens per block"),
    "root_fanout": ("[0, inf)", "responses drawn at the root; 0 / null: from rl.n_samples"),
    "shrink": ("[0, inf)", "decoding steps per replayed fragment; 0 / null: the family's default"),
    "p_low": ("(0, 1]", "the lowest mask ratio; 0 masks (and scores) nothing"),
    "p_high": ("(0, 1]", "the highest mask ratio"),
    "t_low": ("[0, 1]", "the lowest mask ratio"),
    "t_high": ("(0, 1]", "the highest mask ratio"),
    "p_prompt": ("[0, 1)", "the prompt's mask probability"),
    "mix": ("[0, 1]", "a mixing weight"),
    "eubo_beta": ("(0, inf)", "the EUBO's log-sum-exp temperature"),
    "beta": ("(0, inf)", "the preference temperature; 0 makes the loss constant"),
    "value_lr": ("(0, inf)", "the value model's learning rate"),
    "value_clip": ("(0, inf)", "the value loss's clip"),
    "gamma": ("[0, 1]", "the discount"),
    "lam": ("[0, 1]", "the GAE lambda"),
}
PARAM_ORDER = (("p_low", "p_high"), ("t_low", "t_high"))  # pairs that bound one range: low <= high


def check_params(name: str, resolved: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Each resolved hyper-parameter of algorithm ``name``: the type of its published default (a number where a
    number goes: finite; an integer where an integer goes; true / false where a switch goes), within
    ``PARAM_RANGES``, and the low / high pairs in order; else one ConfigError line naming the key and the fix."""
    for k, v in resolved.items():
        d = defaults.get(k)
        if v is None or d is None or isinstance(d, str):
            continue
        wants = "true or false" if isinstance(d, bool) else "an integer" if isinstance(d, int) else "a finite number"
        is_number = isinstance(v, (int, float)) and not isinstance(v, bool)
        ok = (
            isinstance(v, bool)
            if isinstance(d, bool)
            else is_number and math.isfinite(v) and (not isinstance(d, int) or float(v).is_integer())
        )
        if not ok:
            raise ConfigError(f"algo.params.{k}={v!r}: {name}'s {k} is {wants} (its default: {d!r})")
    for k, (bounds, what) in PARAM_RANGES.items():
        if resolved.get(k) is not None and not in_range(resolved[k], bounds):
            raise ConfigError(f"algo.params.{k}={resolved[k]} must be within {bounds} ({what})")
    for lo, hi in PARAM_ORDER:
        if lo in resolved and resolved[lo] > resolved[hi]:
            raise ConfigError(
                f"algo.params.{lo}={resolved[lo]} > algo.params.{hi}={resolved[hi]}: the range is inverted; swap them"
            )


def rows_for_views(
    s: RLSample,
    views: list[View],
    arch: ModelArch,
    loss_agg: str,
    slot_weight: dict[int, float] | None = None,
    denom: float | None = None,
) -> list[Row]:
    """Rows of one sample's views: one row when a slot spans several views (its estimate sums over them and
    must see them in one micro-batch), else one row per view (shorter rows pack better)."""
    per_view = [set(int(x) for x in v.slot.tolist() if x >= 0) for v in views]
    if slot_weight is None or denom is None:
        slot_weight, denom = aggregation(loss_agg, per_view, len(s.response_ids), s.extra.get(STEP_WIDTH))
    shared = sum(len(x) for x in per_view) != len(set().union(*per_view)) if per_view else False
    cols = SampleColumns(s)  # one sample's shared columns, for each of its rows
    if shared:
        return [views_to_row(s, views, arch, slot_weight, denom, cols)]
    return [views_to_row(s, [v], arch, slot_weight, denom if i == 0 else 0.0, cols) for i, v in enumerate(views)]


@dataclass(frozen=True)
class ValueModelSettings:
    """A learned value baseline trained beside the policy (TraceRL's, algos/value_model.py): its own optimizer's
    learning rate, the value loss's clip and the step-level GAE's gamma and lambda."""

    lr: float
    clip: float
    gamma: float
    lam: float


class Algorithm(ABC):
    name: ClassVar[str] = ""
    needs_trace: ClassVar[bool] = False  # rollout contract: commit steps per token
    replays_edits: ClassVar[bool] = False  # its trace replay scores token edits (superseded commits)
    needs_step_predictions: ClassVar[bool] = False
    lse_beta: ClassVar[str | None] = None  # parameter name of a log-sum-exp slot estimate (SPG's EUBO)
    redraw_corruptions: ClassVar[bool] = False  # epochs draw fresh corruptions (default of rl.redraw_corruptions)
    clipped_ratio: ClassVar[bool] = True  # a PPO-clip objective (takes eps_low / eps_high / dual_clip)
    own_rollout: ClassVar[bool] = False  # builds its rollout itself in dependent rounds (``rollout``)
    defaults: ClassVar[dict[str, Any]] = {}  # published defaults, algorithm-specific keys included

    def __init__(self, overrides: dict[str, Any] | None = None):
        resolved = dict(COMMON)
        resolved.update(self.defaults)
        for k, v in (overrides or {}).items():
            if k not in resolved:
                close = difflib.get_close_matches(str(k), list(resolved), n=1, cutoff=0.75)
                hint = f"did you mean algo.params.{close[0]}? " if close else ""
                raise ConfigError(
                    f"algo.params.{k}: {self.name} has no parameter {k!r}; {hint}valid: {sorted(resolved)}"
                )
            if v is not None:
                resolved[k] = v
        if resolved["loss_agg"] is not None and resolved["loss_agg"] not in LOSS_AGG:
            raise ConfigError(f"algo.params.loss_agg={resolved['loss_agg']!r} unknown; choose one of {LOSS_AGG}")
        if resolved["kl_anchor"] not in ("ref", "old", "none"):
            raise ConfigError(f"algo.params.kl_anchor={resolved['kl_anchor']!r}: choose ref, old or none")
        if resolved["kl_estimator"] not in KL_ESTIMATORS:
            raise ConfigError(
                f"algo.params.kl_estimator={resolved['kl_estimator']!r} unknown; choose one of {KL_ESTIMATORS}"
            )
        check_params(self.name, resolved, {**COMMON, **self.defaults})
        check_dual_clip(resolved["dual_clip"])
        if resolved["dual_clip"] is not None and not self.clipped_ratio:
            raise ConfigError(
                f"algo.params.dual_clip={resolved['dual_clip']}: {self.name} has no clipped ratio "
                "(its objective is not PPO-clip); remove the key"
            )
        self.p = resolved

    # ------------------------------------------------------------------ rollout contract
    def check_config(self, cfg: Any, arch: ModelArch | None) -> None:
        """Refuse (ConfigError naming the key) a run config this algorithm cannot train on, before any process
        starts (``validate`` of trainer/checks.py; ``arch`` is None when the model is not known yet)."""
        if self.needs_step_predictions and cfg.rollout.engine != "native":
            raise ConfigError(
                f"algo.name={self.name} scores every intermediate answer and needs the per-step "
                f"predictions only the built-in engine records: set rollout.engine=native (not "
                f"{cfg.rollout.engine})"
            )
        if self.needs_step_predictions and cfg.rollout.full_attention_cache != "none":
            raise ConfigError(
                f"algo.name={self.name} scores each step's prediction of the whole canvas, which only an exact "
                f"forward computes: set rollout.full_attention_cache=none (not {cfg.rollout.full_attention_cache}; "
                "DARE's MDPO rollouts run without a cache too)"
            )
        if cfg.rollout.algorithm == "editing" and self.needs_trace and not self.replays_edits:
            self.refuse_edits()
        n, estimator = cfg.rl.n_samples, cfg.advantage.estimator
        if n < 2 and estimator in ("grpo", "rloo") and self.uses_group_baseline():
            key = cfg.as_written("advantage.estimator")
            raise ConfigError(
                f"rl.n_samples={n} with {key}={estimator}: one response per prompt "
                f"has no group baseline (every advantage would be 0, so {self.name} would never "
                f"learn); set rl.n_samples >= 2, or {key}=reinforce_pp (verl's REINFORCE++-"
                "baseline: a group of one keeps its reward, whitened over the batch)"
            )
        if n < 2 and estimator == "rloo":  # unused by this algorithm, but computed (and refused) every step
            key = cfg.as_written("advantage.estimator")
            raise ConfigError(
                f"rl.n_samples={n} with {key}=rloo: rloo leaves each response out of its group's mean and needs "
                f"rl.n_samples >= 2 ({self.name} does not train on it: set {key}=grpo)"
            )
        if self.p["kl_coef"] > 0 and self.p["kl_anchor"] == "none":  # the objective skips the KL term
            raise ConfigError(
                f"algo.params.kl_coef={self.p['kl_coef']} with algo.params.kl_anchor=none ({self.name}'s default) "
                "penalises nothing: set algo.params.kl_anchor=ref (the reference model) or old, or kl_coef=0"
            )
        r = cfg.rollout
        if n > 1 and r.temperature == 0 and r.alg_temp == 0 and r.algorithm != "random" and self.value_model is None:
            raise ConfigError(
                f"rollout.temperature=0 with rl.n_samples={n}: greedy decoding gives every response of a prompt "
                f"the same tokens and reward, so every group advantage is 0 and {self.name} never learns; set "
                "rollout.temperature > 0 (DARE's recipes: 0.2 to 1.0)"
            )

    def uses_group_baseline(self) -> bool:
        """Whether its advantages are ``advantage.estimator``'s group-relative ones (a value model or a tree of its own
        replaces them)."""
        return True

    def refuse_edits(self) -> None:
        raise ConfigError(
            f"rollout.algorithm=editing: {self.name} rebuilds decoding states from the final tokens "
            "and cannot replay token edits; use another rollout.algorithm or algorithm"
        )

    def check_sample(self, s: RLSample) -> None:
        if self.needs_trace and (s.commit_step is None or s.block_step is None):
            raise ValueError(
                f"{self.name} needs the decoding trace (commit steps) of every response; the rollout "
                "engine returned none"
            )
        if self.needs_trace and s.superseded and not self.replays_edits:
            raise ValueError(
                f"sample {s.index}: {self.name} cannot replay a trace with token edits "
                "(rollout.algorithm=editing); use tracerl or cj_grpo, or another rollout.algorithm"
            )

    def objective(self, on_policy: bool, loss_mode: str = "ppo"):
        """The trainer objective of this algorithm (slots -> loss); ``loss_mode`` see ``SlotObjective``."""
        beta = self.p[self.lse_beta] if self.lse_beta else None
        return SlotObjective(self.slot_loss, on_policy=on_policy, lse_beta=beta, loss_mode=loss_mode)

    def engine_logprobs_match(self, arch: ModelArch) -> bool:
        """Whether the engine's per-token sampler log-probs are this algorithm's own estimator on the same states
        (then ``offpolicy.behaviour_logp=engine`` is allowed): trace replay with one replay state per recorded step."""
        return False

    @property
    def needs_ref(self) -> bool:
        return self.p["kl_anchor"] == "ref" and self.p["kl_coef"] > 0

    @property
    def value_model(self) -> Optional[ValueModelSettings]:
        """The settings of a value model the trainer builds and trains beside the policy, whose values give the
        advantages (TraceRL with ``value_model=true``); None: no value model."""
        return None

    # ------------------------------------------------------------------ rollout and samples (optional hooks)
    def rollout(
        self, generate: Callable, prompts: list[list[int]], params, n_samples: int, global_grid: bool = False
    ) -> list:
        """The step's trajectories when the algorithm builds its rollout itself (``own_rollout``: several
        dependent rounds of ``generate(prompts, params)``, d-TreeRPO's tree); the trainer calls it only then.
        Default: the plain rollout, ``n_samples`` responses per prompt in one round."""
        return generate([q for q in prompts for _ in range(n_samples)], params)

    def samples_from(self, trajectories: list, rewards: list[float], n_samples: int) -> Optional[list[RLSample]]:
        """Training samples of the algorithm's own from the step's scored trajectories (d-TreeRPO: one per tree
        node, local advantages); None (default): the trainer's, one per response with ``advantage.estimator``'s."""
        return None

    def prepare(
        self, samples: list[RLSample], score: Callable[[list[list[int]], list[int]], list[float]], group_size: int
    ) -> None:
        """Completes the step's samples before their rows are built, in place; ``score(responses, indices)``
        rewards other answers of sample ``indices[j]`` (MDPO scores every intermediate answer). Default: nothing."""

    # ------------------------------------------------------------------ estimator
    @abstractmethod
    def views(self, s: RLSample, arch: ModelArch, block_size: int, g: torch.Generator) -> list[View]:
        """The corrupted copies (or replayed states) of one sample whose log-probs make its slot estimates."""

    def rows(self, s: RLSample, arch: ModelArch, block_size: int, g: torch.Generator) -> list[Row]:
        """Training rows of one sample: its views in one row, aggregated per ``loss_agg``."""
        self.check_sample(s)
        views = self.views(s, arch, block_size, g)
        if not views:
            return []
        return rows_for_views(s, views, arch, self.loss_agg(arch))

    def loss_agg(self, arch: ModelArch) -> str:
        """The aggregation of its rows (``base.aggregation``) on this model family: ``loss_agg`` as resolved."""
        return self.p["loss_agg"]

    def batch_rows(self, samples: list[RLSample], arch: ModelArch, block_size: int, generator_for) -> list[Row]:
        """Rows of a mini-batch of samples (``generator_for(index)`` seeds each sample's corruptions).
        Per-sample by default; pairwise objectives (VRPO) override it."""
        rows: list[Row] = []
        for s in samples:
            rows.extend(self.rows(s, arch, block_size, generator_for(s.index)))
        return rows

    # ------------------------------------------------------------------ objective
    def kl_scale(self, s: Slots) -> torch.Tensor | float:
        """Per-slot factor on the KL penalty (1: the estimator of the slot's own log-likelihood estimate)."""
        return 1.0

    def slot_loss(self, s: Slots) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        p = self.p
        clip = PPOClip(p["eps_low"], p["eps_high"], p["dual_clip"], p["log_ratio_clamp"])
        loss, clipped = ppo_clip_loss(s.logp, s.old, s.adv, clip)
        parts = {"clipfrac": clipped, "ratio_dev": (torch.exp(s.logp - s.old) - 1.0).abs().detach()}
        if p["kl_coef"] > 0 and p["kl_anchor"] != "none":
            anchor = s.ref if p["kl_anchor"] == "ref" else s.old
            if anchor is None:
                raise RuntimeError(f"{self.name}: KL to the reference model needs reference log-probs")
            kl = self.kl_scale(s) * kl_penalty(s.logp, anchor, p["kl_estimator"])
            loss = loss + p["kl_coef"] * kl
            parts["kl"] = kl
        return loss, parts
