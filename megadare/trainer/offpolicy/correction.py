"""Rollout correction inside the RL loop: behaviour log-probs, per-slot importance weights, multi-behaviour
(balance-heuristic) weights and the replay match scores. The formulas live in importance.py and replay.py beside
it; this module feeds them the right numbers.

Which log-probs go into a ratio (``offpolicy.behaviour_logp``; importance.py explains why):

* ``trainer`` (every algorithm): the behaviour estimate of slot s is the algorithm's own estimator, on the same
  stored corruptions / replay states, evaluated with the weights of the version that generated the sample
  (``WeightSnapshots``); for a sample of the current version it *is* the proximal estimate, so its ratio is
  exactly 1 -- the correction is the identity when the weights did not change.
* ``engine`` (trace-replay algorithms whose views are one state per recorded step: CJ-GRPO, TraceRL at shrink 1;
  rollout temperature 1, no top-k / top-p): the engine's sampler log-prob of each committed token at the state
  it was committed in. Includes the engine/trainer numerical mismatch (and the engine's exclusion of the mask
  token from the distribution), which is what a mismatch correction is for; the ratio is then 1 only up to it.

Per-slot weights (``offpolicy.loss_mode=decoupled``): w_s = IS(l_s^prox, l_s^behave) from ``rollout_is_weights`` at
``offpolicy.rollout_is`` level (token: per slot; sequence / geometric: over the slots of a sample), truncated or masked
at ``offpolicy.rollout_is_threshold``. With ``replay.pmis`` and several behaviour versions in the batch the weight of a
sample is the balance-heuristic weight p(x) / sum_j (n_j / n) q_j(x) over the versions j present (sequence
estimates; Veach & Guibas 1995), truncated at the same threshold.

Slot values are summed per (sample, slot) on the ranks that hold the last pipeline stage and gathered over the
whole world (slots of one sample may sit on different data-parallel ranks), so every rank computes the same
weights, selections and metrics.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from megadare.config import Config
from megadare.data.rows import MicroBatch
from megadare.trainer.offpolicy.importance import RolloutIS, rollout_is_weights
from megadare.trainer.offpolicy.queue import PARTIAL_STATE
from megadare.trainer.offpolicy.replay_scores import balance_heuristic_weights, chi2_ess, variance_guided_scores
from megadare.trainer.step import RowFormat, outputs_of

Key = tuple[int, int]  # (sample index, slot)


Columns = Callable[[MicroBatch], list[Optional[torch.Tensor]]]  # per-position tensors of a micro-batch


def gather_slot_sums(micro_batches: list[MicroBatch], columns: Columns) -> dict[Key, list[float]]:
    """{(sample, slot): [sum over the slot's positions of weight * c for c in columns(mb)]} over the world."""
    local: dict[Key, list[float]] = {}
    for mb in micro_batches:
        cols = columns(mb)
        if any(c is None for c in cols):
            continue  # not the last pipeline stage (or an empty micro-batch)
        sel = mb.slot >= 0
        if not bool(sel.any()):
            continue
        w = mb.weight[sel].double()
        sample, slot = mb.sample[sel].tolist(), mb.slot[sel].tolist()
        vals = [(w * c[sel].double()).tolist() for c in cols]
        for i, key in enumerate(zip(sample, slot)):
            acc = local.setdefault(key, [0.0] * len(cols))
            for j in range(len(cols)):
                acc[j] += vals[j][i]
    parts = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
    out: dict[Key, list[float]] = {}
    for p in parts:
        out.update(p)  # a slot lives in one micro-batch: tensor-parallel copies carry the same sums
    return out


def put_slot_values(micro_batches: list[MicroBatch], key: str, table: dict[Key, float], default: float = 0.0) -> None:
    """``mb.put(key)`` at every position = the value of its (sample, slot) (``default`` where unscored)."""
    for mb in micro_batches:
        if mb.slot is None:
            continue
        keys = zip(mb.sample.flatten().tolist(), mb.slot.flatten().tolist())
        mb.put(key, torch.tensor([table.get(k, default) for k in keys], dtype=torch.float32).view_as(mb.slot))


def store_behaviour(shape, corr, micro_batches: list[MicroBatch], versions: set[int]) -> None:
    """``version_logp[v]`` for every v in ``versions`` (the current one is the proximal pass ``old``) and
    ``behave`` = lp under each position's own version: the version of the token it predicts when the
    response was generated across weight updates (``corr.token_versions``, partial rollouts), else the sample's
    (``corr.version_of``). (A sequence slot of such a response mixes versions; it takes each position's token
    version.) ``shape``: rl_update.TrainShape; ``corr``: rl_update.Correction (its weight ``snapshots``)."""
    model, kind, block, vocab = shape.model, shape.kind, shape.block, shape.arch.vocab_size
    version_of, current, snapshots = corr.version_of, corr.current, corr.snapshots
    for v in sorted(versions):
        if v == current:
            for mb in micro_batches:
                if mb.old is not None:
                    mb.version_logp[v] = mb.old
            continue
        with snapshots.swapped_in(v):
            for mb, lp in zip(micro_batches, outputs_of(model, micro_batches, RowFormat(kind, block, vocab))):
                mb.version_logp[v] = lp
    for mb in micro_batches:
        if mb.old is None:
            continue
        tv = corr.token_versions or {}
        own = torch.tensor(
            [
                tv[s][k] if s in tv and 0 <= k < len(tv[s]) else version_of.get(s, current)
                for s, k in zip(mb.sample.flatten().tolist(), mb.tok.flatten().tolist())
            ]
        ).view_as(mb.sample)
        behave = mb.old.clone()
        for v in versions:
            behave = torch.where(own == v, mb.version_logp[v], behave)
        mb.behave = behave


def store_engine_behaviour(micro_batches: list[MicroBatch], engine_logprobs: dict[int, list[float]]) -> None:
    """``behave`` = the engine's sampler log-prob of the commit each scored position predicts: indexed by
    slot, which trace replay numbers as the engine does (token k, then the superseded commits of token editing;
    only trace replay at one state per step may use engine log-probs, ``check_correction_config``)."""
    for mb in micro_batches:
        if mb.slot is None:
            continue
        vals = [
            engine_logprobs[s][sl] if sl >= 0 and k >= 0 else 0.0
            for s, k, sl in zip(mb.sample.flatten().tolist(), mb.tok.flatten().tolist(), mb.slot.flatten().tolist())
        ]
        mb.behave = torch.tensor(vals, dtype=torch.float32).view_as(mb.slot)


def correction_weights(
    cfg: Config, micro_batches: list[MicroBatch], version_of: dict[int, int], versions: set[int]
) -> dict[str, float]:
    """Per-slot IS weights into ``is_weight`` (decoupled loss); returns the IS / mixture metrics."""
    off = cfg.offpolicy
    pmis = cfg.replay.enable and cfg.replay.pmis and len(versions) > 1
    ver = sorted(versions) if pmis else []
    sums = gather_slot_sums(micro_batches, lambda mb: [mb.old, mb.behave] + [mb.version_logp.get(v) for v in ver])
    if not sums:
        return {}
    order = sorted(sums)
    old = torch.tensor([sums[k][0] for k in order], dtype=torch.float64)
    behave = torch.tensor([sums[k][1] for k in order], dtype=torch.float64)
    group = torch.tensor([k[0] for k in order])
    w, _, m = rollout_is_weights(old, behave, group, RolloutIS.of(off))
    metrics = {f"is/{k}": v for k, v in m.items()}
    if pmis:
        samples = sorted({k[0] for k in order})
        pos = {s: i for i, s in enumerate(samples)}
        seq = torch.zeros(len(versions) + 1, len(samples), dtype=torch.float64)
        for k in order:  # row 0: proximal (target); rows 1..: each behaviour version
            seq[:, pos[k[0]]] += torch.tensor([sums[k][0]] + sums[k][2:], dtype=torch.float64)
        ver = sorted(versions)
        counts = torch.tensor([sum(version_of[s] == v for s in samples) for v in ver], dtype=torch.float64)
        ws = balance_heuristic_weights(seq[0], seq[1:], counts, log_clamp=20.0, threshold=off.rollout_is_threshold)
        w = torch.stack([ws[pos[k[0]]] for k in order])
        diag = chi2_ess(torch.log(ws))
        metrics.update(
            {
                "is/mixture_weight_mean": float(ws.mean()),
                "is/mixture_weight_max": float(ws.max()),
                "is/mixture_ess": diag["ess"],
                "is/mixture_chi2": diag["chi2"],
            }
        )
    put_slot_values(micro_batches, "is_weight", {k: float(wi) for k, wi in zip(order, w)})
    return metrics


def replay_scores(micro_batches: list[MicroBatch], kind: str) -> dict[int, float]:
    """{sample: variance-guided score} from the per-slot log ratios l_s^cur - l_s^behave of each sample
    (trainer/offpolicy/replay_scores.py ``variance_guided_scores``; lower = better matched to the current policy)."""
    sums = gather_slot_sums(micro_batches, lambda mb: [mb.old, mb.behave])
    by: dict[int, list[float]] = {}
    for (s, _), (cur, beh) in sorted(sums.items()):
        by.setdefault(s, []).append(cur - beh)
    if not by:
        return {}
    samples = sorted(by)
    scores = variance_guided_scores([torch.tensor(by[s], dtype=torch.float64) for s in samples], kind=kind)
    return {s: float(v) for s, v in zip(samples, scores)}


def needs_snapshots(cfg: Config, ahead: int) -> bool:
    """Weight snapshots are needed when samples of older versions reach the trainer (queued rollouts or replay)
    and their behaviour log-probs come from the trainer."""
    return (
        cfg.offpolicy.loss_mode != "ppo"
        and cfg.offpolicy.behaviour_logp == "trainer"
        and (ahead > 0 or cfg.replay.enable)
    )


def bypass_rejection(cfg: Config):
    """keep(logp_current, logp_behave) per slot for ``offpolicy.loss_mode=bypass`` with ``offpolicy.rollout_is=token``:
    ``rollout_is_weights`` at token level on the current / behaviour slot estimates (mask mode rejects outside
    the thresholds, truncate mode keeps everything but vetoed slots)."""
    setting = RolloutIS.of(cfg.offpolicy, level="token")

    def keep(current: torch.Tensor, behave: torch.Tensor) -> torch.Tensor:
        return rollout_is_weights(current.detach(), behave.detach(), None, setting)[1]

    return keep


def with_replayed(buffer, fresh: list[Any], replayed: list[Any]) -> list[Any]:
    """The step's training samples: ``fresh``, then copies of ``replayed`` renumbered after them (``reindex``);
    ``buffer`` (offpolicy.replay.ReplayBuffer) keeps copies of the fresh ones as they were collected. Copies: the
    step's update writes into the samples it trains on (TraceRL's ``batch_rows`` stamps the mini-batch's longest
    response, replayed ones included, into ``extra``), and a later step replaying one must read it as its own
    step left it, not as this step's mini-batch did."""
    buffer.add([own_copy(s) for s in fresh])
    return fresh + reindex(replayed, fresh)


def own_copy(s: Any) -> Any:
    """A shallow copy of sample ``s`` with its own ``extra`` dict (what the steps write into)."""
    c = copy.copy(s)
    c.extra = dict(s.extra)
    return c


def reindex(replayed: list[Any], fresh: list[Any]) -> list[Any]:
    """Copies of the replayed samples with indices and prompt groups after the fresh ones' (groups kept whole).
    Copies: the replay buffer keeps the originals, whose (version, group) key must stay the prompt's own in later
    steps (renumbered in place, two prompts of one version renumbered at two steps would share a key, and be
    pooled, selected and split into mini-batches as one group); ``extra`` is copied too, for the algorithms that
    write into it per step."""
    first = max((s.index for s in fresh), default=-1) + 1
    gfirst = max((s.group for s in fresh), default=-1) + 1
    groups: dict[tuple[int, int], int] = {}
    out = []
    for j, s in enumerate(replayed):
        key = (int(s.policy_version or 0), s.group)
        c = own_copy(s)
        c.group, c.index = groups.setdefault(key, gfirst + len(groups)), first + j
        out.append(c)
    return out


def oldest_needed(cfg: Config, step: int, ahead: int, held: Iterable[int] = ()) -> int:
    """The oldest policy version a sample trained at ``step`` or later can still come from: a queued rollout is at
    most ``ahead`` versions old; the replay buffer holds k versions below its newest, which itself can be
    ``ahead`` versions older than the step that added it (step - 1), and no later than the oldest version it
    holds (``held``: ``ReplayBuffer.versions``): a step that collected nothing (every group filtered) adds no
    version, and the buffer's window, counted from its newest version, then reaches further back."""
    return min([step - ahead - (cfg.replay.k if cfg.replay.enable else 0), *held])


def restored_queue_problem(cfg: Config, queue: dict, ahead: int, held: Iterable[int], snapshots) -> Optional[str]:
    """What a resumed run's settings cannot train of the queued rollouts its checkpoint restores (``queue``: step
    -> (prompt indices, trajectories)), else None: a rollout staler than ``offpolicy.max_staleness``, or (with
    ``snapshots``, the loaded ``WeightSnapshots``) one whose behaviour snapshot is missing or dropped at once under
    the resumed lookahead ``ahead`` (``oldest_needed``). Both follow a smaller ``offpolicy.mode`` /
    ``offpolicy.max_staleness`` than the checkpoint was saved with, and failed mid-run in a raw RuntimeError."""
    o = cfg.offpolicy
    for step, (_, traj) in sorted((int(k), v) for k, v in queue.items()):
        version = min((int(t.policy_version) for t in queued_trajectories(traj)), default=step)
        stale = f"the queued rollout of RL step {step + 1} comes from policy version {version} ({step - version} "
        if step - version > o.max_staleness:
            return stale + f"versions stale), more than {cfg.as_written('offpolicy.max_staleness')}={o.max_staleness}"
        if snapshots is not None and (
            version not in snapshots.store or version < oldest_needed(cfg, step, ahead, held)
        ):
            return stale + (
                f"versions stale), whose weight snapshot {cfg.as_written('offpolicy.mode')}={o.mode} does not keep "
                f"({ahead} version(s) ahead)"
            )
    return None


def queued_trajectories(traj: Any) -> list:
    """The trajectories of a queued rollout as a checkpoint holds it: a list, or a partial rollout's state
    (``PartialRollout.state_dict``: the segments generated so far; its later ones go on the weights of the resumed
    run)."""
    if isinstance(traj, dict) and PARTIAL_STATE in traj:
        return [seg for segs in traj[PARTIAL_STATE]["parts"] for seg in segs]
    return list(traj)


def queued_samples_per_prompt(indices: list[int], traj: Any) -> int:
    """The responses per prompt of a queued rollout as a checkpoint holds it (its rl.n_samples when it started):
    its trajectories, or a partial rollout's prompts (one per response), over its prompt indices."""
    n = len(traj[PARTIAL_STATE]["prompts"]) if isinstance(traj, dict) and PARTIAL_STATE in traj else len(traj)
    return n // max(len(indices), 1)


def version_table(samples: list[Any]) -> dict[int, int]:
    return {s.index: int(s.policy_version or 0) for s in samples}


def engine_table(samples: list[Any]) -> Optional[dict[int, list[float]]]:
    if not samples or samples[0].engine_logprobs is None:
        return None
    return {s.index: s.engine_logprobs for s in samples}


__all__ = [
    "gather_slot_sums",
    "put_slot_values",
    "store_behaviour",
    "store_engine_behaviour",
    "correction_weights",
    "replay_scores",
    "needs_snapshots",
    "restored_queue_problem",
    "queued_samples_per_prompt",
    "bypass_rejection",
    "with_replayed",
    "own_copy",
    "reindex",
    "oldest_needed",
    "version_table",
    "engine_table",
]
