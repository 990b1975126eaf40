"""Random-masking RL and coupled RL (dLLM-RL, Wang et al., arXiv:2509.06949; ``train/rl_*.py``,
``random_masking`` / ``coupled`` training modes).

Estimator: block families draw a masking probability ~ U(0.1, 0.9) for every response token and mask it with
that probability (dLLM-RL ``train/rl_trado.py:457``: i.i.d. Bernoulli(0.5) masks, one noisy copy, x_t ++ x_0
layout); full-attention families draw t ~ U(0.1, 0.9) per fragment and mask i.i.d. with it, ``n_views``
fragments per response (dLLM-RL: 35). ``couple=true`` adds the exact complement
of each fragment with the same advantage (coupled RL). Every masked token has its own ratio (no 1/t weight):

    L = (1/N) sum_f w_f sum_{k masked in f} [-min(rho_k A, clip(rho_k, 1 +- eps) A) + beta KL3_k(pi_theta || pi_old)]

Defaults as TraceRL's loss (algos/tracerl.py ``DllmRlLoss``; dLLM-RL trains both modes with one
``forward_process``, ``rl_trado.py:711``): eps 0.2, log-ratio clamped to +-10, beta 0.01 to the old policy (k3 as
dLLM-RL computes it); N fragments, on LLaDA/Dream each fragment's sum / its masked count (w_f = 1/|f|,
``fragment_mean``, ``train/rl_llada.py:589-592``), on block families / the step's longest response
(``fragment_width``, ``train/rl_trado.py:742-744``).

Canvas (``rl.canvas``): dLLM-RL trains TraDo/SDAR on the response up to its EOS block (``eos``, the block
families' default); on LLaDA/Dream the default is the full canvas, like DARE's algorithms, where the positions after
the answer's EOS beyond ``post_num`` (0) are no targets and are masked in every fragment (dLLM-RL's ``post_num``,
``rl_llada.py:312-331``; DllmRlLoss.views).
"""

from __future__ import annotations

from megadare.algos.tracerl import TRACERL_LOSS, DllmRlLoss
from megadare.diffusion.corruption import CleanSequence, random_mask


class RandomMaskRL(DllmRlLoss):
    name = "random_mask_rl"
    defaults = {
        **TRACERL_LOSS,
        "p_low": 0.1,
        "p_high": 0.9,
        "n_views": None,
        "couple": False,
    }

    def masks_tail(self, arch) -> bool:
        return not arch.is_block_diffusion  # rl_llada.py:331 / rl_dream.py; rl_trado.py masks pads at random

    def fragments(self, s, arch, block_size, g):
        block = arch.is_block_diffusion
        n = self.p["n_views"] or (1 if block else 35)
        return random_mask(
            CleanSequence.of(s.prompt_ids, s.response_ids, arch.mask_token_id),
            g,
            block_size if block else 0,
            (self.p["p_low"], self.p["p_high"]),
            n,
            self.p["couple"],
        )
