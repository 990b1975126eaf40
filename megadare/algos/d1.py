"""d1 / diffu-GRPO (Zhao, Gupta, Zheng, Grover, arXiv:2504.12216; code: dllm-reasoning/d1 ``diffu_grpo``).

Estimator (one-step mean-field): the whole response is masked, each prompt token is masked with probability
p_prompt (a fresh draw per inner iteration -- ``rl.ppo_epochs`` epochs each draw their own, ``rl.redraw_corruptions``
-- stored with the batch so old, reference and current log-probs share it), one forward:

    log pi(y_k | c) ~= log p_theta(y_k | c', M ... M)

Objective: token-level GRPO with a k3 KL to a reference model,

    L = -(1 / sum_i |y_i|) sum_i sum_k [ min(rho_ik A_i, clip(rho_ik, 1 - eps, 1 + eps) A_i) - beta KL3_ik ].

Defaults as published (``diffu-grpo/slurm_scripts/train.yaml``): eps 0.5, beta 0.04, p_prompt 0.15, G 6,
mu 12 inner updates (DARE runs 1), lr 3e-6, temperature 0.9. Rollout contract: final sequences only.

What it scores on block families: the view is laid out x_t ++ x_0 (algos/base.py), so each response block is
scored from the clean earlier blocks with all of its own tokens masked -- one step per block, not per response --
and the prompt masking reaches only the prompt tokens sharing the response's first block. The estimate is not
the log-probability the sampler drew a token with (it commits a block's tokens over several steps, later ones
with earlier ones visible), which is why the k3 KL is capped as verl and DARE cap it (algos/policy_loss.py): on
the demo (4 steps per block, lr 5e-4) the uncapped k3 at 0.04 let tokens the estimate finds unlikely but the
reference does not dominate the gradient -- the KL climbed to 1-3 nats per token and held-out accuracy fell back
from 0.58-0.78 (steps 10-20) to 0.29-0.45 at step 30 over 4 rollout seeds, answers drifting to neither copy nor
reversal (55 of 100 at 0.45) while the one-step-per-block decode d1 optimises was 94% right. Capped: 0.88-1.00;
without KL (DARE's recipe) 0.98-0.99; uncapped but decoding each block in one step (the sampler = the estimate) 1.00.

Canvas (``rl.canvas``): DARE's d1 masks, scores and normalises the whole LLaDA/Dream canvas of R positions
(post-EOS tokens included): ``full``, those families' default; block families use ``eos``.
"""

from __future__ import annotations

from megadare.algos.algorithm import Algorithm
from megadare.diffusion.corruption import CleanSequence, one_step


class D1(Algorithm):
    name = "d1"
    redraw_corruptions = True
    defaults = {"eps_low": 0.5, "kl_coef": 0.04, "kl_anchor": "ref", "kl_estimator": "k3", "p_prompt": 0.15}

    def views(self, s, arch, block_size, g):
        return one_step(
            CleanSequence.of(s.prompt_ids, s.response_ids, arch.mask_token_id), g, p_prompt=self.p["p_prompt"]
        )
