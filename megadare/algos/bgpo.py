"""BGPO: boundary-guided policy optimisation (Lin, Zhang, Hou, Li, arXiv:2510.11683; DARE
``compute_policy_loss_bgpo``, ``_forward_process_bgpo``).

Estimator: n Monte-Carlo count-stratified ELBO samples per response (diffusion/corruption.py ``stratified``),
each normalised by the response length: l_j = (1/L) (L/m_j) sum_{k masked in j} log p_theta(y_k | x_j).
The counts m_j are exactly uniform on 1..L pooled over the n draws, so mean_j l_j is unbiased for the ELBO / L.
DARE's ``_forward_process_bgpo`` rounds its evenly spaced counts half to even: unless n / gcd(n, L) is odd
(16 divides L at n = 16) some counts are (1 + gcd(n, L)/n)x and others (1 - gcd(n, L)/n)x as likely as
uniform (L = 12: 1.25x / 0.75x); megadare keeps the uniform counts (corruption.py states and enumerates both).
Objective: the sequence ratio exp(mean_j l_j - mean_j l_j^old) is not linear in the samples; BGPO maximises a
lower bound that is a sum of per-sample terms (so each MC sample can be back-propagated on its own):

    A >= 0:  r_j = 1 + (l_j - l_j^old)        (tangent, <= exp)
    A <  0:  r_j = exp(l_j - l_j^old)         (Jensen)
    L = -(1/n) sum_j min(r_j A, clip(r_j, 1 +- eps) A)      (+ dual clip min(., -c A) for A < 0 when set)

equal in value and gradient to the ELBO objective on-policy. Defaults: n = 16, eps 0.2, no KL, dual clip off
(DARE's ``compute_policy_loss_bgpo`` applies c = 3: ``algo.params.dual_clip=3``).

Canvas (``rl.canvas``): DARE's BGPO uses the full canvas on LLaDA/Dream (``full``, their default; L in the weights
is then R) and the response up to EOS on SDAR/LLaDA2 (``eos``).
"""

from __future__ import annotations

import torch

from megadare.algos.algorithm import Algorithm
from megadare.algos.algorithm import rows_for_views
from megadare.algos.base import Slots
from megadare.diffusion.corruption import CleanSequence, stratified
from megadare.algos.policy_loss import clip_surrogate


class BGPO(Algorithm):
    name = "bgpo"
    defaults = {"eps_low": 0.2, "n_mc": 16}

    def views(self, s, arch, block_size, g):
        return stratified(
            CleanSequence.of(s.prompt_ids, s.response_ids, arch.mask_token_id),
            g,
            self.p["n_mc"],
            slots="sequence_per_view",
            normalize_length=True,
        )

    def rows(self, s, arch, block_size, g):
        views = self.views(s, arch, block_size, g)
        w = {j: 1.0 / len(views) for j in range(len(views))}
        return rows_for_views(s, views, arch, "", w, 1.0) if views else []

    def slot_loss(self, s: Slots):
        d = s.logp - s.old
        r = torch.where(s.adv >= 0, 1.0 + d, torch.exp(d.clamp(max=20.0)))
        loss, clipped = clip_surrogate(r, s.adv, self.p["eps_low"], self.p["eps_high"], self.p["dual_clip"])
        return loss, {"clipfrac": clipped}
