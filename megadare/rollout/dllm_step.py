"""One denoising step of one block, engine-independent (pure torch), and the trace it leaves.

Both rollout engines decode a block of B tokens the same way; this module is the part they share:

* the built-in engine (``native.py``, its decoders in ``decoders.py``) calls :func:`dllm_step` once per forward for the whole batch;
* the SGLang plugin (``sglang_plugin.py``) calls it once per forward and per request (``n = 1``), inside sglang's
  dLLM algorithm hook.

Both give every request its own random stream (:class:`Streams`): the key ``engine.prompt_seed(seed, prompt
index)`` and a counter, the request's denoising steps so far (``sampling.stream_uniforms``). A step that counts
(the row had work) uses the numbers at the row's counter; the caller then advances the counters of the rows that
stepped. So the same prompt at the same index gives the same trajectory in a batch of any size, in either engine,
on any device.

A step takes the block's logits ``[n, B, V]`` (rows = requests), the block's current tokens ``[n, B]``, which
positions are still masked, and the block-local step index, and, as tensor ops over all rows at once (no per-row
Python, no host synchronisation),

1. forbids the mask token as a prediction (``mask_token_id``), samples a proposal x0 at every position with the
   request's temperature / top-k / top-p (``sampling.sample_tokens``: log-prob under the sampling distribution,
   confidence under the model distribution), and ranks by ``params.confidence`` (:func:`ranking_confidence`:
   Dream's rules, LLaDA2.1's own under token editing);
2. asks the schedule how many tokens this step commits (:func:`commit_counts`: ``even``, block_size //
   steps_per_block each, the remainder to the earliest steps as LLaDA's ``get_num_transfer_tokens``; Dream's
   ``linspace_counts``; LLaDA2.1's ``num_to_transfer``; a step index past the schedule commits every masked
   position);
3. picks the positions (``sampling.select_commits``: low-confidence static / dynamic threshold / random; DARE's
   ``linspace_first`` commits the block's first masked position alone at step 0: :func:`block_start_commit`);
4. under token editing (``editable`` given, ``rollout/editing.py``) also commits the edits of decoded positions;
5. writes the committed proposals into the block.

Rows without a masked position take no step (``active`` is False for them; under token editing a row without
masks steps when it is given editable positions, and its step counts when it edits): step counters advance only
where a request had work, which is how both engines count the global denoising step of a request.

:class:`BlockTrace` accumulates successive :class:`StepResult` of one block on the device (which step committed
each position, with which log-prob) and turns them into per-token host records once, when they are read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch

from megadare.rollout.engine import SamplingParams
from megadare.rollout.sampling import (
    REMASK,
    SAMPLE,
    CommitRule,
    Setting,
    SamplingRule,
    dream_confidence,
    linspace_counts,
    linspace_remaining_counts,
    mix64,
    sample_tokens,
    select_commits,
    stream_uniforms,
)

StepIndex = Union[int, Sequence[int], torch.Tensor]
PROPOSE_CHUNK = 64  # propose: positions sampled together


@dataclass
class StepResult:
    """What one denoising step did to a block of ``n`` rows x ``B`` positions."""

    tokens: torch.Tensor  # [n, B] block tokens after the step
    committed: torch.Tensor  # [n, B] bool: positions committed at this step
    proposals: torch.Tensor  # [n, B] the sampled proposal x0 at every position (rows without work: their tokens)
    logprobs: torch.Tensor  # [n, B] log-prob of the proposal under the sampling distribution (0 when greedy)
    confidence: torch.Tensor  # [n, B] what low-confidence remasking ranks (params.confidence of the proposal)
    active: torch.Tensor  # [n] bool: the row had a masked position (or made an edit), i.e. this step counts
    edited: Optional[torch.Tensor] = None  # [n, B] bool: token edits of already decoded positions (editing)
    probability: Optional[torch.Tensor] = None  # [n, B] (params.record_steps) the proposal's probability
    # under the sampling distribution (greedy: the model's), what DARE's MDPO rollouts record as confidence


@dataclass
class Streams:
    """The random streams of ``n`` rows: ``keys`` (``engine.prompt_seed``) and ``counters`` (each row's
    denoising steps so far), int64 [n] on the device the step runs on; ``base``: ``sampling.mix64(keys)`` when
    the caller keeps it (an engine does, per row).

    A block's numbers can be drawn once for all its steps (:meth:`ahead`, then :meth:`at` per step): the same
    numbers as drawing per step, one op per step instead of ~25 (the engine's hot loop)."""

    keys: torch.Tensor
    counters: torch.Tensor
    base: Optional[torch.Tensor] = None
    drawn: Optional[dict[tuple[int, int], torch.Tensor]] = None  # (purpose, width) -> [n * S, width] (ahead)
    rows: Optional[torch.Tensor] = None  # [n]: row r's number at counters[r] is row rows[r] of drawn

    @classmethod
    def of(cls, keys: Sequence[int], counters: Optional[Sequence[int]] = None, device=None) -> "Streams":
        k = torch.tensor(list(keys), dtype=torch.long, device=device)
        c = (
            torch.tensor(list(counters), dtype=torch.long, device=device)
            if counters is not None
            else torch.zeros_like(k)
        )
        return cls(k, c)

    def uniforms(self, purpose: int, width: int) -> torch.Tensor:
        table = self.drawn.get((purpose, width)) if self.drawn is not None else None
        if table is not None and self.rows is not None:
            return table.index_select(0, self.rows)
        return stream_uniforms(self.keys, self.counters, purpose, width, self.base)

    def ahead(self, purposes: Sequence[int], width: int, steps: int, draw: Optional[Callable] = None) -> "Streams":
        """These streams with the numbers of counters ``counters`` .. ``counters + steps - 1`` drawn now for
        ``purposes`` at ``width`` positions (a block's steps); read them through :meth:`at`. ``draw``:
        :func:`draw_ahead` or the engine's compiled copy of it (one graph instead of ~30 eager ops a block)."""
        base = mix64(self.keys.long()) if self.base is None else self.base
        *tables, rows = (draw or draw_ahead)(self.keys, self.counters, base, tuple(purposes), width, steps)
        drawn = {(p, width): t for p, t in zip(purposes, tables)}
        return Streams(self.keys, self.counters, base=self.base, drawn=drawn, rows=rows)

    def at(self, advanced: Optional[torch.Tensor]) -> "Streams":
        """The streams ``advanced`` [n] steps on (None: none), each below the ``steps`` of :meth:`ahead` (the caller
        guarantees it: a row advances at most once per step of the block)."""
        if advanced is None:
            return self
        rows = None if self.rows is None else self.rows + advanced
        return Streams(self.keys, self.counters + advanced, self.base, self.drawn, rows)


def draw_ahead(
    keys: torch.Tensor, counters: torch.Tensor, base: torch.Tensor, purposes: tuple[int, ...], width: int, steps: int
) -> tuple[torch.Tensor, ...]:
    """The numbers of :meth:`Streams.ahead`: per purpose the rows' numbers at counters ``counters`` ..
    ``counters + steps - 1`` ([n * steps, width], row r's at rows r * steps ..), then those rows' starts [n]."""
    n = keys.shape[0]
    at = (counters[:, None] + torch.arange(steps, device=keys.device)).reshape(-1)
    keys, base = keys.repeat_interleave(steps), base.repeat_interleave(steps)
    tables = tuple(stream_uniforms(keys, at, p, width, base) for p in purposes)
    return (*tables, torch.arange(n, device=keys.device) * steps)


def step_purposes(params: SamplingParams) -> tuple[int, ...]:
    """The random numbers a step draws: token proposals when sampling, positions for random remasking and
    ``alg_temp``."""
    sample = (SAMPLE,) if params.temperature > 0 else ()
    return sample + ((REMASK,) if params.algorithm == "random" or params.alg_temp > 0 else ())


def step_tensor(step: StepIndex, n: int, device) -> torch.Tensor:
    """Block-local step indices as a long tensor [n] (one int for all rows, or one per row)."""
    if isinstance(step, torch.Tensor):
        if step.dtype == torch.long and step.dim() == 1 and step.device == torch.device(device):
            out = step  # the engines' per-row step index: no conversion op per step
        else:
            out = step.to(device=device, dtype=torch.long).reshape(-1)
    else:
        steps = [int(step)] * n if isinstance(step, int) else [int(s) for s in step]
        if any(s < 0 for s in steps):
            raise ValueError(f"dllm_step: negative block-local step in {steps}")
        out = torch.tensor(steps, dtype=torch.long, device=device)
    if out.numel() != n:
        raise ValueError(f"dllm_step: {out.numel()} step indices for {n} rows")
    return out


def commit_counts(masked: torch.Tensor, step: StepIndex, params: SamplingParams) -> torch.Tensor:
    """Tokens the schedule asks each row to commit at its block-local ``step`` ([n] long).

    ``even``: block_size // steps_per_block, the remainder to the earliest steps; a step index at or past
    ``steps_per_block`` (only reachable when a caller keeps stepping a block the schedule has already exhausted)
    commits every masked position so that a block always finishes. ``linspace``: Dream's count of the row's
    current masked positions; ``linspace_first``: 0 at step 0 (:func:`block_start_commit` commits the first
    position), the linspace count after. ``editing``: ``num_to_transfer``."""
    n, S = masked.shape[0], params.steps_per_block
    s = step_tensor(step, n, masked.device)
    left = masked.sum(dim=1)
    if params.algorithm == "editing":
        return torch.full_like(left, params.num_to_transfer)
    if params.schedule == "even":  # B // S each, the remainder first (LLaDA's get_num_transfer_tokens)
        rem = params.block_size % S
        per_step = params.block_size // S + (s < rem).long() if rem else params.block_size // S
        return torch.where(s < S, per_step, left)
    if params.schedule == "linspace_remaining":
        return linspace_remaining_counts(left, s, S, params.eps)
    counts = linspace_counts(left, s, S, params.eps)
    return torch.where(s == 0, 0, counts) if params.schedule == "linspace_first" else counts


def ranking_confidence(
    logits: torch.Tensor,
    proposals: torch.Tensor,
    model_prob: torch.Tensor,
    params: Union[SamplingParams, "TracedParams"],
    probs: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """What the commit rule ranks: ``model_prob`` (the model probability of the proposal, from
    ``sample_tokens``), one of Dream's rules (``sampling.dream_confidence``), or under token editing LLaDA2.1's
    ``x0_p``: the model probability when greedy, the probability under the sampling distribution otherwise
    (``_sample_with_temperature_topk_topp`` of its ``modeling_llada2_moe.py``). ``probs``: the sampling
    distribution when ``sample_tokens`` built it (temperature > 0)."""
    params, floats = split_floats(params)
    rule = params.confidence
    if params.algorithm == "editing":
        rule = "model_prob" if params.temperature == 0 else "maskgit_plus"
    if rule == "model_prob":
        return model_prob
    sampling = SamplingRule(floats.temperature, params.top_k, floats.top_p)
    return dream_confidence(logits, proposals.to(logits.device), rule, sampling, probs)


def block_start_commit(
    committed: torch.Tensor, masked: torch.Tensor, step: StepIndex, params: SamplingParams
) -> torch.Tensor:
    """DARE's Dream block sampler (``schedule='linspace_first'``): at block-local step 0 a row commits its block's
    first masked position alone (``x[:, block_start] = x0[:, block_start]``); other steps unchanged."""
    if params.schedule != "linspace_first":
        return committed
    first = masked & (masked.long().cumsum(dim=1) == 1)
    return committed | (first & (step_tensor(step, masked.shape[0], masked.device) == 0)[:, None])


def _check(
    logits: torch.Tensor, tokens: torch.Tensor, masked: torch.Tensor, params: SamplingParams, streams: Streams
) -> None:
    if logits.dim() != 3 or tokens.dim() != 2 or logits.shape[:2] != tokens.shape or masked.shape != tokens.shape:
        raise ValueError(
            f"dllm_step: need logits [n, B, V], tokens and masked [n, B]; got {tuple(logits.shape)}, "
            f"{tuple(tokens.shape)}, {tuple(masked.shape)}"
        )
    if tokens.shape[1] != params.block_size:
        raise ValueError(f"dllm_step: the block has {tokens.shape[1]} positions, params.block_size={params.block_size}")
    if streams.keys.shape != (tokens.shape[0],) or streams.counters.shape != (tokens.shape[0],):
        raise ValueError(
            f"dllm_step: streams of {tuple(streams.keys.shape)} keys and {tuple(streams.counters.shape)}"
            f" counters for {tokens.shape[0]} rows (one per row)"
        )


def _proposal_logits(logits: torch.Tensor, mask_token_id: Optional[int]) -> torch.Tensor:
    """``logits`` in float32 with the mask token never a prediction. The caller's logits stay untouched: float32
    logits are copied, lower precision ones are filled in their float32 copy (one pass over [n, B, V], not two)."""
    out = logits.float()
    if mask_token_id is None:
        return out
    index = _token_index(mask_token_id, out.device)
    return out.index_fill(-1, index, float("-inf")) if out is logits else out.index_fill_(-1, index, float("-inf"))


@functools.lru_cache(maxsize=16)
def _token_index(token: int, device: torch.device) -> torch.Tensor:
    """``tensor([token])`` on ``device``, made once (an index the step reuses; never written)."""
    return torch.tensor([token], device=device)


class StepFloats(NamedTuple):
    """The float settings a step computes with (``SamplingParams``' fields of these names): Python floats, or
    one-element tensors on the step's device in the dtype the step computes them in (what a compiled step takes:
    :class:`TracedParams`)."""

    temperature: Setting
    top_p: Setting
    threshold: Setting
    editing_threshold: Setting
    alg_temp: Setting

    @classmethod
    def of(cls, params: SamplingParams) -> "StepFloats":
        return cls(*(float(getattr(params, name)) for name in cls._fields))


class TracedParams(NamedTuple):
    """A step's settings as a compiled step takes them: ``params`` (:func:`branch_params`: the floats replaced by
    what the step's branches tell apart) and ``floats`` (their values, one-element tensors the engine owns). Dynamo
    guards on ``params``, so a new temperature, threshold, top_p ... compiles nothing and makes no tensor per call
    (as a constant it compiled the step again per value, and past dynamo's recompile limit the step ran eager)."""

    params: SamplingParams
    floats: StepFloats


@functools.lru_cache(maxsize=256)
def branch_params(params: SamplingParams) -> SamplingParams:
    """``params`` with the floats of :class:`StepFloats` replaced by one value per branch a step takes on them:
    temperature 0 (greedy), 1 (unscaled) or other, top_p 1 or below, alg_temp 0 or above; the thresholds are
    compared on the device only. ``eps`` (the linspace schedule's points) stays: the step builds its table of it."""
    return replace(
        params,
        temperature=params.temperature if params.temperature in (0.0, 1.0) else 0.5,
        top_p=1.0 if params.top_p >= 1.0 else 0.5,
        threshold=0.5,
        editing_threshold=0.5,
        alg_temp=0.0 if params.alg_temp <= 0 else 1.0,
    )


def split_floats(params: Union[SamplingParams, TracedParams]) -> tuple[SamplingParams, StepFloats]:
    """(the params a step branches on, the float values it computes with): a Python float for a value a branch
    tests for (temperature 0 or 1, top_p 1, alg_temp 0), the tensor otherwise (``sampling._is``)."""
    if isinstance(params, SamplingParams):
        return params, StepFloats.of(params)
    p, f = params
    return p, StepFloats(
        temperature=p.temperature if p.temperature in (0.0, 1.0) else f.temperature,
        top_p=1.0 if p.top_p >= 1.0 else f.top_p,
        threshold=f.threshold,
        editing_threshold=f.editing_threshold,
        alg_temp=0.0 if p.alg_temp <= 0 else f.alg_temp,
    )


class BlockState(NamedTuple):
    """The block a step denoises: ``tokens`` [n, B], ``masked`` [n, B] bool (positions that may be committed: the
    still-masked ones of requests that are still decoding) and, under token editing only, ``editable`` [n, B]
    bool (``editing.Refinement.editable``: decoded positions whose token a confident, different prediction
    replaces)."""

    tokens: torch.Tensor
    masked: torch.Tensor
    editable: Optional[torch.Tensor] = None


def dllm_step(
    logits: torch.Tensor,
    block: BlockState,
    step: StepIndex,
    params: Union[SamplingParams, TracedParams],
    streams: Streams,
    mask_token_id: Optional[int] = None,
) -> StepResult:
    """One denoising step of a block.

    logits [n, B, V] (any float dtype; computed in float32), block: the block's tokens, masked and editable
    positions (:class:`BlockState`), step: the block-local step index (one int for all rows, or one per row),
    params: temperature / top_k / top_p / algorithm / threshold / block_size / steps_per_block, streams: the rows'
    random streams (:class:`Streams`, on the logits' device), mask_token_id: if given, the mask token is never a
    prediction. Everything runs on the logits' device; the result too. ``params`` may come as
    :class:`TracedParams` (a compiled step: the floats as tensors).
    """
    settings = params
    params, floats = split_floats(params)
    tokens, masked, editable = block
    _check(logits, tokens, masked, params, streams)
    dev, B = logits.device, tokens.shape[1]
    logits = _proposal_logits(logits, mask_token_id)
    tokens, masked = tokens.to(dev), masked.to(dev)
    work = masked.any(dim=1) if editable is None else masked.any(dim=1) | editable.to(dev).any(dim=1)
    purposes = step_purposes(params)
    draws = streams.uniforms(SAMPLE, B) if SAMPLE in purposes else None
    dist: Optional[list] = [] if params.confidence != "model_prob" or params.algorithm == "editing" else None
    proposals, logp, model_prob = sample_tokens(logits, floats.temperature, params.top_k, floats.top_p, draws, dist)
    conf = ranking_confidence(logits, proposals, model_prob, settings, dist[0] if dist else None)
    picks = streams.uniforms(REMASK, B) if REMASK in purposes else None
    rule = CommitRule(params.algorithm, floats.threshold, floats.alg_temp)
    committed = select_commits(conf, masked, commit_counts(masked, step, params), rule, picks)
    committed = block_start_commit(committed, masked, step, params)
    proposals = torch.where(work[:, None], proposals, tokens)
    logp = torch.where(work[:, None], logp, 0.0)
    conf = torch.where(work[:, None], conf, 0.0)
    edited = None
    if editable is not None:
        edited = editable.to(dev) & (conf > floats.editing_threshold) & (proposals != tokens)
        committed = committed | edited
    new_tokens = torch.where(committed, proposals, tokens)
    active = work if edited is None else masked.any(dim=1) | edited.any(dim=1)
    probability = None
    if params.record_steps:
        probability = torch.where(work[:, None], _probability(logp, model_prob, params), 0.0)
    return StepResult(
        tokens=new_tokens,
        committed=committed,
        proposals=proposals,
        logprobs=logp,
        confidence=conf,
        active=active,
        edited=edited,
        probability=probability,
    )


def _probability(logp: torch.Tensor, model_prob: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The proposal's probability under the sampling distribution (``exp`` of its log-prob); greedy: the model
    probability of the argmax (DARE's MDPO rollouts: ``p.max``)."""
    return logp.exp() if params.temperature > 0 else model_prob


def propose(
    logits: torch.Tensor, params: SamplingParams, streams: Streams, offset: int, mask_token_id: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Proposals x0 [n, W] and their probabilities (as :attr:`StepResult.probability`) at W positions outside
    the block from their logits [n, W, V]: what MDPO records at a full-attention model's later blocks (DARE's
    ``mdpo_llada_rollout.py`` samples x0 at every masked position of the canvas). They draw from the rows'
    streams at positions ``offset`` .. ``offset + W - 1`` of the step (the block's own draws use 0 .. B - 1, so
    the block decodes the same tokens with or without them). Sampled ``PROPOSE_CHUNK`` positions at a time: the
    float32 temporaries stay that wide whatever the canvas (a 512-token LLaDA canvas is 0.25 GB of logits per row)."""
    W = logits.shape[1]
    draws = streams.uniforms(SAMPLE, offset + W)[:, offset:] if params.temperature > 0 else None
    proposals, probability = [], []
    for at in range(0, W, PROPOSE_CHUNK):
        part = _proposal_logits(logits[:, at : at + PROPOSE_CHUNK], mask_token_id)
        u = None if draws is None else draws[:, at : at + PROPOSE_CHUNK]
        x0, logp, model_prob = sample_tokens(part, params.temperature, params.top_k, params.top_p, u)
        proposals.append(x0)
        probability.append(_probability(logp, model_prob, params))
    return torch.cat(proposals, dim=1), torch.cat(probability, dim=1)


class TraceCounts(NamedTuple):
    """A block's device records (:class:`BlockTrace`) as plain tensors, so a compiled step can update them:
    ``count`` [n] steps each row took, ``forward`` / ``block_step`` / ``logprob`` [n, B] per committed position
    the row's step count before the step, the block-local step index, the log-prob (-1 / -1 / 0: uncommitted),
    ``next_step`` [n] the block-local index the next step runs with."""

    count: torch.Tensor
    forward: torch.Tensor
    block_step: torch.Tensor
    logprob: torch.Tensor
    next_step: torch.Tensor

    @classmethod
    def start(cls, like: torch.Tensor) -> "TraceCounts":
        """Nothing recorded yet for a block shaped as ``like`` [n, B]."""
        dev = like.device
        return cls(
            torch.zeros(like.shape[0], dtype=torch.long, device=dev),
            torch.full(like.shape, -1, dtype=torch.long, device=dev),
            torch.full(like.shape, -1, dtype=torch.long, device=dev),
            torch.zeros(like.shape, dtype=torch.float32, device=dev),
            torch.zeros(like.shape[0], dtype=torch.long, device=dev),
        )

    def after(self, result: StepResult, step: torch.Tensor) -> "TraceCounts":
        """The records with step ``result`` (block-local index ``step`` [n]) added; the next step ``step + 1``."""
        c = result.committed & result.active[:, None]
        return TraceCounts(
            self.count + result.active.long(),
            torch.where(c, self.count[:, None], self.forward),
            torch.where(c, step[:, None], self.block_step),
            torch.where(c, result.logprobs.float(), self.logprob),
            step + 1,
        )


def denoise_step(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    trace: TraceCounts,
    params: Union[SamplingParams, TracedParams],
    streams: Streams,
    mask_token_id: int,
) -> tuple[StepResult, TraceCounts]:
    """One step of the built-in engine's block loop as one function (compiled: one graph, no eager op between
    forwards): the masked positions of ``tokens``, :func:`dllm_step` at block-local step ``trace.next_step`` and
    the rows' streams ``streams`` (:meth:`Streams.ahead` of the block) advanced by the steps they took, the step
    recorded into ``trace``. The same numbers as those calls made one by one (``BlockTrace.add``)."""
    masked = tokens == mask_token_id
    step = trace.next_step
    result = dllm_step(logits, BlockState(tokens, masked), step, params, streams.at(trace.count), mask_token_id)
    return result, trace.after(result, step)


def history_entry(
    result: StepResult,
    count: torch.Tensor,
    step: torch.Tensor,
    later: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, ...]:
    """What :class:`BlockTrace` keeps of a step (``count``: the rows' step counts before it, ``step``: its
    block-local index [n], ``later``: :meth:`BlockTrace.add`'s): committed, count, step, log-prob, tokens, active,
    proposals, confidences (:meth:`BlockTrace.stacked_history`)."""
    c = result.committed & result.active[:, None]
    proposals = result.proposals
    confidence = result.confidence if result.probability is None else result.probability
    if later is not None:
        proposals, confidence = torch.cat([proposals, later[0]], 1), torch.cat([confidence, later[1]], 1)
    return (c, count.clone(), step, result.logprobs.float(), result.tokens, result.active, proposals, confidence)


class BlockTrace:
    """Per-row records of one block's denoising, kept on the device step by step and read once.

    Device tensors, updated by :meth:`add` without host synchronisation: ``count`` [n] (steps each row took in
    this block), ``forward`` / ``block_step`` / ``logprob`` [n, B] (for each committed position the row's step
    count before the step that committed it, the block-local step index it ran with, the log-prob; -1 / -1 / 0
    where nothing was committed). ``keep_history`` (token editing's overwritten commits) and ``record_steps``
    (the proposals and confidences of every step, MDPO) also keep each step's tensors.

    Host views, built on first read (one copy): ``records[b][pos] = (forward, block_step, logprob)`` (the latest
    commit), ``superseded[b][pos]`` the earlier commits of an edited position, in order, as ``(forward,
    block_step, logprob, token)``, ``num_steps[b]``, and with ``record_steps`` ``preds[b]`` / ``confs[b]`` (one list
    per step the row took)."""

    def __init__(self, n: int, record_steps: bool = False, keep_history: bool = False):
        self.n, self.record_steps = n, record_steps
        self.keep_history = keep_history or record_steps
        self.count: Optional[torch.Tensor] = None
        self.forward = self.block_step = self.logprob = None
        self._history: list[tuple[torch.Tensor, ...]] = []
        self._host: Optional[dict] = None
        self._next: Optional[torch.Tensor] = None  # TraceCounts.next_step

    def _start(self, like: torch.Tensor) -> None:
        self.load(TraceCounts.start(like))

    def state(self, like: torch.Tensor) -> "TraceCounts":
        """The device records so far (a fresh block's when nothing was added), for :func:`denoise_step`."""
        if self.count is None:
            self._start(like)
        return TraceCounts(self.count, self.forward, self.block_step, self.logprob, self._next)  # type: ignore[arg-type]

    def load(self, state: "TraceCounts") -> None:
        """Take the records :func:`denoise_step` returned (what :meth:`add` would have made of its steps)."""
        self.count, self.forward, self.block_step, self.logprob, self._next = state
        self._host = None

    def add(
        self, result: StepResult, step: StepIndex, later: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    ) -> None:
        """Record one step (``step``: the block-local step index it ran with, one int or one per row; ``later``:
        proposals and probabilities [n, W] at the W positions after the block (:func:`propose`), kept after the
        block's own in the step's history)."""
        if self.count is None:
            self._start(result.tokens)
        s = step_tensor(step, self.n, result.tokens.device)
        if self.keep_history:
            self._history.append(history_entry(result, self.count, s, later))
        self.load(self.state(result.tokens).after(result, s))

    def keep(self, entry: tuple[torch.Tensor, ...], state: "TraceCounts") -> None:
        """Record a step made elsewhere (``editing.editing_step``): its :func:`history_entry` and the records after
        it (what :meth:`add` would have made of it)."""
        if self.keep_history:
            self._history.append(entry)
        self.load(state)

    # ------------------------------------------------------------------ host views
    def _read(self) -> dict:
        if self._host is not None:
            return self._host
        n = self.n
        h: dict = {
            "records": [dict() for _ in range(n)],
            "superseded": [dict() for _ in range(n)],
            "num_steps": [0] * n,
            "preds": [[] for _ in range(n)],
            "confs": [[] for _ in range(n)],
        }
        if self.count is not None:
            h["num_steps"] = self.count.tolist()
            fwd, bstep, lp = self.forward.tolist(), self.block_step.tolist(), self.logprob.tolist()
            for b in range(n):
                h["records"][b] = {c: (f, s, lp[b][c]) for c, (f, s) in enumerate(zip(fwd[b], bstep[b])) if f >= 0}
            if self._history:
                self._read_history(h)
        self._host = h
        return h

    def _read_history(self, h: dict) -> None:
        """Overwritten commits (a position committed again replaces its record) and per-step proposals."""
        fields = [t.tolist() for t in self.stacked_history()]
        h["superseded"], h["preds"], h["confs"] = history_from_host(fields, self.n, self.record_steps)

    def stacked_history(self) -> tuple[torch.Tensor, ...]:
        """The kept steps as device tensors [S, n, ...], one per field (committed, step count before the step,
        block-local step, log-prob, tokens, active; with ``record_steps`` also proposals and confidences): what
        :func:`history_from_host` reads, in one copy per field (the caller may send them without a wait)."""
        width = len(self._history[0]) if self.record_steps else 6
        return tuple(torch.stack([entry[k] for entry in self._history]) for k in range(width))

    @property
    def records(self) -> list[dict[int, tuple[int, int, float]]]:
        return self._read()["records"]

    @property
    def superseded(self) -> list[dict[int, list[tuple[int, int, float, int]]]]:
        return self._read()["superseded"]

    @property
    def num_steps(self) -> list[int]:
        return self._read()["num_steps"]

    @property
    def preds(self) -> Optional[list[list[list[int]]]]:
        return self._read()["preds"] if self.record_steps else None

    @property
    def confs(self) -> Optional[list[list[list[float]]]]:
        return self._read()["confs"] if self.record_steps else None

    def entries(self, b: int, positions: Sequence[int], forwards_before: int = 0) -> list[tuple[int, int, float]]:
        """(global step, block-local step, log-prob) of row ``b`` at ``positions``; every position must have
        been committed."""
        records = self.records[b]
        out = []
        for p in positions:
            if p not in records:
                raise ValueError(f"BlockTrace: position {p} of row {b} was never committed")
            f, s, lp = records[p]
            out.append((forwards_before + f, s, lp))
        return out

    def superseded_entries(self, b: int, position: int, forwards_before: int = 0) -> list[list]:
        """The overwritten commits of row ``b`` at ``position``: ``[global step, block step, log-prob, token]``."""
        return [[forwards_before + f, s, lp, tok] for f, s, lp, tok in self.superseded[b].get(position, [])]


def history_from_host(fields: list[list], n: int, record_steps: bool) -> tuple[list[dict], list[list], list[list]]:
    """A block's kept steps (:meth:`BlockTrace.stacked_history`, read as lists ``fields[k][step][row]``) as host
    records of its ``n`` rows: the overwritten commits of each position, ``(forward, block_step, logprob,
    token)`` in order (a position committed again replaces its record), and with ``record_steps`` the proposals
    and confidences of every step the row took."""
    superseded: list[dict] = [dict() for _ in range(n)]
    preds: list[list] = [[] for _ in range(n)]
    confs: list[list] = [[] for _ in range(n)]
    last: list[dict[int, tuple]] = [dict() for _ in range(n)]
    for step in zip(*fields):
        committed, count, s, logp, tokens, active = step[:6]
        for b in range(n):
            if not active[b]:
                continue
            for c, hit in enumerate(committed[b]):
                if hit:
                    if c in last[b]:
                        superseded[b].setdefault(c, []).append(last[b][c])
                    last[b][c] = (count[b], s[b], logp[b][c], tokens[b][c])
            if record_steps:
                preds[b].append(step[6][b])
                confs[b].append(step[7][b])
    return superseded, preds, confs
