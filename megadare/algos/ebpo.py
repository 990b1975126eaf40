"""EBPO: ELBO-based block-level policy optimisation (LLaDA2.1, arXiv:2602.08676; DARE ``_forward_process_ebpo``,
``compute_policy_loss_ebpo``; the original code is closed).

Estimator: N Monte-Carlo rows, each corrupting every response block (x_t ++ x_0, all blocks in one forward);
noise levels stratified over the C = N x (blocks) (row, block) cells by a random cyclic offset u, in DARE's
row-major order: t_nb = (u + (n (blocks) + b) / C) mod 1, so a row's blocks share one stratum band (a row is one
timestep of the composite ELBO); mask count floor(t |b|) + 1 in block b, p_mask = count / |b|. The sequence
log-likelihood estimate is the composite block ELBO

    l = (1/N) sum_n sum_b (|b| / count_bn) sum_{k masked in b, row n} log p_theta(y_k | x_n),

and PPO clipping is applied once to the sequence ratio exp(l - l_old) (log-ratio clamped); KL k2 to the
reference model when enabled. Defaults: N = 16 (mc_num), eps 0.2, no KL. DARE back-propagates row by row with
a proxy gradient (constant memory); here all rows of a sample share one micro-batch row (same gradient).

Canvas (``rl.canvas``): EBPO's families (LLaDA2.x, SDAR in DARE) stop at the EOS (``eos``, the block families'
default).
"""

from __future__ import annotations

import torch

from megadare.algos.algorithm import Algorithm
from megadare.algos.algorithm import rows_for_views
from megadare.diffusion.masking import mask_tokens
from megadare.diffusion.views import View


def block_elbo_views(
    prompt: list[int], response: list[int], mask_id: int, g: torch.Generator, block_size: int, n_mc: int
) -> list[View]:
    P, L = len(prompt), len(response)
    x0 = torch.tensor(list(prompt) + list(response), dtype=torch.long)
    pos = torch.arange(P + L)
    blocks = sorted({int(b) for b in (pos[P:] // block_size).tolist()})
    cells = n_mc * len(blocks)
    offset = float(torch.rand((), generator=g, dtype=torch.float64))
    views = []
    for n in range(n_mc):
        masked = torch.zeros(P + L, dtype=torch.bool)
        coef = torch.zeros(P + L)
        for bi, b in enumerate(blocks):
            t = (offset + (n * len(blocks) + bi) / cells) % 1.0  # DARE's cells in row-major order
            members = ((pos >= P) & (pos // block_size == b)).nonzero().flatten()
            count = min(len(members), int(t * len(members)) + 1)
            pick = members[torch.randperm(len(members), generator=g)[:count]]
            masked[pick] = True
            coef[pick] = len(members) / count / n_mc
        views.append(
            View(
                tokens=mask_tokens(x0, masked, mask_id),
                coef=coef,
                slot=torch.where(masked, torch.zeros(P + L, dtype=torch.long), torch.full((P + L,), -1)),
            )
        )
    return views


class EBPO(Algorithm):
    name = "ebpo"
    defaults = {"eps_low": 0.2, "kl_estimator": "k2", "kl_anchor": "ref", "n_mc": 16}

    def views(self, s, arch, block_size, g):
        return block_elbo_views(
            s.prompt_ids,
            s.response_ids,
            arch.mask_token_id,
            g,
            block_size if arch.is_block_diffusion else 32,
            self.p["n_mc"],
        )

    def rows(self, s, arch, block_size, g):
        views = self.views(s, arch, block_size, g)
        return rows_for_views(s, views, arch, "", {0: 1.0}, 1.0) if views else []
