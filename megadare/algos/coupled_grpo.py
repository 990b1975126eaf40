"""Coupled-GRPO (DiffuCoder, Gong et al., arXiv:2506.20639; code: apple/ml-diffucoder ``coupled_grpo.py``).

Estimator (coupled / antithetic masks): t ~ U(0.2, 0.8) and one uniform u per response token give three views
-- a: the whole response masked; b: tokens with u < t masked; c: the complement (u >= t). Every token is masked
in exactly one of b, c, so the pair covers the response once (lower variance than independent masks):

    l_k = 1/2 [ log f^a_k + w_k log f^{b|c}_k ],   w_k = 1/t if k is masked in b else 1/(1 - t).

Objective: token-level GRPO (as d1) on rho_k = exp(l_k - l_k^old), k3 KL to the reference model.
Defaults (``recipes/config_coupled_code.yaml``): G 10, mu 2, eps 0.5, beta 0.01, rewards not std-scaled
(``advantage.std=none``), temperature 1.0, prompt never masked.

Masks are per sample: t and u come from a generator seeded per (seed, step, sample), stored in the rows so the
old, reference and current passes see the same views. DARE's ``_forward_process_coupled_grpo`` calls
``set_seed(42)`` on every call (``dllm_core_algos.py:925``), so its t is always 0.58366 and its u one fixed
pattern for every sample of every step (and the global RNGs restart after each call); that is not copied here:
one mask pattern for all samples removes the Monte-Carlo averaging across samples the estimator relies on.

Canvas (``rl.canvas``): DARE's Coupled-GRPO corrupts, scores and normalises the full LLaDA/Dream canvas (``full``,
those families' default); block families use ``eos``.
"""

from __future__ import annotations

from megadare.algos.algorithm import Algorithm
from megadare.diffusion.corruption import CleanSequence, coupled


class CoupledGRPO(Algorithm):
    name = "coupled_grpo"
    defaults = {"eps_low": 0.5, "kl_coef": 0.01, "kl_anchor": "ref", "kl_estimator": "k3", "t_low": 0.2, "t_high": 0.8}

    def views(self, s, arch, block_size, g):
        seq = CleanSequence.of(s.prompt_ids, s.response_ids, arch.mask_token_id)
        return coupled(seq, g, self.p["t_low"], self.p["t_high"])
