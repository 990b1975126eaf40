"""Policy-gradient losses and KL estimators shared by the algorithm zoo.

All functions are elementwise over "slots" (a token, or a sequence for sequence-level estimators): ``logp`` is
the current log-likelihood estimate of the slot, ``old`` its value under the behaviour / old policy (computed
before the update on the same corruptions), ``adv`` its advantage.

PPO clip (Schulman et al., arXiv:1707.06347), asymmetric (DAPO's clip-higher, arXiv:2503.14476) and dual-clip
(Ye et al., arXiv:1912.09729; verl's ``clip_ratio_c``):

    rho = exp(logp - old)            (log-ratio clamped to +-``log_ratio_clamp`` first, as dLLM-RL's +-10)
    l   = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)
    l   = min(l, -c A)  for A < 0     (dual clip, c > 1; off when c is None)

KL estimators of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman, "Approximating KL divergence"),
with d = logp_ref - logp:   k1 = -d,   k2 = d^2 / 2,   k3 = exp(d) - d - 1  (unbiased, >= 0; GRPO's choice).
"""
from __future__ import annotations

from typing import Optional

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def ppo_clip_loss(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, eps_low: float = 0.2,
                  eps_high: Optional[float] = None, dual_clip: Optional[float] = None,
                  log_ratio_clamp: float = 20.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-slot loss, per-slot clipped indicator)."""
    eps_high = eps_low if eps_high is None else eps_high
    log_ratio = (logp - old).clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = torch.maximum(unclipped, clipped)
    was_clipped = (clipped > unclipped).float()
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"rl.dual_clip={dual_clip} must be > 1 (or null to disable)")
        capped = torch.minimum(loss, -dual_clip * adv)
        loss = torch.where(adv < 0, capped, loss)
    return loss, was_clipped


def kl_penalty(logp: torch.Tensor, ref: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-slot estimate of KL(pi_theta || pi_ref) (differentiable in ``logp``)."""
    d = ref - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        d = d.clamp(-20.0, 20.0)
        return torch.exp(d) - d - 1.0
    raise ValueError(f"rl.kl_estimator={kind!r} unknown; choose one of {KL_ESTIMATORS}")
