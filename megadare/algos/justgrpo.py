"""JustGRPO (Ni et al., "The Flexibility Trap: Why Arbitrary Order Limits Reasoning Potential in Diffusion Language
Models", arXiv:2601.15165; code LeapLabTHU/JustGRPO; DARE ``workers/actor/llada_dp_actor_justgrpo.py``,
``recipe/llada/run_justgrpo_llada_8b_instruct.sh``).

Rollout contract: a full-attention dLLM (LLaDA, Dream) decodes in autoregressive order -- semi-AR blocks of one
token, one step each (``rollout.block_size=1 rollout.steps_per_block=1``): at step t the model sees the prompt c,
the tokens y_<t sampled so far and masks at every later canvas position, and samples y_t from softmax(f_t / T)
(DARE draws it with Gumbel-max noise, the same distribution; the built-in engine never proposes the mask token).

Estimator: the exact likelihood of that sampler, one view per response position,

    l_t = log softmax(f_theta(c ++ y_<t ++ M ... M)_t / T)[y_t],        T = the rollout temperature,

temperature-scaled like the sampler (the rows carry 1/T and the mask token, which the trainer leaves out of the
normaliser as the sampler does: trainer/logprob.py) -- so at ratio 1 the trainer's l_t equals the engine's
recorded log-prob of y_t (checked in tests/test_rl_algorithms_train.py). DARE keeps M in the normaliser because
its sampler can draw M; the difference is log(1 - p(M)), negligible for a trained model.

Objective: token-level GRPO with PPO clip (eps 0.2) and dual clip (c = 3) for A < 0, token mean over the batch,
GRPO advantages (mean / std), no KL, one optimizer step per RL step (DARE's recipe: T 0.6, 16 prompts x 8,
lr 5e-7, canvas R = 512 with R steps).

Canvas: the paper and DARE score the full canvas (``rl.canvas=full``, LLaDA's default): the masks after y_t are
every later canvas position, EOS/pad tokens after the answer are decoded, scored and counted. With
``rl.canvas=eos`` the views end at the first EOS, so the trainer's states hold fewer trailing masks than the
sampler's and l_t is no longer the sampler's likelihood.
"""

from __future__ import annotations

import torch

from megadare.algos.algorithm import Algorithm, rows_for_views
from megadare.algos.base import RLSample
from megadare.diffusion.corruption import CleanSequence, ar_views
from megadare.errors import ConfigError


class JustGRPO(Algorithm):
    name = "justgrpo"
    defaults = {"eps_low": 0.2, "dual_clip": 3.0, "kl_coef": 0.0, "loss_agg": "token_mean"}

    def check_config(self, cfg, arch) -> None:
        super().check_config(cfg, arch)
        r = cfg.rollout
        if arch is not None and arch.is_block_diffusion:
            raise ConfigError(
                f"algo.name=justgrpo decodes one token per block; the {arch.family} family is "
                "block diffusion with the model's block size: use a full-attention family (llada, dream)"
            )
        if r.block_size != 1 or (r.steps_per_block or 1) != 1:
            raise ConfigError(
                f"algo.name=justgrpo samples in autoregressive order: set rollout.block_size=1 "
                f"rollout.steps_per_block=1 (got {r.block_size}, {r.steps_per_block})"
            )
        if r.temperature <= 0 or r.top_k or r.top_p != 1.0:
            raise ConfigError(
                f"algo.name=justgrpo scores the sampler's tempered softmax: need rollout.temperature > "
                f"0, top_k=0, top_p=1 (got {r.temperature}, {r.top_k}, {r.top_p})"
            )

    def views(self, s, arch, block_size, g):
        return ar_views(CleanSequence.of(s.prompt_ids, s.response_ids, arch.mask_token_id))

    def rows(self, s: RLSample, arch, block_size, g):
        T = s.extra.get("sampling_temperature")
        if not T or T <= 0:
            raise ValueError(
                f"sample {s.index}: justgrpo scores at the rollout temperature, but the sample records "
                f"{T!r} (greedy or unknown sampling)"
            )
        views = self.views(s, arch, block_size, g)
        rows = rows_for_views(s, views, arch, self.p["loss_agg"]) if views else []
        for r in rows:
            r.extras["logit_scale"] = torch.full((len(r),), 1.0 / float(T))
            r.extras["excluded_token"] = torch.full((len(r),), arch.mask_token_id, dtype=torch.long)
        return rows
