"""ESPO: ELBO-based sequence-level policy optimisation (Ou et al., "Principled RL for Diffusion LLMs Emerges from a
Sequence-Level Perspective", arXiv:2512.03759; code ML-GSAI/ESPO; DARE ``_forward_process_espo``,
``compute_espo_sequence_elbo``, ``compute_policy_loss_espo``, ``compute_espo_kl``, ``llada_dp_actor_espo.py``).

Estimator (antithetic sequence ELBO): per Monte-Carlo draw, k of the L response positions are masked, k uniform on
{0..L} and stratified across the samples of the batch -- k_i = round(k0 + i (L+1) / B) mod (L+1), k0 ~ U{0..L},
for the B samples of equal length L (DARE's rule: its canvas makes every length R; samples of a length nobody
shares draw k alone) -- and two views are scored:

    E1 = ((L+1) / k) sum_{j masked} log p(y_j | x_S),   E2 = ((L+1) / (L-k)) sum_{j not in S} log p(y_j | x_{~S})

(x_{~S}: exactly the complement masked; a view with nothing masked contributes 0). Each is unbiased for the ELBO
sum_m g_m / m (g_m = E_{|S|=m} sum_{j in S} log p(y_j | x_S)); ELBO = (E1 + E2) / 2, and the slot estimate is

    l = (1 / n_mc) sum_draws ELBO / R,          R = the response canvas length (L on ``rl.canvas=eos``).

Objective: sequence-level PPO on rho = exp(l - l_old), clip eps 0.2 (0 for countdown in DARE's recipe), no dual
clip by default (``algo.params.dual_clip`` as for every PPO-clip algorithm), mean over sequences, plus k2 KL on the raw ELBO to the reference scored on the same masks,

    beta * (1/2) (R l - R l_ref)^2 / R  =  beta * R * k2(l, l_ref),      beta 1e-3 (math) .. 1e-2 (code),

RLOO advantages (``advantage.estimator=rloo``), and several optimizer iterations per rollout (DARE: 8 =
``rl.ppo_epochs``, 2 MC draws), iteration j on its own mask set with the old ELBOs of every set taken before the
first update: ESPO redraws corruptions per epoch (``rl.redraw_corruptions``, trainer/rl_update.py).

Canvas: DARE scores the full canvas (``rl.canvas=full``, R = max_new_tokens, L = R); the paper's L is the
response length, which is what ``rl.canvas=eos`` gives.
"""

from __future__ import annotations

import torch

from megadare.algos.algorithm import Algorithm, rows_for_views
from megadare.algos.base import SLOT_CONST, RLSample, Slots
from megadare.diffusion.corruption import CleanSequence, antithetic_views
from megadare.diffusion.views import View
from megadare.errors import ConfigError


def stratified_counts(lengths: list[int], n_mc: int, g: torch.Generator) -> list[list[int]]:
    """[sample][draw] masked counts: per draw and per length L shared by B samples (in the given order),
    k_i = round(k0 + i (L+1) / B) mod (L+1) with k0 ~ U{0..L} (one k0 per (draw, length))."""
    out = [[0] * n_mc for _ in lengths]
    for L in sorted(set(lengths)):
        rows = [i for i, x in enumerate(lengths) if x == L]
        B = len(rows)
        for d in range(n_mc):
            k0 = int(torch.randint(L + 1, (1,), generator=g))
            for i, r in enumerate(rows):
                out[r][d] = int(round(k0 + i * (L + 1) / B)) % (L + 1)
    return out


class ESPO(Algorithm):
    name = "espo"
    redraw_corruptions = True
    defaults = {"eps_low": 0.2, "kl_coef": 1e-3, "kl_anchor": "ref", "kl_estimator": "k2", "n_mc": 2}

    def check_config(self, cfg, arch) -> None:
        super().check_config(cfg, arch)
        if self.p["kl_estimator"] != "k2" and self.p["kl_coef"] > 0:
            raise ConfigError(f"algo.params.kl_estimator={self.p['kl_estimator']!r}: espo's KL is k2 on the raw ELBO")

    def views(self, s, arch, block_size, g):
        counts = stratified_counts([len(s.response_ids)], self.p["n_mc"], g)[0]
        seq = CleanSequence.of(s.prompt_ids, s.response_ids, arch.mask_token_id)
        return antithetic_views(seq, counts, g, len(s.response_ids))

    def batch_rows(self, samples, arch, block_size, generator_for):
        """Counts stratified over the mini-batch's samples (ordered by index), drawn from a generator of the batch
        (``generator_for(-1 - first index)``: never a sample's own); masks from each sample's generator."""
        samples = sorted((s for s in samples if s.response_ids), key=lambda s: s.index)
        if not samples:
            return []
        counts = stratified_counts(
            [len(s.response_ids) for s in samples], self.p["n_mc"], generator_for(-1 - samples[0].index)
        )
        rows = []
        for s, ks in zip(samples, counts):
            R = len(s.response_ids)
            seq = CleanSequence.of(s.prompt_ids, s.response_ids, arch.mask_token_id)
            views = antithetic_views(seq, ks, generator_for(s.index), R)
            rows.extend(self._rows(s, views, arch, R))
        return rows

    def _rows(self, s: RLSample, views: list[View], arch, canvas: int):
        rows = rows_for_views(s, views, arch, "", {0: 1.0}, 1.0) if views else []
        for r in rows:
            r.extras[SLOT_CONST + "canvas"] = torch.full((len(r),), float(canvas))
        return rows

    def rows(self, s, arch, block_size, g):
        return self._rows(s, self.views(s, arch, block_size, g), arch, len(s.response_ids))

    def kl_scale(self, s: Slots) -> torch.Tensor:
        """k2 of the raw ELBO R l, divided by R: R times the k2 of the per-token ELBO l."""
        return s.extra["canvas"]
