"""One denoising step of one block, engine-independent (pure torch), and the trace it leaves.

Both rollout engines decode a block of B tokens the same way; this module is the part they share:

* the built-in engine (``native.py``) calls :func:`dllm_step` once per forward for the whole batch;
* the SGLang plugin (``sglang_plugin.py``) calls it once per forward and per request (``n = 1``), inside sglang's
  dLLM algorithm hook.

Both give every request its own ``torch.Generator``, seeded ``engine.prompt_seed(seed, prompt index)``: a request
draws from it only in the steps where it has work (a masked position, or editable ones under token editing), so the
same prompt at the same index gives the same trajectory in a batch of any size and in either engine.

A step takes the block's logits ``[n, B, V]`` (rows = requests), the block's current tokens ``[n, B]``, which
positions are still masked, and the block-local step index, and

1. forbids the mask token as a prediction (``mask_token_id``), samples a proposal x0 at every position with the
   request's temperature / top-k / top-p (``sampling.sample_tokens``: log-prob under the sampling distribution,
   confidence under the model distribution), and ranks by ``params.confidence`` (:func:`ranking_confidence`:
   Dream's rules, LLaDA2.1's own under token editing);
2. asks the schedule how many tokens this step commits (``sampling.transfer_schedule`` over the block size and
   ``steps_per_block``, Dream's ``linspace_count``, LLaDA2.1's ``num_to_transfer``; a step index past the
   schedule commits every masked position);
3. picks the positions (``sampling.select_commits``: low-confidence static / dynamic threshold / random; DARE's
   ``linspace_first`` commits the block's first masked position alone at step 0: :func:`block_start_commit`);
4. under token editing (``editable`` given, ``rollout/editing.py``) also commits the edits of decoded positions;
5. writes the committed proposals into the block.

Rows without a masked position take no step (``active`` is False for them; under token editing a row without
masks steps when it is given editable positions, and its step counts when it edits): step counters advance only
where a request had work, which is how both engines count the global denoising step of a request.

:class:`BlockTrace` accumulates successive :class:`StepResult` of one block into per-token records
(forward index inside the block, block-local step, log-prob) from which a ``Trajectory`` is built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from megadare.rollout.engine import SamplingParams
from megadare.rollout.sampling import (dream_confidence, linspace_count, sample_tokens, select_commits,
                                       transfer_schedule)

StepIndex = Union[int, Sequence[int], torch.Tensor]


@dataclass
class StepResult:
    """What one denoising step did to a block of ``n`` rows x ``B`` positions."""

    tokens: torch.Tensor        # [n, B] block tokens after the step
    committed: torch.Tensor     # [n, B] bool: positions committed at this step
    proposals: torch.Tensor     # [n, B] the sampled proposal x0 at every position (rows without work: their tokens)
    logprobs: torch.Tensor      # [n, B] log-prob of the proposal under the sampling distribution (0 when greedy)
    confidence: torch.Tensor    # [n, B] what low-confidence remasking ranks (params.confidence of the proposal)
    active: torch.Tensor        # [n] bool: the row had a masked position (or made an edit), i.e. this step counts
    edited: Optional[torch.Tensor] = None   # [n, B] bool: token edits of already decoded positions (editing)


def _row_steps(step: StepIndex, n: int) -> list[int]:
    if isinstance(step, int):
        steps = [step] * n
    else:
        steps = [int(s) for s in (step.tolist() if isinstance(step, torch.Tensor) else step)]
        if len(steps) != n:
            raise ValueError(f"dllm_step: {len(steps)} step indices for {n} rows")
    if any(s < 0 for s in steps):
        raise ValueError(f"dllm_step: negative block-local step in {steps}")
    return steps


def commit_counts(masked: torch.Tensor, step: StepIndex, params: SamplingParams) -> torch.Tensor:
    """Tokens the schedule asks each row to commit at its block-local ``step`` ([n] long).

    ``even``: ``transfer_schedule(block_size, steps_per_block)[step]``; a step index at or past
    ``steps_per_block`` (only reachable when a caller keeps stepping a block the schedule has already exhausted)
    commits every masked position so that a block always finishes. ``linspace``: Dream's count of the row's
    current masked positions; ``linspace_first``: 0 at step 0 (:func:`block_start_commit` commits the first
    position), the linspace count after. ``editing``: ``num_to_transfer``."""
    schedule = transfer_schedule(params.block_size, params.steps_per_block)
    counts = []
    for b, s in enumerate(_row_steps(step, masked.shape[0])):
        left = int(masked[b].sum())
        if params.algorithm == "editing":
            counts.append(params.num_to_transfer)
        elif params.schedule == "linspace" or (params.schedule == "linspace_first" and s > 0):
            counts.append(linspace_count(left, s, params.steps_per_block, params.eps))
        elif params.schedule == "linspace_first":
            counts.append(0)
        else:
            counts.append(schedule[s] if s < len(schedule) else left)
    return torch.tensor(counts, dtype=torch.long)


def ranking_confidence(logits: torch.Tensor, proposals: torch.Tensor, model_prob: torch.Tensor,
                       params: SamplingParams) -> torch.Tensor:
    """What the commit rule ranks: ``model_prob`` (the model probability of the proposal, from
    ``sample_tokens``), one of Dream's rules (``sampling.dream_confidence``), or under token editing LLaDA2.1's
    ``x0_p``: the model probability when greedy, the probability under the sampling distribution otherwise
    (``_sample_with_temperature_topk_topp`` of its ``modeling_llada2_moe.py``)."""
    rule = params.confidence
    if params.algorithm == "editing":
        rule = "model_prob" if params.temperature == 0 else "maskgit_plus"
    if rule == "model_prob":
        return model_prob
    return dream_confidence(logits, proposals.to(logits.device), rule, params.temperature, params.top_k,
                            params.top_p)


def block_start_commit(committed: torch.Tensor, masked: torch.Tensor, step: StepIndex,
                       params: SamplingParams) -> torch.Tensor:
    """DARE's Dream block sampler (``schedule='linspace_first'``): at block-local step 0 a row commits its block's
    first masked position alone (``x[:, block_start] = x0[:, block_start]``); other steps unchanged."""
    if params.schedule != "linspace_first":
        return committed
    out = committed.clone()
    for b, s in enumerate(_row_steps(step, masked.shape[0])):
        idx = masked[b].nonzero().squeeze(1)
        if s == 0 and len(idx):
            out[b, int(idx[0])] = True
    return out


def dllm_step(logits: torch.Tensor, tokens: torch.Tensor, masked: torch.Tensor, step: StepIndex,
              params: SamplingParams, generators: Sequence[Optional[torch.Generator]],
              mask_token_id: Optional[int] = None,
              commit_generators: Optional[Sequence[Optional[torch.Generator]]] = None,
              editable: Optional[torch.Tensor] = None) -> StepResult:
    """One denoising step of a block.

    logits [n, B, V] (any float dtype; computed in float32), tokens [n, B], masked [n, B] bool (positions that may
    be committed: the still-masked ones of requests that are still decoding), step: the block-local step index
    (one int for all rows, or one per row), params: temperature / top_k / top_p / algorithm / threshold /
    block_size / steps_per_block, generators: one RNG per row (its request's stream, see ``engine.prompt_seed``;
    CPU or on the logits' device; None where nothing is drawn, e.g. greedy), mask_token_id: if given, the mask token
    is never a prediction, commit_generators: per row, the RNG for random remasking if it must differ from the
    row's generator (``select_commits`` draws a CPU ``randperm``, so a caller that samples with a CUDA generator
    passes CPU ones here). editable [n, B] bool: token editing only (``editing.Refinement.editable``): decoded
    positions whose token a confident, different prediction replaces.

    A row draws (proposals, then random remasking) only in a step where it has work, so its stream advances with
    its own steps alone: the result of a row does not depend on the other rows.
    """
    if logits.dim() != 3 or tokens.dim() != 2 or logits.shape[:2] != tokens.shape or masked.shape != tokens.shape:
        raise ValueError(f"dllm_step: need logits [n, B, V], tokens and masked [n, B]; got {tuple(logits.shape)}, "
                         f"{tuple(tokens.shape)}, {tuple(masked.shape)}")
    if tokens.shape[1] != params.block_size:
        raise ValueError(f"dllm_step: the block has {tokens.shape[1]} positions, params.block_size="
                         f"{params.block_size}")
    n = tokens.shape[0]
    gens = list(generators)
    commit_gens = gens if commit_generators is None else list(commit_generators)
    if len(gens) != n or len(commit_gens) != n:
        raise ValueError(f"dllm_step: {len(gens)} generators and {len(commit_gens)} commit generators for {n} rows "
                         "(one per row)")
    logits = logits.float()
    if mask_token_id is not None:  # out of place: the caller's logits stay untouched
        logits = logits.index_fill(-1, torch.tensor([mask_token_id], device=logits.device), float("-inf"))
    work = masked.any(dim=1) if editable is None else masked.any(dim=1) | editable.any(dim=1)
    proposals = tokens.clone().to(logits.device)
    logp = torch.zeros(tokens.shape, device=logits.device)
    conf = torch.zeros(tokens.shape, device=logits.device)
    committed = torch.zeros_like(masked)
    counts = commit_counts(masked, step, params)
    for b in work.nonzero().squeeze(1).tolist():
        p, lp, c = sample_tokens(logits[b:b + 1], params.temperature, params.top_k, params.top_p, gens[b])
        proposals[b], logp[b] = p[0], lp[0]
        conf[b] = ranking_confidence(logits[b:b + 1], p, c, params)[0]
        committed[b] = select_commits(conf[b:b + 1], masked[b:b + 1], counts[b:b + 1], params.algorithm,
                                      params.threshold, commit_gens[b], params.alg_temp)[0]
    committed = block_start_commit(committed, masked, step, params)
    edited = None
    if editable is not None:
        confident = conf.to(editable.device) > params.editing_threshold
        edited = editable & confident & (proposals.to(tokens.device) != tokens)
        committed = committed | edited
    new_tokens = torch.where(committed, proposals.to(tokens.device), tokens)
    active = masked.any(dim=1) if edited is None else masked.any(dim=1) | edited.any(dim=1)
    return StepResult(tokens=new_tokens, committed=committed, proposals=proposals, logprobs=logp, confidence=conf,
                      active=active, edited=edited)


class BlockTrace:
    """Per-row records of one block's denoising: which step committed each position, and with which log-prob.

    ``records[b][pos] = (forward, block_step, logprob)``: ``forward`` counts the steps row ``b`` took in this block
    before the one that committed ``pos`` (a global step is ``forwards before the block + forward``),
    ``block_step`` is the block-local step index the step ran with. ``num_steps[b]``: steps row ``b`` took.
    Under token editing a position may be committed again: ``records`` keeps the latest commit and
    ``superseded[b][pos]`` the earlier ones in order, as ``(forward, block_step, logprob, token)``.
    With ``record_steps`` the proposals and confidences of every step are kept per row (MDPO)."""

    def __init__(self, n: int, record_steps: bool = False):
        self.num_steps = [0] * n
        self.records: list[dict[int, tuple[int, int, float]]] = [dict() for _ in range(n)]
        self.tokens: list[dict[int, int]] = [dict() for _ in range(n)]
        self.superseded: list[dict[int, list[tuple[int, int, float, int]]]] = [dict() for _ in range(n)]
        self.preds: Optional[list[list[list[int]]]] = [[] for _ in range(n)] if record_steps else None
        self.confs: Optional[list[list[list[float]]]] = [[] for _ in range(n)] if record_steps else None

    def add(self, result: StepResult, step: StepIndex) -> None:
        """Record one step (``step``: the block-local step index it ran with, one int or one per row)."""
        n = len(self.num_steps)
        steps = _row_steps(step, n)
        active = result.active.tolist()
        for b in range(n):
            if not active[b]:
                continue
            lp = result.logprobs[b]
            for c in result.committed[b].nonzero().squeeze(1).tolist():
                if c in self.records[b]:
                    self.superseded[b].setdefault(c, []).append(self.records[b][c] + (self.tokens[b][c],))
                self.records[b][c] = (self.num_steps[b], steps[b], float(lp[c]))
                self.tokens[b][c] = int(result.tokens[b, c])
            if self.preds is not None and self.confs is not None:
                self.preds[b].append(result.proposals[b].tolist())
                self.confs[b].append(result.confidence[b].tolist())
            self.num_steps[b] += 1

    def entries(self, b: int, positions: Sequence[int], forwards_before: int = 0) -> list[tuple[int, int, float]]:
        """(global step, block-local step, log-prob) of row ``b`` at ``positions``; every position must have
        been committed."""
        out = []
        for p in positions:
            if p not in self.records[b]:
                raise ValueError(f"BlockTrace: position {p} of row {b} was never committed")
            f, s, lp = self.records[b][p]
            out.append((forwards_before + f, s, lp))
        return out

    def superseded_entries(self, b: int, position: int, forwards_before: int = 0) -> list[list]:
        """The overwritten commits of row ``b`` at ``position``: ``[global step, block step, log-prob, token]``."""
        return [[forwards_before + f, s, lp, tok] for f, s, lp, tok in self.superseded[b].get(position, [])]
