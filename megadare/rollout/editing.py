"""LLaDA2.1's token-editing decoder: the per-block bookkeeping both engines share.

Followed: ``generate()`` of inclusionAI's ``modeling_llada2_moe.py`` as published with LLaDA2.1-mini (DARE ships
it under ``models/LLaDA2.1-mini/``). Per block, until it stops:

* at the start of an iteration a block without masked positions spends one *post step*; once more than
  ``max_post_steps`` were spent the block stops (no forward);
* a forward over the block gives a proposal x0 and its confidence x0_p at every position (argmax and the model
  probability when greedy; a draw from softmax(top_p(top_k(logits / T))) and its probability under that
  distribution otherwise);
* masked positions: every one with x0_p > ``threshold`` when that is at least ``num_to_transfer``, else the
  ``num_to_transfer`` most confident (``sampling.select_commits``, rule ``editing``);
* edits: every already decoded, non-prompt position of the block whose x0 differs from its token and whose
  x0_p > ``editing_threshold`` takes x0 (in the same step as the mask commits);
* a block that had no masked position at the start of the iteration and made no edit stops.

:class:`Refinement` keeps the post-step counters of a block's rows; the step itself is ``dllm_step.dllm_step``
with ``editable=Refinement.editable(...)``. A forward whose step finds nothing to do (no mask, no edit) closes the
block and is not a denoising step of the trace (as the final forward of any block); a step that edits counts.
Editable positions are those masked when the block started (the prompt's remainder in a first block never is).

Deviations (stated): the mask token is never a prediction (megadare's rule for every decoder; the publisher
could "edit" a token back to the mask id); the publisher's block mask is passed to attention without ``.log()``,
so its own code lets a block attend to later blocks -- megadare keeps the strict block-causal mask
(models/llada2.py).
"""

from __future__ import annotations

import torch

from megadare.rollout.dllm_step import StepResult
from megadare.rollout.engine import SamplingParams


class Refinement:
    """Post-step bookkeeping of ``n`` rows over one block (``start_masked`` [n, B]: the positions masked when
    the block started, i.e. the ones this block decodes and may edit), as device tensors: no host
    synchronisation."""

    def __init__(self, start_masked: torch.Tensor, params: SamplingParams):
        self.start = start_masked.clone().bool()
        self.max_post_steps = params.max_post_steps
        n = start_masked.shape[0]
        self.post_steps = torch.zeros(n, dtype=torch.long, device=self.start.device)
        self.closed = torch.zeros(n, dtype=torch.bool, device=self.start.device)

    def editable(self, tokens: torch.Tensor, mask_id: int) -> torch.Tensor:
        """Before a forward: count a post step for every open row without masks (closing it past
        ``max_post_steps``); the decoded positions of the still open rows ([n, B] bool)."""
        start = self.start.to(tokens.device)
        has_mask = ((tokens == mask_id) & start).any(dim=1)
        post = ~self.closed.to(tokens.device) & ~has_mask
        self.post_steps = self.post_steps.to(tokens.device) + post.long()
        self.closed = self.closed.to(tokens.device) | (post & (self.post_steps > self.max_post_steps))
        return start & (tokens != mask_id) & ~self.closed[:, None]

    def after(self, masked: torch.Tensor, result: StepResult) -> None:
        """After a step: a row that had no masked position and made no edit is done."""
        edited = result.edited if result.edited is not None else torch.zeros_like(masked)
        quiet = ~masked.any(dim=1) & ~edited.to(masked.device).any(dim=1)
        self.closed = self.closed.to(masked.device) | quiet

    def is_closed(self, b: int) -> bool:
        return bool(self.closed[b])
