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

:class:`Refinement` keeps the post-step counters of a block's rows (:class:`RefineState`); the step itself is
``dllm_step.dllm_step`` with ``editable=Refinement.editable(...)``; the built-in engine runs a step, its record and
the bookkeeping before the next forward as one function (:func:`editing_step`, compiled: one graph per step). A
forward whose step finds nothing to do (no mask, no edit) closes the block and is not a denoising step of the trace
(as the final forward of any block); a step that edits counts.
Editable positions are those masked when the block started (the prompt's remainder in a first block never is).

Deviations (stated): the mask token is never a prediction (megadare's rule for every decoder; the publisher
could "edit" a token back to the mask id); the publisher's block mask is passed to attention without ``.log()``,
so its own code lets a block attend to later blocks -- megadare keeps the strict block-causal mask
(models/llada2.py).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from megadare.rollout.dllm_step import (
    BlockState,
    StepResult,
    Streams,
    TraceCounts,
    TracedParams,
    dllm_step,
    history_entry,
    split_floats,
)
from megadare.rollout.engine import SamplingParams


class RefineState(NamedTuple):
    """The post-step counters of ``n`` rows over one block, as device tensors: ``start`` [n, B] bool (the
    positions masked when the block started: the ones it decodes and may edit), ``post_steps`` [n] long,
    ``closed`` [n] bool."""

    start: torch.Tensor
    post_steps: torch.Tensor
    closed: torch.Tensor

    @classmethod
    def begin(cls, start_masked: torch.Tensor) -> "RefineState":
        start = start_masked.clone().bool()
        n, dev = start.shape[0], start.device
        return cls(start, torch.zeros(n, dtype=torch.long, device=dev), torch.zeros(n, dtype=torch.bool, device=dev))

    def editable(self, tokens: torch.Tensor, mask_id: int, max_post_steps: int) -> tuple["RefineState", torch.Tensor]:
        """Before a forward: a post step counted for every open row without masks (closing it past
        ``max_post_steps``); the state after, and the decoded positions of the still open rows ([n, B] bool)."""
        has_mask = ((tokens == mask_id) & self.start).any(dim=1)
        post = ~self.closed & ~has_mask
        post_steps = self.post_steps + post.long()
        closed = self.closed | (post & (post_steps > max_post_steps))
        return RefineState(self.start, post_steps, closed), self.start & (tokens != mask_id) & ~closed[:, None]

    def after(self, masked: torch.Tensor, result: StepResult) -> "RefineState":
        """After a step: a row that had no masked position and made no edit is done."""
        quiet = ~masked.any(dim=1)
        if result.edited is not None:
            quiet = quiet & ~result.edited.to(masked.device).any(dim=1)
        return self._replace(closed=self.closed | quiet)


class Refinement:
    """Post-step bookkeeping of ``n`` rows over one block (``start_masked`` [n, B]: the positions masked when
    the block started, i.e. the ones this block decodes and may edit), as device tensors (:class:`RefineState`):
    no host synchronisation."""

    def __init__(self, start_masked: torch.Tensor, params: SamplingParams):
        self.state = RefineState.begin(start_masked)
        self.max_post_steps = params.max_post_steps

    def editable(self, tokens: torch.Tensor, mask_id: int) -> torch.Tensor:
        """Before a forward: count a post step for every open row without masks (closing it past
        ``max_post_steps``); the decoded positions of the still open rows ([n, B] bool)."""
        state = RefineState(*(t.to(tokens.device) for t in self.state))
        self.state, editable = state.editable(tokens, mask_id, self.max_post_steps)
        return editable

    def after(self, masked: torch.Tensor, result: StepResult) -> None:
        """After a step: a row that had no masked position and made no edit is done."""
        self.state = self.state._replace(closed=self.state.closed.to(masked.device)).after(masked, result)

    def is_closed(self, b: int) -> bool:
        return bool(self.state.closed[b])


def work_left(block: BlockState, stopped: Optional[torch.Tensor]) -> torch.Tensor:
    """Whether a dynamic block has a position left to commit or edit (a 0-dim device flag), in rows not
    ``stopped`` (a row stopped a block ago rides its last block frozen: it must not keep the block running)."""
    work = block.masked if block.editable is None else block.masked | block.editable
    if stopped is not None:
        work = work & ~stopped[:, None]
    return work.any()


class EditingState(NamedTuple):
    """What token editing's block carries from step to step: the trace's counts, the post-step counters and the
    rows ``stopped`` a block ago (None unless the stop flags are read a block late)."""

    trace: TraceCounts
    refine: RefineState
    stopped: Optional[torch.Tensor]


def editing_start(tokens: torch.Tensor, stopped: Optional[torch.Tensor], mask_id: int, max_post_steps: int):
    """A block's start under token editing: (the block's first :class:`BlockState`, its :class:`EditingState`
    with nothing recorded, whether it has work: a 0-dim flag)."""
    refine, editable = RefineState.begin(tokens == mask_id).editable(tokens, mask_id, max_post_steps)
    block = BlockState(tokens, tokens == mask_id, editable)
    return block, EditingState(TraceCounts.start(tokens), refine, stopped), work_left(block, stopped)


def editing_step(
    logits: torch.Tensor,
    block: BlockState,
    state: EditingState,
    params: Union[SamplingParams, TracedParams],
    streams: Streams,
    mask_token_id: int,
):
    """One step of token editing's block loop as one function (compiled: one graph between two forwards, where
    the refinement's bookkeeping, the trace and the next step's editable positions cost ~70 eager ops): the step
    (``dllm_step`` at ``state.trace``'s block-local step, the streams advanced by the steps the rows took), its
    history entry (``dllm_step.history_entry``), the refinement after it and before the next forward. Returns
    (the next :class:`BlockState`, the next :class:`EditingState`, whether the block has work left: a 0-dim flag,
    the step's history entry); the same numbers as those calls one by one."""
    trace, refine, stopped = state
    step = trace.next_step
    result = dllm_step(logits, block, step, params, streams.at(trace.count), mask_token_id)
    entry = history_entry(result, trace.count, step)
    refine = refine.after(block.masked, result)
    tokens = result.tokens
    refine, editable = refine.editable(tokens, mask_token_id, split_floats(params)[0].max_post_steps)
    nxt = BlockState(tokens, tokens == mask_token_id, editable)
    return nxt, EditingState(trace.after(result, step), refine, stopped), work_left(nxt, stopped), entry
