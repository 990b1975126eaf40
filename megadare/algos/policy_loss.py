"""Policy-gradient losses and KL estimators shared by the algorithm zoo.

All functions are elementwise over "slots" (a token, or a sequence for sequence-level estimators): ``logp`` is
the current log-likelihood estimate of the slot, ``old`` its value under the behaviour / old policy (computed
before the update on the same corruptions), ``adv`` its advantage.

PPO clip (Schulman et al., arXiv:1707.06347), asymmetric (DAPO's clip-higher, arXiv:2503.14476) and dual-clip
(Ye et al., arXiv:1912.09729; verl's ``clip_ratio_c``):

    rho = exp(logp - old)            (log-ratio clamped to +-``log_ratio_clamp`` first, as dLLM-RL's +-10)
    l   = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)
    l   = min(l, -c A)  for A < 0     (dual clip, c > 1; off when c is None)

``clip_surrogate`` is that objective on a given ratio (BGPO's bound surrogates r, JustGRPO's token ratios),
``ppo_clip_loss`` builds rho from log-probs first; ``check_dual_clip`` validates the ``algo.params.dual_clip``
every PPO-clip algorithm takes (DARE's ``clip_ratio_c``, 3.0 in its recipes; off by default here).

KL estimators of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman, "Approximating KL divergence"),
with d = logp_ref - logp:   k1 = -d,   k2 = d^2 / 2,   k3 = min(exp(d) - d - 1, 10)  (>= 0; GRPO's choice).

k3 as verl (``low_var_kl``) and DARE (``kl_penalty``) compute it: d clamped to +-20, the estimate to 10, so a
slot whose reference probability exceeds ~13.5x its current estimate (d > 2.6) adds 10 and no gradient. Unclamped
(TRL, d1's own trainer), k3's gradient weight 1 - exp(d) is unbounded, and it is unbounded in expectation too when
``logp`` is not the log-probability the sampler drew the token with -- d1's one-step estimate, Coupled-GRPO's:
on the demo (30 steps at lr 5e-4, 4 denoising steps per block) d1 at its published KL 0.04 rose to 0.58-0.78
held out and fell back to 0.29-0.45 by step 30 over 4 rollout seeds, its KL climbing to 1-3 nats per token;
clamped it ends at 0.88-1.00. ``kl_penalty(..., k3_bound=None)`` is the plain k3 (a metric: verl's ``k3_kl``).
DARE's ``kl_penalty`` is that k3 only where A <= 0: for A > 0 it puts log(1 + logp - logp_ref) in place of the
log-ratio (BGPO's linearised ratio, "# kl = diff  # TODO" beside it), in every actor that imports it, d1's and
Coupled-GRPO's too; NaN once logp - logp_ref <= -1 at any response position, whereupon the actor skips the update
(non-finite grad norm). Its recipes leave the KL off; megadare keeps k3 for every sign (tests/test_dare_live_actors.py
runs DARE's d1 actor with it on: the same gradient for A <= 0, the skipped update for A > 0).

``k3_exp10`` is k3 as dLLM-RL computes it (``train/rl_trado.py:749-754``, TraceRL and random-masking RL):
exp(clamp(d, +-10)) - d - 1, the linear term not clamped and the estimate not bounded, so a slot with d > 2.6 keeps
its gradient 1 - exp(d) (to -e^10).

``k3_plain`` is the plain k3, exp(d) - d - 1, nothing clamped: DARE's d-TreeRPO actor computes it inline
(``llada_dp_actor_dtreerpo.py::update_policy``, Dream's inherits it), whatever its recipe's ``kl_loss_type``
(``low_var_kl``) says, so d-TreeRPO's DARE preset uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megadare.errors import ConfigError

KL_ESTIMATORS = ("k1", "k2", "k3", "k3_exp10", "k3_plain")
K3_BOUND = 10.0  # verl's low_var_kl / DARE's kl_penalty (module docstring)


def check_dual_clip(dual_clip: Optional[float]) -> None:
    """``algo.params.dual_clip`` is null (off) or a number c > 1."""
    if dual_clip is not None and not (isinstance(dual_clip, (int, float)) and dual_clip > 1.0):
        raise ConfigError(
            f"algo.params.dual_clip={dual_clip!r} must be a number > 1 (DARE uses 3.0) or null to disable"
        )


def clip_surrogate(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-slot loss, per-slot clipped indicator) of the clipped surrogate on ``ratio`` (module docstring)."""
    check_dual_clip(dual_clip)
    eps_high = eps_low if eps_high is None else eps_high
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = torch.maximum(unclipped, clipped)
    was_clipped = (clipped > unclipped).float()
    if dual_clip is not None:
        capped = torch.minimum(loss, -dual_clip * adv)
        loss = torch.where(adv < 0, capped, loss)
    return loss, was_clipped


@dataclass(frozen=True)
class PPOClip:
    """The PPO ratio's clip: [1 - eps_low, 1 + eps_high] (eps_high None: eps_low), the dual clip on negative
    advantages (None: off) and the bound on |log rho| before the exponential."""

    eps_low: float = 0.2
    eps_high: Optional[float] = None
    dual_clip: Optional[float] = None
    log_ratio_clamp: float = 20.0


def ppo_clip_loss(
    logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, clip: PPOClip = PPOClip()
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-slot loss, per-slot clipped indicator) with rho = exp(clamp(logp - old))."""
    ratio = torch.exp((logp - old).clamp(-clip.log_ratio_clamp, clip.log_ratio_clamp))
    return clip_surrogate(ratio, adv, clip.eps_low, clip.eps_high, clip.dual_clip)


def kl_penalty(
    logp: torch.Tensor, ref: torch.Tensor, kind: str = "k3", k3_bound: Optional[float] = K3_BOUND
) -> torch.Tensor:
    """Per-slot estimate of KL(pi_theta || pi_ref) (differentiable in ``logp``); k3 capped at ``k3_bound``."""
    d = ref - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        d = d.clamp(-20.0, 20.0)
        k3 = torch.exp(d) - d - 1.0
        return k3 if k3_bound is None else k3.clamp(max=k3_bound)
    if kind == "k3_exp10":
        return torch.exp(d.clamp(-10.0, 10.0)) - d - 1.0
    if kind == "k3_plain":
        return torch.exp(d) - d - 1.0
    raise ValueError(f"algo.params.kl_estimator={kind!r} unknown; choose one of {KL_ESTIMATORS}")
