"""One RL update on the trainer: the algorithm's rows -> packed micro-batches -> old / reference / value /
behaviour passes -> rollout-correction weights -> ``rl.ppo_epochs`` x ``rl.mini_batches`` Megatron steps.
Also the distribution-matched replay selection, which needs the same passes on the buffer's candidates."""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megadare.algos.algorithm import ValueModelSettings
from megadare.algos.value_model import ValueObjective, step_advantages, values_of
from megadare.data.rows import global_denominator, pack_rows, split_for_data_parallel
from megadare.models.family import MaskKind, ModelArch
from megadare.models.lora import adapters_disabled
from megadare.parallel.cpu import hot_section
from megadare.trainer.offpolicy.replay import ReplayMatch, ReplayRule
from megadare.trainer.offpolicy.correction import (
    correction_weights,
    own_copy,
    replay_scores,
    store_behaviour,
    store_engine_behaviour,
)
from megadare.trainer.step import Readout, RowFormat, store_outputs, train_step

VALUES = Readout(per_position=values_of)  # the value model's per-position outputs

if TYPE_CHECKING:  # policy.py imports this module (Policy.prepare / update)
    from megadare.trainer.policy import Policy


@dataclass(frozen=True)
class TrainShape:
    """What every pass of an RL update runs with: the model's architecture, block size and attention mask kind,
    how rows are packed (``pad_id``; a micro-batch count ``multiple`` for interleaved pipelines), the policy's
    model chunks and the corruption seeding (``generator_for(seed, step, sample index, epoch)``)."""

    arch: ModelArch
    block: int
    kind: MaskKind
    pad_id: int
    multiple: int
    model: Any
    generator_for: Callable[[int, int, int, int], Any]

    @property
    def fmt(self) -> RowFormat:
        """How the passes read the rows (mask kind, block size, vocabulary)."""
        return RowFormat(self.kind, self.block, self.arch.vocab_size)


@dataclass(frozen=True)
class StepUpdate:
    """What one RL step's update works from: the run's config and algorithm, the step (it seeds the corruptions)
    and the ``TrainShape`` of its passes."""

    cfg: Any
    algo: Any
    step: int
    shape: TrainShape


def value_advantages(
    settings: ValueModelSettings, samples, micro_batches, steps_of: Callable[[Any], list[int]]
) -> dict[str, float]:
    """Token advantages and returns from the value model's V_old (TraceRL step-level aggregation over
    ``steps_of(sample)``, the algorithm's step of each response token), written into the micro-batches (``adv``,
    extras['ret']); values of a sample may sit on other data-parallel ranks (gathered)."""
    if not micro_batches or "v_old" not in micro_batches[0].extras:
        return {}  # not the last pipeline stage
    local = []
    for mb in micro_batches:
        sel = (mb.head != 0) & (mb.tok >= 0)
        if mb.slot is not None:  # token editing: a value is read where the final commit is scored (slot == tok)
            sel = sel & (mb.slot == mb.tok)
        local.extend(zip(mb.sample[sel].tolist(), mb.tok[sel].tolist(), mb.extras["v_old"][sel].tolist()))
    everything = [local]
    if ps.get_data_parallel_world_size() > 1:
        everything = [None] * ps.get_data_parallel_world_size()
        dist.all_gather_object(everything, local, group=ps.get_data_parallel_group())
    values: dict[tuple[int, int], float] = {(s, k): v for part in everything for s, k, v in part}
    table: dict[tuple[int, int], tuple[float, float]] = {}
    for s in samples:  # the scored tokens only (dLLM-RL's trainable mask, train_trado_value.py:759-790)
        scored = [k for k in range(len(s.response_ids)) if (s.index, k) in values]
        steps = steps_of(s)
        adv, ret = step_advantages(
            [values[(s.index, k)] for k in scored], [steps[k] for k in scored], s.reward, settings.gamma, settings.lam
        )
        for k, a, r in zip(scored, adv, ret):
            table[(s.index, k)] = (a, r)
    for mb in micro_batches:
        keys = list(zip(mb.sample.flatten().tolist(), mb.tok.flatten().tolist()))
        pairs = [table.get(key, (0.0, 0.0)) for key in keys]
        mb.adv = torch.tensor([a for a, _ in pairs], dtype=torch.float32).view_as(mb.tok)
        mb.extras["ret"] = torch.tensor([r for _, r in pairs], dtype=torch.float32).view_as(mb.tok)
    vals = torch.tensor([v for part in everything for _, _, v in part] or [0.0])
    return {"value_mean": float(vals.mean())}


@dataclass
class Correction:
    """What an off-policy update needs (``offpolicy.loss_mode`` decoupled / bypass): each sample's behaviour version,
    the trainer's weight snapshots (``offpolicy.behaviour_logp=trainer``) or the engine's log-probs (``engine``)."""

    version_of: dict[int, int]  # sample index -> behaviour policy version
    current: int  # the version the trainer holds (= the RL step)
    snapshots: Any = None  # offpolicy.queue.WeightSnapshots
    engine_logprobs: Optional[dict[int, list[float]]] = None
    token_versions: dict[int, list[int]] = field(default_factory=dict)  # partial rollouts: version per token
    metrics: dict[str, float] = field(default_factory=dict)


def _prepare(su: StepUpdate, samples, *, need_old: bool, epoch: int = 0):
    """Rows (corruptions of ``epoch``) -> packed micro-batches -> this DP rank's share (+ the proximal pass 'old')."""
    cfg, algo, step, sh = su.cfg, su.algo, su.step, su.shape
    with hot_section():  # megadare's own tensors on the host: no CUDA-to-CPU mode needed (parallel/cpu.py)
        rows = algo.batch_rows(samples, sh.arch, sh.block, lambda i: sh.generator_for(cfg.seed, step, i, epoch))
        if not rows:
            return None, None, 0
        mbs = pack_rows(rows, cfg.train.seq_length, cfg.train.micro_batch_size, pad_id=sh.pad_id)
    denom = global_denominator(mbs)
    mine = split_for_data_parallel(
        mbs, ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), multiple_of=sh.multiple
    )
    if need_old:
        store_outputs(sh.model, mine, "old", sh.fmt)
    return mine, denom, len(rows)


def _behaviour(corr: Correction, mine, versions: set[int], shape: TrainShape) -> None:
    if corr.engine_logprobs is not None:
        store_engine_behaviour(mine, corr.engine_logprobs)
    else:
        store_behaviour(shape, corr, mine, versions)


def corruption_draws(cfg, algo) -> int:
    """How many corruption sets a step draws: one per epoch when ``rl.redraw_corruptions`` (None: the algorithm's
    choice) is on, else one shared by every epoch."""
    redraw = cfg.rl.redraw_corruptions if cfg.rl.redraw_corruptions is not None else algo.redraw_corruptions
    return cfg.rl.ppo_epochs if redraw else 1


def prepare_all(su: StepUpdate, groups, policy: Policy, objective, correction, out) -> tuple[list[list], int]:
    """Every corruption set's micro-batches with their old / reference / value / behaviour passes, all taken before
    the first update: [draw][mini-batch] -> (micro-batches, denominator); and the number of rows."""
    cfg = su.cfg
    versions = set(correction.version_of.values()) if correction is not None else set()
    if correction is not None:
        versions |= {v for vs in correction.token_versions.values() for v in vs}
    draws, n_rows = corruption_draws(cfg, su.algo), 0
    prepared: list[list] = []
    for epoch in range(draws):
        sets = []
        for group in groups:
            mine, denom, n = _prepare(su, group, need_old=not objective.on_policy, epoch=epoch)
            if mine is None:
                continue
            n_rows += n
            _reference_passes(su, group, mine, policy)
            if correction is not None:
                _behaviour(correction, mine, versions, su.shape)
                if cfg.offpolicy.loss_mode == "decoupled":
                    for k, v in correction_weights(cfg, mine, correction.version_of, versions).items():
                        out[k] = out.get(k, 0.0) + v / (len(groups) * draws)
            sets.append((mine, denom))
        prepared.append(sets)
    return prepared, n_rows


def _reference_passes(su: StepUpdate, group, mine, policy: Policy) -> None:
    """``ref`` log-probs from the reference (the policy's ``ref_chunks``; with ``ref_adapters_off`` its own chunks
    with their LoRA adapters off) and the value model's V_old with its advantages."""
    shape, adapters_off, value = su.shape, policy.ref_adapters_off, policy.value
    ref_chunks = shape.model if adapters_off else policy.ref_chunks
    if ref_chunks is not None:
        with adapters_disabled(ref_chunks) if adapters_off else contextlib.nullcontext():
            store_outputs(ref_chunks, mine, "ref", shape.fmt)
    if value is not None:
        store_outputs(value.model, mine, "v_old", shape.fmt, VALUES)
        steps_of = functools.partial(su.algo.value_steps, arch=su.shape.arch, block_size=su.shape.block)
        value_advantages(su.algo.value_model, group, mine, steps_of)


def update(
    su: StepUpdate, samples, policy: Policy, objective, correction: Optional[Correction] = None
) -> dict[str, float]:
    """The algorithm's rows -> (old / ref / value / behaviour passes, IS weights) -> ppo_epochs x mini_batches
    optimizer steps of the policy (``su.shape.model``); epoch e trains on corruption set e when they are redrawn
    (``corruption_draws``)."""
    algo, shape, value, rl = su.algo, su.shape, policy.value, su.cfg.rl
    prompt_groups = sorted({s.group for s in samples})
    n_mb = min(rl.mini_batches, len(prompt_groups))
    groups = [[s for s in samples if s.group in prompt_groups[i::n_mb]] for i in range(n_mb)]  # whole groups
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    prepared, n_rows = policy.prepare(su, groups, objective, correction, out)
    out["prepare_s"] = time.perf_counter() - t0  # rows, packing, old / reference / value / behaviour passes
    out["train_rows"] = float(n_rows) / len(prepared)
    n = rl.ppo_epochs * len(prepared[0])
    for epoch in range(rl.ppo_epochs):
        for mine, denom in prepared[epoch % len(prepared)]:
            m = train_step(policy, mine, denom, shape.fmt, objective, Readout(entropy=True))
            if value is not None:
                vm = train_step(value, mine, denom, shape.fmt, ValueObjective(algo.value_model.clip), VALUES)
                m.update(
                    {"value_loss": vm["value_loss"], "value_mean": vm["value_mean"], "value_grad_norm": vm["grad_norm"]}
                )
            for k, v in m.items():
                out[k] = out.get(k, 0.0) + v / n
    return out


def scoring_copies(cands, base: int) -> list:
    """Copies of the replay candidates (``ReplayEntry``) for the scoring passes: candidate i is sample
    ``base + i``, and each (version, prompt group) its own group from ``base`` on, since groups of different
    versions share numbers (pairwise rows, VRPO, pair the responses of a group)."""
    groups: dict[tuple[int, int], int] = {}
    out = []
    for i, e in enumerate(cands):
        s = own_copy(e.sample)
        s.index, s.group = base + i, groups.setdefault((e.version, s.group), base + len(groups))
        out.append(s)
    return out


def scoring_correction(scored: list, cands, correction: Correction) -> tuple[Correction, set[int]]:
    """The behaviour of the candidates' scoring copies (``scoring_copies``) and the versions it needs: each
    copy's version and, for a partial rollout, each token's (``token_versions``), as the training batch's
    correction has them (rl.add_replay): a token decoded after a weight update is scored against the weights
    that decoded it, not the oldest of its response."""
    version_of = {s.index: e.version for s, e in zip(scored, cands)}
    per_token = {s.index: s.token_versions for s in scored if s.token_versions is not None}
    ctx = Correction(version_of, correction.current, correction.snapshots, token_versions=per_token)
    return ctx, set(version_of.values()) | {v for vs in per_token.values() for v in vs}


def replay_select(su: StepUpdate, buffer, n: int, correction: Correction) -> list:
    """Up to ``n`` replayed samples, chosen by ``ReplayBuffer.select`` with D-ARL's variance-guided score of each
    candidate's per-slot log ratios (current policy vs its behaviour version, the same estimator on the same
    corruptions). Costs a proximal and a behaviour pass over the candidates. The returned samples are the
    buffer's own (the caller renumbers copies of them, ``reindex``), with their version and advantage."""
    cfg, step = su.cfg, su.step
    cands = buffer.entries(step)
    if n <= 0 or not cands or not buffer.ready:
        return []
    base = 10_000_000
    scored = scoring_copies(cands, base)
    mine, _, _ = _prepare(su, scored, need_old=True)
    if mine is None:
        return []
    ctx, versions = scoring_correction(scored, cands, correction)
    _behaviour(ctx, mine, versions, su.shape)
    by_sample = replay_scores(mine, cfg.replay.score)
    scores = torch.tensor([by_sample.get(base + i, float("inf")) for i in range(len(cands))], dtype=torch.float64)
    sel = buffer.select(
        n,
        step,
        ReplayMatch(scores=scores),
        ReplayRule.of(cfg.replay),
        generator=torch.Generator().manual_seed(cfg.seed * 7919 + step),
    )
    correction.metrics.update(buffer.metrics(step, sel))
    return list(sel.samples)
