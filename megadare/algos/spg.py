"""SPG: sandwiched policy gradient (Wang et al., arXiv:2510.09541; code: facebookresearch/SPG; DARE
``compute_policy_loss_spg``, ``_forward_process_spg``).

Estimator: block-wise masking (diffusion/corruption.py ``blockwise``): a random response block b, earlier blocks
clean, later ones fully masked, m ~ U{1..|b|} of b's tokens masked, prompt tokens masked w.p. 0.15; ``n_mc``
draws per iteration, each masked token of b weighted by c = n_blocks |b| / (m n_mc). Per token k:

    ELBO_k = sum_m c_m log p_theta(y_k | x_m)                       (lower bound, linear in log-probs)
    EUBO_k = (1/beta) log sum_m c_m p_theta(y_k | x_m)^beta          (Renyi-type upper bound)

Objective (no ratio, no clipping): maximise J = (1/G) sum_i A_i L_i with the sequence mean over tokens of

    L_i = ELBO_i                              if A_i > 0  (raising a lower bound raises the likelihood)
    L_i = w EUBO_i + (1 - w) ELBO_i           if A_i <= 0 (lowering an upper bound lowers it; w = mix)

Defaults (``spg/slurm_scripts/spg_mix/*.sbatch``): beta 1.5 (math), mix w 0.5, n_mc 2, mu 4, no KL, lr 3e-6.

``estimator=dare``: SPG as DARE codes it (corruption.py ``blockwise_dare`` = ``_forward_process_spg`` drawn in
DARE's order, so a generator seeded as DARE's ``seed`` gives DARE's masks; ``llada_dp_actor_spg.py:162-220``,
recipe ``logp_estimation=mix``, mc_num 1). Its masking differs from the paper's: everything before the chosen
block b -- the prompt AND the earlier response blocks -- is masked w.p. p_prompt (DARE masks with ``p_mask_prompt``
over ``~is_mask``, and ``is_mask`` starts at b), m ~ U{1..|b|} of b and all later blocks are masked, and every
masked response token is scored: the earlier blocks' masked tokens too. With n_mc > 1 the blocks come from one
permutation (without replacement; DARE asserts n_mc <= n_blocks, here a fresh permutation continues). With
M_m the masked response tokens of draw m and t_m = |M_m| / L:

    ELBO_i = (1/n_mc) sum_m (1/|M_m|) sum_{k in M_m} log p(y_k | x_m)            (unweighted mean over masked)
    EUBO_i = mean_{k covered} (1/beta) log (1/n_mc) sum_{m: k in M_m} p(y_k | x_m)^beta / t_m

(``mix`` w as above; w = 1 is DARE's ``eubo``, w = 0 its ``elbo``), loss -A_i L_i averaged over sequences
(DARE's ``compute_policy_loss_spg`` weights sequences by their completion length: all R on its full LLaDA canvas,
so the same mean; with ``rl.canvas=eos`` megadare's mean is unweighted). Here a token slot k carries
c = 1 / (n_mc t_m) (the EUBO's weights; its log-sum-exp is EUBO_k) and its linear sum is L x the ELBO's share,
rescaled per slot by |covered| / L (``extras['per_slot_scale']``), so the sequence mean over slots gives ELBO_i
exactly (tests/test_algos_dare_formulas.py: masks identical to DARE's function, loss and gradient equal to its
actor's on the same seeds). Blocks are those of ``block`` from the response start (DARE: the rollout block
length; its ``% completion_num_blocks`` is the identity on the full canvas); for block-causal families the
blocks are the model's on the global grid and later blocks are predicted from the clean earlier blocks (the
x_t ++ x_0 mask): DARE has no SPG for them.

Weights: c is the importance weight of block-wise masking (block picked w.p. 1/n_blocks, m ~ U{1..|b|}), so
sum_m c_m p^beta is an unbiased estimate of E[1[k in S] (n_blocks |b| / m) p(y_k | x_S)^beta], the expectation
inside the EUBO's log. SPG's code (``spg_trainer._get_per_seq_logps``) divides by the masked fraction of the whole
completion instead (later blocks count as masked in its full-attention layout); for block-causal families later
blocks are not visible, so the block-local weight is the one that matches the bound. Tokens no draw covered are
left out of the token mean, as in SPG's ``loss_mask``.

What holds (tests/test_algos_estimators.py, exact enumeration): when the denoiser's conditionals are consistent
(marginals of one joint, the setting of the paper's Rényi bound) ELBO = log p <= EUBO at every block size and
beta in {1, 1.5, 2}; the estimators above are unbiased for the ELBO and for the EUBO's inner expectation, so
(1/beta) log of its mean converges to the bound -- one draw's log of an n_mc-sample mean is biased low, so a
single estimate can fall below log p. For an arbitrary network (inconsistent conditionals) the per-token EUBO
is not guaranteed: on the MLP toy it falls below the order-averaged likelihood in 188 of 1080 cases
(toy 28: -5.339 vs -5.162), a limitation of the per-token form, not of this implementation.

Canvas (``rl.canvas``): DARE's SPG masks and scores the full LLaDA/Dream canvas (``full``, those families' default).
"""

from __future__ import annotations

import torch

from megadare.algos.algorithm import Algorithm, rows_for_views
from megadare.algos.base import SLOT_CONST, Slots
from megadare.diffusion.corruption import BlockGrid, CleanSequence, blockwise, blockwise_dare
from megadare.errors import ConfigError

ESTIMATORS = ("block", "dare")


class SPG(Algorithm):
    name = "spg"
    lse_beta = "eubo_beta"
    clipped_ratio = False
    defaults = {
        "loss_agg": "seq_mean_token_mean",
        "eubo_beta": 1.5,
        "mix": 0.5,
        "n_mc": 2,
        "p_prompt": 0.15,
        "block": 32,
        "estimator": "block",
    }

    def __init__(self, overrides=None):
        super().__init__(overrides)
        if self.p["estimator"] not in ESTIMATORS:
            raise ConfigError(f"algo.params.estimator={self.p['estimator']!r}: choose one of {ESTIMATORS}")
        if self.p["estimator"] == "dare" and self.p["loss_agg"] != "seq_mean_token_mean":
            raise ConfigError(
                "algo.params.estimator=dare averages the EUBO over tokens and the loss over sequences:"
                f" loss_agg must be seq_mean_token_mean (got {self.p['loss_agg']})"
            )

    def views(self, s, arch, block_size, g):
        b = block_size if arch.is_block_diffusion else self.p["block"]
        grid = BlockGrid(b, global_grid=arch.is_block_diffusion)
        seq = CleanSequence.of(s.prompt_ids, s.response_ids, arch.mask_token_id)
        if self.p["estimator"] == "dare":
            return blockwise_dare(seq, g, grid, self.p["n_mc"], self.p["p_prompt"])
        return blockwise(seq, g, grid, self.p["n_mc"], self.p["p_prompt"], slots="token")

    def rows(self, s, arch, block_size, g):
        """The views in one row; DARE's estimator also records each slot's ELBO scale |covered| / L."""
        self.check_sample(s)
        views = self.views(s, arch, block_size, g)
        if not views:
            return []
        rows = rows_for_views(s, views, arch, self.p["loss_agg"])
        covered = len({int(x) for v in views for x in v.slot.tolist() if x >= 0})
        scale = covered / len(s.response_ids) if self.p["estimator"] == "dare" else 1.0
        for r in rows:
            r.extras[SLOT_CONST + "scale"] = torch.full_like(r.weight, scale)
        return rows

    def slot_loss(self, s: Slots):
        elbo, eubo = s.logp * s.extra.get("scale", 1.0), s.extra["lse"]
        w = self.p["mix"]
        bound = torch.where(s.adv > 0, elbo, w * eubo + (1.0 - w) * elbo)
        return -s.adv * bound, {"elbo": elbo.detach(), "eubo": eubo.detach()}
