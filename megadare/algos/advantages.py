"""Advantages from group rewards, and the group filters of the RL loop. Shared by every algorithm.

Rewards come in groups of G responses to one prompt (``rewards`` is [N] with N = n_prompts * G, grouped
contiguously). With r_i the reward of response i in its group g:

* ``grpo`` (DeepSeekMath, arXiv:2402.03300; d1, DARE/verl):   A_i = (r_i - mean_g r) / (std_g r + eps)
  ``std='unbiased'`` (verl, torch.std), ``'population'`` (dLLM-RL's z-score: divided by the std itself, no eps;
  a group of equal rewards gets 0), ``'none'`` (Dr. GRPO,
  arXiv:2503.20783; DiffuCoder's ``scale_rewards: false``): A_i = r_i - mean_g r.
* ``rloo`` (Ahmadian et al., arXiv:2402.14740):   A_i = r_i - (sum_g r - r_i) / (G - 1)
* ``reinforce_pp`` (REINFORCE++-baseline, arXiv:2501.03262) as verl computes it
  (``core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage``): a_i = r_i - mean_g r (a group of one
  keeps a_i = r_i), then whitened over every response token of the batch (``verl_F.masked_whiten``): with n_i
  the response's token count and N = sum_i n_i,

      mu = sum_i n_i a_i / N,   var = [sum_i n_i (a_i - mu)^2 / N] * N / (N - 1),   A_i = (a_i - mu) / sqrt(var + 1e-8)

  (token-weighted mean and Bessel-corrected variance over tokens; verl's masked_mean adds 1e-8 to N). Responses
  of dropped groups (``filter_groups``) get n_i = 0: verl filters before computing advantages.

A group of one response has no group baseline: ``grpo`` gives A = 0 (verl: A = r), ``rloo`` is refused; the
config check refuses ``rl.n_samples=1`` with either for algorithms that train on these advantages, and with
``rloo`` for every algorithm, since the rollout computes it each step (``Algorithm.check_config``).

``filter_groups`` implements the dynamic-sampling filters: drop groups whose rewards are all equal (no learning
signal under a group baseline) and groups whose accuracy lies outside a band (dLLM-RL keeps 0.2..0.8).
``truncated_as_wrong`` zeroes the reward of responses that hit the length limit (dLLM-RL, DAPO's overlong).
"""

from __future__ import annotations

from typing import Optional

import torch

ADVANTAGES = ("grpo", "rloo", "reinforce_pp")
STDS = ("unbiased", "population", "none")


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if group_size < 1 or r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not split into groups of rl.n_samples={group_size}")
    return r.view(-1, group_size)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    kind: str = "grpo",
    std: str = "unbiased",
    eps: float = 1e-6,
    lengths: Optional[list[int]] = None,
) -> torch.Tensor:
    """Per-response advantages [N] (float32) from rewards [N] grouped contiguously by prompt; ``lengths``: the
    responses' token counts (``reinforce_pp`` weighs by them; 0 leaves a response out of the statistics)."""
    if kind not in ADVANTAGES:
        raise ValueError(f"advantage.estimator={kind!r} unknown; choose one of {ADVANTAGES}")
    if std not in STDS:
        raise ValueError(f"advantage.std={std!r} unknown; choose one of {STDS}")
    g = _groups(rewards, group_size)
    G = g.shape[1]
    if kind == "rloo":
        if G < 2:
            raise ValueError("rloo needs at least 2 responses per prompt (rl.n_samples >= 2)")
        adv = g - (g.sum(1, keepdim=True) - g) / (G - 1)
        return adv.flatten().float()
    if kind == "reinforce_pp":
        return reinforce_pp_baseline(g, lengths)
    adv = g - g.mean(1, keepdim=True)
    if std == "population":  # dLLM-RL's z_score_normalize (reward/rl_reward.py:74-79): no eps, 0 for a flat group
        s = g.std(1, unbiased=False, keepdim=True)
        adv = torch.where(s > 0, adv / torch.where(s > 0, s, 1.0), 0.0)
    elif std != "none":
        s = g.std(1, unbiased=True, keepdim=True) if G > 1 else torch.zeros_like(g[:, :1])
        adv = adv / (s + eps)
    return adv.flatten().float()


def reinforce_pp_baseline(groups: torch.Tensor, lengths: Optional[list[int]]) -> torch.Tensor:
    """verl's REINFORCE++-baseline (module docstring) from rewards [n_groups, G] and token counts [N]."""
    if lengths is None or len(lengths) != groups.numel():
        raise ValueError(
            f"advantage.estimator=reinforce_pp whitens over response tokens: give the token counts of all "
            f"{groups.numel()} responses (got {None if lengths is None else len(lengths)})"
        )
    a = (groups - groups.mean(1, keepdim=True) if groups.shape[1] > 1 else groups).flatten()
    n = torch.as_tensor(lengths, dtype=torch.float64)
    N = float(n.sum())
    if N == 0:  # every group dropped: nothing trains on these
        return torch.zeros(groups.numel())
    if N < 2:
        raise ValueError(
            f"advantage.estimator=reinforce_pp: {N:.0f} response tokens in the batch, the whitening variance needs at least 2"
        )
    mean = (a * n).sum() / (N + 1e-8)
    var = ((a - mean) ** 2 * n).sum() / (N + 1e-8) * (N / (N - 1))
    return ((a - mean) * torch.rsqrt(var + 1e-8) * (n > 0)).float()


def all_equal_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Mask [n_groups]: the groups whose rewards are all equal (zero advantage under a group baseline: they teach
    nothing, and a run where every group is so cannot learn)."""
    g = _groups(rewards, group_size)
    return (g.max(1).values - g.min(1).values) == 0


def filter_groups(
    rewards: torch.Tensor,
    group_size: int,
    drop_all_equal: bool = False,
    accuracy_band: Optional[tuple[float, float]] = None,
) -> torch.Tensor:
    """Keep-mask [N] over responses: whole groups are dropped or kept."""
    g = _groups(rewards, group_size)
    keep = torch.ones(g.shape[0], dtype=torch.bool)
    if drop_all_equal:
        keep &= ~all_equal_groups(g.flatten(), group_size)
    if accuracy_band is not None:
        lo, hi = accuracy_band
        acc = g.mean(1)
        keep &= (acc >= lo) & (acc <= hi)
    return keep.repeat_interleave(group_size)


def truncated_as_wrong(rewards: torch.Tensor, truncated: torch.Tensor, wrong: float = 0.0) -> torch.Tensor:
    """Rewards with those of truncated responses (hit max length) replaced by ``wrong``.

    dLLM-RL counts wrong every response of length >= max_gen_length - 5 (``reward/rl_reward.py:98-101``), one that
    ended with its EOS 3 tokens short of the limit too; megadare asks the engine (finish_reason "length"): its
    response lengths are exact, and the 5-token slack would punish correct answers the sampler finished. Kept
    on purpose (tests/test_dllm_rl_source.py ``test_live_dllm_rl_counts_near_limit_responses_wrong``)."""
    r = torch.as_tensor(rewards, dtype=torch.float32).clone()
    r[torch.as_tensor(truncated, dtype=torch.bool)] = wrong
    return r
