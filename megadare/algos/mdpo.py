"""MDPO: masked diffusion policy optimisation (He, Renz, Cao, Geiger, arXiv:2508.13148; code:
autonomousvision/mdpo; DARE ``trainer/ppo/mdpo_algos.py``, ``workers/actor/llada_dp_actor_mdpo.py``).

Rollout contract: for every denoising step t the engine records the model's full prediction x0_t of the
response (``step_predictions``) and the per-token confidences (``step_confidences``); the state x_t before the
step follows from the commit steps. Every intermediate answer is scored: r_t = reward(x0_t).

Advantage (``compute_step_wise_advantage``): s_t = (r_t - r_{t-1}) + 1 + mean_{t' > t} r_{t'} (the last step uses
r_T, r_{-1} = 0), GRPO-normalised per step across the prompt's group; the K steps with the largest |A| are kept
(K = 16 in DARE, 8 in the paper).

Loss (``compute_mdpo_policy_loss``): at step t, for the tokens still masked in x_t, the ratio of the model's
probability of the intermediate prediction, rho = p_theta(x0_{t,k} | x_t) / p_old(x0_{t,k} | x_t), PPO-clipped
(eps 0.2), weighted by the confidence c_{t,k} and scaled by lambda_t = L_max / |masked_t|, divided by |masked_t|:

    L = -(1/K) sum_t lambda_t / |M_t| sum_{k in M_t} c_{t,k} min(rho A_t, clip(rho, 1 +- eps) A_t)

Defaults (paper): lr 7e-7, temperature 0.4, one block over the whole answer. This file needs the whole response
in one block (``rollout.block_size >= rollout.max_new_tokens``) so that x0_t is a complete answer.

Canvas (``rl.canvas``): DARE's MDPO rollouts keep the full LLaDA/Dream canvas (``full``, those families' default).
"""
from __future__ import annotations

from typing import Callable

import torch

from megadare.algos.algorithm import Algorithm, rows_for_views
from megadare.algos.base import RLSample, View
from megadare.diffusion.masking import mask_tokens


def step_scores(rewards: list[float]) -> list[float]:
    """s_t = (r_t - r_{t-1}) + 1 + mean_{t' > t} r_{t'} (last step: + r_T)."""
    T = len(rewards)
    out = []
    for t in range(T):
        prev = rewards[t - 1] if t > 0 else 0.0
        future = sum(rewards[t + 1:]) / (T - t - 1) if t < T - 1 else rewards[-1]
        out.append((rewards[t] - prev) + 1.0 + future)
    return out


class MDPO(Algorithm):
    name = "mdpo"
    paper = "arXiv:2508.13148"
    needs_trace = True
    needs_step_predictions = True
    defaults = {"eps_low": 0.2, "top_k_steps": 16, "loss_agg": "seq_mean_token_sum"}

    def prepare(self, samples: list[RLSample], score: Callable[[list[list[int]], list[int]], list[float]],
                group_size: int) -> None:
        """Per-step rewards and GRPO-normalised step advantages (``score(responses, sample indices)``)."""
        for s in samples:
            preds = s.extra.get("step_predictions")
            if preds is None:
                raise ValueError("mdpo needs per-step predictions (the rollout sets record_steps)")
            L = len(s.response_ids)
            steps = torch.tensor(s.commit_step)
            answers = []
            for t, pred in enumerate(preds):
                cur = torch.tensor(pred[:L])
                answers.append(torch.where(steps < t, torch.tensor(s.response_ids), cur).tolist())
            s.extra["step_rewards"] = score(answers, [s.index] * len(answers))
            s.extra["step_scores"] = step_scores(s.extra["step_rewards"])
        groups: dict[int, list[RLSample]] = {}
        for s in samples:
            groups.setdefault(s.group, []).append(s)
        for members in groups.values():
            T = max(len(m.extra["step_scores"]) for m in members)
            for t in range(T):
                have = [m for m in members if t < len(m.extra["step_scores"])]
                v = torch.tensor([m.extra["step_scores"][t] for m in have], dtype=torch.float64)
                a = (v - v.mean()) / (v.std(unbiased=True) + 1e-6) if len(have) > 1 else v * 0
                for m, x in zip(have, a.tolist()):
                    m.extra.setdefault("step_adv", {})[t] = x
        for s in samples:
            adv = s.extra.get("step_adv", {})
            s.extra["steps"] = sorted(adv, key=lambda t: -abs(adv[t]))[: self.p["top_k_steps"]]

    def _views_and_weights(self, s: RLSample, arch) -> tuple[list[View], dict[int, float]]:
        if "steps" not in s.extra:
            raise ValueError("mdpo: call prepare() on the samples first (step rewards and advantages)")
        P, L = len(s.prompt_ids), len(s.response_ids)
        x0 = torch.tensor(list(s.prompt_ids) + list(s.response_ids))
        commit = torch.tensor([-1] * P + list(s.commit_step))
        views, weights = [], {}
        K = len(s.extra["steps"])
        for j, t in enumerate(sorted(s.extra["steps"])):
            masked = commit >= t
            n_masked = int(masked.sum())
            if n_masked == 0:
                continue
            pred = torch.tensor(list(s.prompt_ids) + list(s.extra["step_predictions"][t][:L]))
            conf = [0.0] * P + list(s.extra["step_confidences"][t][:L])
            slot = torch.where(masked, j * L + torch.arange(P + L) - P, torch.full((P + L,), -1))
            for i in masked.nonzero().flatten().tolist():  # lambda_t / |M_t| * confidence, averaged over steps
                weights[int(slot[i])] = (L / n_masked) / n_masked * conf[i] / K
            views.append(View(tokens=mask_tokens(x0, masked, arch.mask_token_id), coef=masked.float(), slot=slot,
                              labels=torch.where(masked, pred, x0),
                              adv=torch.full((P + L,), float(s.extra["step_adv"][t]))))
        return views, weights

    def views(self, s, arch, block_size, g):
        return self._views_and_weights(s, arch)[0]

    def rows(self, s, arch, block_size, g):
        """Each (step, token) is its own slot, weighted by its step's scale and confidence; denominator 1 per
        sample."""
        self.check_sample(s)
        views, weights = self._views_and_weights(s, arch)
        return rows_for_views(s, views, arch, "", weights, 1.0) if views else []
