"""MDPO: masked diffusion policy optimisation (He, Renz, Cao, Geiger, arXiv:2508.13148; code:
autonomousvision/mdpo; DARE ``trainer/ppo/mdpo_algos.py``, ``workers/actor/llada_dp_actor_mdpo.py``,
``workers/rollout/mdpo_llada_rollout.py``).

Rollout contract: for every denoising step (forward) t the engine records its proposal x0 at the response
positions it predicted (``step_predictions``, -1 elsewhere) and their confidences (``step_confidences``); the
state x_t before the step follows from the commit steps. Every intermediate answer is scored: r_t =
reward(a_t), a_t = the tokens committed before t, the step's proposals where they were still masked, cut at the
first position the step did not predict.

Advantage (``compute_step_wise_advantage``): s_t = (r_t - r_{t-1}) + 1 + mean_{t' > t} r_{t'} (the last step uses
r_T, r_{-1} = 0), GRPO-normalised per step across the prompt's group. With ``rl.n_samples=1`` each response keeps
s_t / (1 + 1e-6), as in DARE (a uid of one: mean 0, std 1, verl's rule), whatever ``advantage.estimator`` says
(MDPO's advantages are its own); a larger group left with one response (an empty one dropped) gets 0, as does a
step only one response's trace reaches (DARE's traces never differ in length). Steps kept for training
(``select_top_k_steps``): ``top_k_scope=batch`` (DARE) the K step indices with the largest sum over the whole
batch of |A_t|, the same steps for every sample; ``sample`` (an option) each sample's own K steps by |A_t|.
K = 16 in DARE, 8 in the paper.

Loss (``compute_mdpo_policy_loss``): at step t, for the positions M_t still masked in x_t that the step
predicted, the ratio of the model's probability of the intermediate prediction, rho = p_theta(x0_{t,k} | x_t) /
p_old(x0_{t,k} | x_t), PPO-clipped (eps 0.2; dual clip when ``dual_clip`` is set), weighted by the confidence
c_{t,k} and lambda_t = L / |M_t|, averaged over the positions (Σ / |M_t|) and over the sample's K_s kept steps:

    L = -(1/K_s) sum_t lambda_t / |M_t| sum_{k in M_t} c_{t,k} min(rho A_t, clip(rho, 1 +- eps) A_t)

Semi-autoregressive blocks (DARE's recipe: LLaDA block 32, R = 512): any block size works. On LLaDA and Dream
a step predicts every masked position of the canvas, later blocks included, from its one full forward, as DARE's
``mdpo_llada_rollout.py`` does: a_t is the whole predicted answer and M_t every masked position (the built-in
engine samples the later blocks apart from the block it commits in: ``dllm_step.propose``). Block-causal
families (SDAR, LLaDA2) cannot see later blocks: their a_t stops after the current block. The recorded
confidence c_{t,k} is the proposal's probability under the sampling distribution (temperature, top-k / top-p),
DARE's. Deviations (stated): lambda uses the sample's length L (= R with ``rl.canvas=full``); one optimizer step
per RL step (DARE's verl mini-batches give about K). DARE's presets (examples/configs/dare/mdpo_*.yaml) decode as
its MDPO rollouts: LLaDA ranks by the tempered p(x0) (``rollout.confidence=maskgit_plus``), Dream decodes one
block over the response with entropy ranking and its own schedule (``rollout.schedule=linspace_remaining``).

Why the demo (reverse a 3-letter string, SDAR block 4) once unlearned (0.28 -> 0.16): the prompt's last 3
tokens share the first response block, so the response spans two blocks, and the recorded proposals were
indexed as if the block started at the response (every intermediate answer and target shifted by the prompt
remainder). Proposals are now placed on response positions by the engine (``rollout/decoders.py``).
Defaults (paper): lr 7e-7, temperature 0.4.

Canvas (``rl.canvas``): DARE's MDPO rollouts keep the full LLaDA/Dream canvas (``full``, those families' default).
"""

from __future__ import annotations

from typing import Callable

import torch

from megadare.algos.algorithm import Algorithm, rows_for_views
from megadare.algos.base import RLSample
from megadare.diffusion.masking import mask_tokens
from megadare.diffusion.views import View
from megadare.errors import ConfigError

TOP_K_SCOPES = ("batch", "sample")


def step_scores(rewards: list[float]) -> list[float]:
    """s_t = (r_t - r_{t-1}) + 1 + mean_{t' > t} r_{t'} (last step: + r_T)."""
    T = len(rewards)
    out = []
    for t in range(T):
        prev = rewards[t - 1] if t > 0 else 0.0
        future = sum(rewards[t + 1 :]) / (T - t - 1) if t < T - 1 else rewards[-1]
        out.append((rewards[t] - prev) + 1.0 + future)
    return out


def intermediate_answer(response: list[int], commit_step: list[int], prediction: list[int], t: int) -> list[int]:
    """a_t: committed tokens (commit step < t) and step t's proposals elsewhere, up to the first position step t
    did not predict (-1) that was not committed yet."""
    out = []
    for tok, step, pred in zip(response, commit_step, prediction):
        if step < t:
            out.append(tok)
        elif pred >= 0:
            out.append(pred)
        else:
            break
    return out


def top_steps(samples: list[RLSample], k: int, scope: str) -> None:
    """``extra['steps']`` of every sample: the K steps with the largest |A_t| over the batch (same indices for
    all samples, DARE's ``select_top_k_steps``; a sample keeps those it has) or per sample."""
    if scope == "sample":
        for s in samples:
            adv = s.extra.get("step_adv", {})
            s.extra["steps"] = sorted(adv, key=lambda t: -abs(adv[t]))[:k]
        return
    importance: dict[int, float] = {}
    for s in samples:
        for t, a in s.extra.get("step_adv", {}).items():
            importance[t] = importance.get(t, 0.0) + abs(a)
    chosen = set(sorted(importance, key=lambda t: (-importance[t], t))[:k])
    for s in samples:
        s.extra["steps"] = sorted(t for t in s.extra.get("step_adv", {}) if t in chosen)


class MDPO(Algorithm):
    name = "mdpo"
    needs_trace = True
    needs_step_predictions = True
    defaults = {"eps_low": 0.2, "top_k_steps": 16, "top_k_scope": "batch", "loss_agg": "seq_mean_token_sum"}

    def __init__(self, overrides=None):
        super().__init__(overrides)
        if self.p["top_k_scope"] not in TOP_K_SCOPES:
            raise ConfigError(f"algo.params.top_k_scope={self.p['top_k_scope']!r}: choose one of {TOP_K_SCOPES}")

    def prepare(
        self, samples: list[RLSample], score: Callable[[list[list[int]], list[int]], list[float]], group_size: int
    ) -> None:
        """Per-step rewards, GRPO-normalised step advantages and the kept steps (``score(responses, indices)``)."""
        for s in samples:
            preds = s.extra.get("step_predictions")
            if preds is None:
                raise ValueError("mdpo needs per-step predictions (the rollout sets record_steps)")
            answers = [intermediate_answer(s.response_ids, s.commit_step, pred, t) for t, pred in enumerate(preds)]
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
                if group_size == 1:  # DARE's uid grouping: a group of one keeps its scores (mean 0, std 1)
                    a = v / (1.0 + 1e-6)
                elif len(have) > 1:
                    a = (v - v.mean()) / (v.std(unbiased=True) + 1e-6)
                else:  # a group left with one response (an empty one dropped) or one trace reaching step t: 0
                    a = v * 0
                for m, x in zip(have, a.tolist()):
                    m.extra.setdefault("step_adv", {})[t] = x
        top_steps(samples, self.p["top_k_steps"], self.p["top_k_scope"])

    def uses_group_baseline(self) -> bool:
        return False  # its step-wise advantages (prepare), never advantage.estimator's; a group of one keeps s_t

    def _views_and_weights(self, s: RLSample, arch) -> tuple[list[View], dict[int, float]]:
        if "steps" not in s.extra:
            raise ValueError("mdpo: call prepare() on the samples first (step rewards and advantages)")
        P, L = len(s.prompt_ids), len(s.response_ids)
        x0 = torch.tensor(list(s.prompt_ids) + list(s.response_ids))
        commit = torch.tensor([-1] * P + list(s.commit_step))
        views, weights = [], {}
        K = max(len(s.extra["steps"]), 1)
        for j, t in enumerate(sorted(s.extra["steps"])):
            pred = torch.tensor(list(s.prompt_ids) + list(s.extra["step_predictions"][t]))
            masked = commit >= t
            scored = masked & (pred >= 0)
            n_scored = int(scored.sum())
            if n_scored == 0:
                continue
            conf = torch.tensor([0.0] * P + list(s.extra["step_confidences"][t]))
            slot = torch.where(scored, j * L + torch.arange(P + L) - P, torch.full((P + L,), -1))
            for i in scored.nonzero().flatten().tolist():  # lambda_t / |M_t| * confidence, averaged over steps
                weights[int(slot[i])] = (L / n_scored) / n_scored * float(conf[i]) / K
            views.append(
                View(
                    tokens=mask_tokens(x0, masked, arch.mask_token_id),
                    coef=scored.float(),
                    slot=slot,
                    labels=torch.where(scored, pred, x0),
                    adv=torch.full((P + L,), float(s.extra["step_adv"][t])),
                )
            )
        return views, weights

    def views(self, s, arch, block_size, g):
        return self._views_and_weights(s, arch)[0]

    def rows(self, s, arch, block_size, g):
        """Each (step, token) is its own slot, weighted by its step's scale and confidence; denominator 1 per
        sample."""
        self.check_sample(s)
        views, weights = self._views_and_weights(s, arch)
        return rows_for_views(s, views, arch, "", weights, 1.0) if views else []
