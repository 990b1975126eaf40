"""Diffusion core: noise schedules, masking (random, block, complementary) and the ELBO weights, shared by SFT
(algos/sft.py) and RL; the views (views.py), corruption samplers (corruption.py) and trace replay (trace_replay.py) of the RL
likelihood estimators.

Masked-diffusion language models (LLaDA arXiv:2502.09992, MDLM arXiv:2406.07524) corrupt a clean response
x_0 by replacing each token with the mask token independently with probability t; the negative ELBO is

    -log p(x_0 | c) <= E_{t ~ U(0,1)} E_{x_t ~ q(.|x_0, t)} [ (1/t) * sum_{k: x_t^k = M} -log p_theta(x_0^k | x_t, c) ]

Block diffusion (BD3-LM arXiv:2503.09573, SDAR arXiv:2510.06303) applies it per block b, each block conditioned
on the clean blocks before it; the x_t ++ x_0 input (models/attention.py) gives every block's term in one pass.
"""

from megadare.diffusion.masking import block_index, complementary, iid_mask, mask_tokens
from megadare.diffusion.schedule import NoiseSchedule, elbo_weight

__all__ = ["NoiseSchedule", "elbo_weight", "iid_mask", "complementary", "mask_tokens", "block_index"]
