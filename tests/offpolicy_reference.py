"""Token-level reference forms of the off-policy PPO objectives (trainer/offpolicy/importance.py's docstring):
decoupled PPO (Hilton et al., AReaL) and verl's bypass mode, ``reinforce`` included. Training does not use them:
``offpolicy.loss_mode`` reaches the algorithms' slot losses through ``algos/base.py``'s ``SlotObjective``;
tests/test_rollout_correction.py checks these forms against AReaL's / verl's formulas and ``SlotObjective``
against these forms."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

from megadare.algos.policy_loss import PPOClip, ppo_clip_loss
from megadare.trainer.offpolicy.importance import RolloutIS, rollout_is_weights

BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


@dataclass(frozen=True)
class OffPolicyLoss:
    """The PPO objective against off-policy rollouts: the ratio clip (``eps_low`` / ``eps_high`` / ``dual_clip``,
    as ``policy_loss.ppo_clip_loss``), the behaviour weight ``rollout_is`` and, for bypass mode, ``loss_type``
    (``ppo_clip`` or ``reinforce``). In a loss ``rollout_is.threshold_high=None`` turns the behaviour weight off
    (only the veto remains; AReaL's ``rejection_sampling=None``), ``float('inf')`` gives the untruncated weight;
    ``rollout_is.log_clamp`` clamps every log-ratio of the loss (the PPO ratio's too)."""

    eps_low: float = 0.2
    eps_high: Optional[float] = None
    dual_clip: Optional[float] = None
    rollout_is: RolloutIS = RolloutIS()
    loss_type: str = "ppo_clip"

    def __post_init__(self) -> None:
        if self.loss_type not in BYPASS_LOSS_TYPES:
            raise ValueError(f"bypass loss_type={self.loss_type!r} unknown; choose one of {BYPASS_LOSS_TYPES}")

    def ppo_clip(self, logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ppo_clip_loss(
            logp, old, adv, PPOClip(self.eps_low, self.eps_high, self.dual_clip, self.rollout_is.log_clamp)
        )


def _weights_or_identity(
    target_logp: torch.Tensor, behaviour_logp: torch.Tensor, group_ids: Optional[torch.Tensor], setting: RolloutIS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(detached IS weights, keep mask) of ``rollout_is_weights``, or (ones, all kept) when neither a threshold nor
    a veto is set; ``threshold_high=None`` with a veto means no cap (only the veto)."""
    if setting.threshold_high is None and setting.veto_threshold is None:
        return torch.ones_like(target_logp).detach(), torch.ones_like(target_logp, dtype=torch.bool)
    if setting.threshold_high is None:
        setting = replace(setting, threshold_high=math.inf)
    w, keep, _ = rollout_is_weights(target_logp, behaviour_logp, group_ids, setting)
    return w, keep


def decoupled_ppo_loss(
    logp: torch.Tensor,
    proximal_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    adv: torch.Tensor,
    loss: OffPolicyLoss = OffPolicyLoss(),
    group_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO (Hilton et al., arXiv:2110.00641; AReaL arXiv:2505.24298): (per-element loss, parts).

        L_k = -w_k * min(r_k A_k, clip(r_k, 1 - eps_low, 1 + eps_high) A_k),   r_k = exp(logp_k - prox_k),
        w_k = sg(min(exp(prox_k - behave_k), is_threshold))

    Followed: AReaL ``areal/utils/functional/functional.py::ppo_actor_loss_fn`` (``logprobs`` = logp,
    ``proximal_logprobs`` = proximal, ``old_logprobs`` = behaviour; the behaviour weight comes from
    ``apply_rejection_sampling``: ``action="clamp"`` is ``mode="truncate"``, ``action="mask"`` is
    ``mode="mask"``) and verl's decoupled mode (``docs/algo/rollout_corr_math.md`` 3.1.1: IS on
    rollout -> old, PPO clip on old -> current). The PPO part is ``policy_loss.ppo_clip_loss`` (same
    ``eps_high`` / ``dual_clip`` / log-ratio clamp), multiplied by w; w is built by ``rollout_is_weights`` on
    (proximal, behaviour) with ``loss.rollout_is`` (level, mode, thresholds, veto) and ``group_ids``.
    ``loss.rollout_is.threshold_high=None`` turns the behaviour weight off (w = 1, or 0 on vetoed sequences;
    AReaL's ``rejection_sampling=None``); ``float('inf')`` gives the untruncated weight.

    Returns the per-element loss (aggregate it with the slot weights, as ``SlotObjective`` does: rejected
    elements add 0 to the numerator and stay in the denominator, AReaL's choice; verl's ``agg_loss`` divides by
    the kept tokens instead) and per-element detached parts: ``clipped``, ``behave_weight``, ``behave_keep``,
    ``ppo_ratio``. Batch summaries of the behaviour weights: ``rollout_is_weights(proximal, behaviour, ...)[2]``.
    The gradient w.r.t. ``logp`` is -w A r inside the clip range and 0 where the clipped branch is active.
    """
    if not (logp.shape == proximal_logp.shape == behaviour_logp.shape == adv.shape):
        raise ValueError("decoupled_ppo_loss: logp, proximal_logp, behaviour_logp and adv must have one shape")
    prox = proximal_logp.detach()
    per_elem, clipped = loss.ppo_clip(logp, prox, adv)
    w, keep = _weights_or_identity(prox, behaviour_logp, group_ids, loss.rollout_is)
    only_veto = loss.rollout_is.threshold_high is None
    w = keep.to(per_elem.dtype) if only_veto else w.to(per_elem.dtype)  # None: only the veto
    clamp = loss.rollout_is.log_clamp
    ratio = torch.exp((logp.detach() - prox).clamp(-clamp, clamp))
    parts = {"clipped": clipped, "behave_weight": w, "behave_keep": keep.to(per_elem.dtype), "ppo_ratio": ratio}
    return w * per_elem, parts


def bypass_ppo_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    adv: torch.Tensor,
    loss: OffPolicyLoss = OffPolicyLoss(),
    group_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bypass mode (verl ``core_algos.py::compute_policy_loss_bypass_mode``): pi_prox := mu, one ratio against
    the behaviour policy, no proximal forward. (per-element loss, parts).

    * ``loss.loss_type="ppo_clip"`` (verl's default): L = -keep * min(r A, clip(r) A), r = exp(logp - behave)
      (``ppo_clip_loss``). No IS weight is applied -- the PPO ratio already is pi_theta / mu, applying w too
      would double-count (verl comment) -- but the rejection mask is: with ``mode="mask"`` (and/or a veto)
      elements whose ratio pi_theta / mu falls outside the bounds get keep = False (verl's RS via the response
      mask). ``mode="truncate"`` leaves keep = True except for vetoed sequences.
    * ``loss.loss_type="reinforce"`` (``compute_policy_loss_reinforce``): L = -sg(w) * logp * A with
      w = rollout_is_weights(logp, behave) (truncated, or masked with rejected elements at 0).

    ``loss.rollout_is.threshold_high=None``: no weight / no rejection (plain PPO against mu, or plain
    REINFORCE). Equals ``decoupled_ppo_loss`` with proximal = behaviour (then w_prox = 1) for ``ppo_clip`` with
    truncate mode. Parts: ``clipped`` (ppo_clip only), ``is_weight``, ``keep`` (detached, per element).
    """
    if not (logp.shape == behaviour_logp.shape == adv.shape):
        raise ValueError("bypass_ppo_loss: logp, behaviour_logp and adv must have one shape")
    behave = behaviour_logp.detach()
    w, keep = _weights_or_identity(logp, behave, group_ids, loss.rollout_is)
    w = w.to(logp.dtype)
    keep_f = keep.to(logp.dtype)
    if loss.loss_type == "ppo_clip":
        per_elem, clipped = loss.ppo_clip(logp, behave, adv)
        return keep_f * per_elem, {"clipped": clipped, "is_weight": w, "keep": keep_f}
    if loss.rollout_is.threshold_high is None:
        w = keep_f  # no IS weight, only the veto
    return -w * logp * adv, {"is_weight": w, "keep": keep_f}
