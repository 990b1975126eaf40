"""Estimators of the second kind: replay the decoding trajectory recorded by the engine.

The engine records for every response token the step at which it was committed (``commit_step``, global) and
the step inside its block (``block_step``). The trajectory's log-likelihood decomposes over steps,

    log pi(y | c) ~= sum_steps sum_{k committed at step s} log p_theta(y_k | x_s),

where x_s is the partially decoded state before step s (tokens committed earlier clean, the rest masked).
TraceRL (arXiv:2509.06949, dLLM-RL ``train/rl_trado.py::collect_training_data``) merges every ``shrink``
consecutive distinct steps into one fragment (trajectory shrinkage s); CJ-GRPO (arXiv:2509.23924) replays
every step.

* Block families (SDAR, TraDo, LLaDA2): steps are grouped per block (block-local step ids); round j takes the
  j-th group of every block at once. In the x_t ++ x_0 layout with the block-diffusion mask, each noisy block
  sees only the clean earlier blocks and itself -- exactly the state the sampler was in when it decoded that
  block -- so one row per round replays all blocks ("block-attention sliced training": #rows = max groups per
  block, not #steps).
* Full-attention families (LLaDA, Dream): one row per group of global steps, state = every token committed at a
  later step masked.

Token editing (LLaDA2.1, ``rollout.algorithm=editing``): a position may be committed more than once (the
trajectory's ``superseded`` commits, then the final one). Each commit is one action of the sampler, so the
trajectory's log-likelihood is the sum over *every* commit, superseded ones included, of
log p_theta(token | state before its step), where the state holds at each position its latest commit before
that step (masked if none) -- an edit is scored with the token it replaced in its input. Every commit is its own
slot (its own PPO ratio): slot k for the commit that wrote response token k, slot L + j for the j-th superseded
commit; it takes the advantage of its position. CJ-GRPO's per-step average runs over all commits of a step,
edits included. TraceRL's shrinkage would score two commits of one position from one state: refused (shrink
must be 1 for an edited trace; the config check says so before a run starts).

Canvas: with ``rl.canvas=eos`` the engine cuts the response after the first EOS; positions of the last block after
it (which the sampler also denoised) are not replayed, so the last block's states hold fewer masked positions.
With ``rl.canvas=full`` (LLaDA/Dream's default) every decoded position is replayed and each state is the
sampler's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Protocol

import torch

from megadare.diffusion.views import View, list_tensor


class Trace(Protocol):
    """What trace replay reads of a sample: its tokens and decoding trace (algos/base.py ``RLSample`` has them)."""

    index: int
    prompt_ids: list[int]
    response_ids: list[int]
    commit_step: Optional[list[int]]
    block_step: Optional[list[int]]
    superseded: Optional[list]


class Commit(NamedTuple):
    """One commit of the trace: response position, token written, global and block-local step, slot."""

    position: int
    token: int
    step: int
    block_step: int
    slot: int


def trace_commits(s: Trace) -> list[Commit]:
    """Every commit of the sample's trace: the one that wrote response token k (slot k), then the commits later
    edits overwrote (slot L + j for ``s.superseded[j]`` = (position, token, global step, block step, log-prob))."""
    L = len(s.response_ids)
    out = [
        Commit(k, int(s.response_ids[k]), int(s.commit_step[k]), int(s.block_step[k]), k)  # type: ignore[index]
        for k in range(L)
    ]
    for j, e in enumerate(s.superseded or []):
        out.append(Commit(int(e[0]), int(e[1]), int(e[2]), int(e[3]), L + j))
    return out


def _groups(ids: list[int], shrink: int) -> list[list[int]]:
    distinct = sorted(set(ids))
    return [distinct[i : i + shrink] for i in range(0, len(distinct), shrink)]


def _require_trace(s: Trace, name: str) -> None:
    if s.commit_step is None or s.block_step is None:
        raise ValueError(
            f"sample {s.index}: the {name} estimator replays the decoding trace, but the rollout "
            "recorded none (commit_step / block_step missing)"
        )
    if len(s.commit_step) != len(s.response_ids) or len(s.block_step) != len(s.response_ids):
        raise ValueError(
            f"sample {s.index}: the trace has {len(s.commit_step)} steps for {len(s.response_ids)} response tokens"
        )
    if any(not 0 <= int(e[0]) < len(s.response_ids) for e in s.superseded or []):
        raise ValueError(
            f"sample {s.index}: a superseded commit lies outside the {len(s.response_ids)} response tokens"
        )


def _twice_in_fragment(index: int, k: int, steps: list[int]) -> None:
    raise ValueError(
        f"sample {index}: position {k} is committed {len(steps)} times inside one replay fragment (steps {steps}): "
        "an edited trace needs shrink=1 (algo.params.shrink=1)"
    )


@dataclass(frozen=True)
class _Replay:
    """One sample's trace being replayed: x_0 = prompt ++ response, the commit chain of each response position
    (ordered by global step) and the mask token."""

    s: Trace
    x0: torch.Tensor
    chains: dict[int, list[Commit]]
    mask_id: int

    def round_view(
        self, start: Callable[[int], Optional[int]], group: Callable[[int], set], key: Callable[[Commit], int]
    ) -> tuple[View, list[int]]:
        """The state before one replay round and what it scores. Per response position k: ``start(k)`` the first
        step (under ``key``) of k's unit in this round (None: the unit has no such round, k holds its final token
        and is not scored); the input holds k's latest commit before it (or the mask); the commit of k whose step
        is in ``group(k)`` is scored, with its own token as the target."""
        s, x0, mask_id = self.s, self.x0, self.mask_id
        P = len(s.prompt_ids)
        tokens, labels = x0.tolist(), x0.tolist()  # Python lists: one tensor each at the end, not one write a token
        coef, slot = [0.0] * len(tokens), [-1] * len(tokens)
        steps: set[int] = set()
        for k, chain in self.chains.items():
            first = start(k)
            if first is None:
                continue
            in_group, latest, scored = group(k), mask_id, None
            for c in chain:  # ordered by step: the input is the latest commit before the round
                if key(c) < first:
                    latest = c.token
                if key(c) in in_group:
                    if scored is not None:
                        _twice_in_fragment(s.index, k, [c.step for c in chain if key(c) in in_group])
                    scored = c
            tokens[P + k] = latest
            if scored is not None:
                coef[P + k], slot[P + k], labels[P + k] = 1.0, scored.slot, scored.token
                steps.add(scored.step)
        long = torch.long
        view = View(
            tokens=list_tensor(tokens, long),
            coef=list_tensor(coef, torch.float32),
            slot=list_tensor(slot, long),
            labels=list_tensor(labels, long) if s.superseded else None,
        )
        return view, sorted(steps)


WHOLE_ROUNDS_FROM = 64  # response tokens from which an unedited trace's rounds are built as whole tensors


def replay_views(
    s: Trace, mask_id: int, block_size: int, shrink: int = 1, block_family: bool = True
) -> list[tuple[View, list[int]]]:
    """(view, steps it scores) for every replay round; commit slots (each commit is scored exactly once)."""
    _require_trace(s, "trace-replay")
    P = len(s.prompt_ids)
    x0 = torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)
    if not s.superseded and len(s.response_ids) >= WHOLE_ROUNDS_FROM and (block_size > 0 or not block_family):
        return _unedited_rounds(s, x0, mask_id, block_size if block_family else 0, shrink)
    commits = trace_commits(s)
    chains: dict[int, list[Commit]] = {}
    for c in sorted(commits, key=lambda c: c.step):
        chains.setdefault(c.position, []).append(c)
    replay = _Replay(s, x0, chains, mask_id)
    if block_family:
        blk = {k: (P + k) // block_size for k in chains}
        steps_of_block: dict[int, list[int]] = {}  # one pass over the commits (not one per block)
        for c in commits:
            steps_of_block.setdefault(blk[c.position], []).append(c.block_step)
        per_block = {b: _groups(steps, shrink) for b, steps in steps_of_block.items()}
        sets = {b: [set(g) for g in groups] for b, groups in per_block.items()}
        rounds = max((len(g) for g in per_block.values()), default=0)
        return [
            replay.round_view(
                lambda k, j=j: per_block[blk[k]][j][0] if j < len(per_block[blk[k]]) else None,
                lambda k, j=j: sets[blk[k]][j],
                lambda c: c.block_step,
            )
            for j in range(rounds)
        ]
    return [
        replay.round_view(lambda k, g=g: g[0], lambda k, g=g: set(g), lambda c: c.step)
        for g in _groups([c.step for c in commits], shrink)
    ]


def _unedited_rounds(s: Trace, x0: torch.Tensor, mask_id: int, block_size: int, shrink: int):
    """``replay_views`` of a trace without edits (one commit a position: response token k, slot k), every round
    at once as [rounds, P + L] tensors, not a Python loop over positions per round (from ``WHOLE_ROUNDS_FROM``
    response tokens: below, torch's per-call cost outweighs the loop). Units: the blocks (``block_size`` > 0,
    keyed by block step) or the whole response (global steps). A unit's groups are runs of its sorted distinct
    steps, so position k is scored in round j iff the group's first step <= its step <= the group's last, and
    holds its token in the input iff below the first; a unit without a round j keeps its final tokens, unscored."""
    P, L = len(s.prompt_ids), len(s.response_ids)
    step = [int(t) for t in s.commit_step]  # type: ignore[union-attr]
    unit: Optional[torch.Tensor] = None
    if block_size > 0:
        key, first = [int(t) for t in s.block_step], P // block_size  # type: ignore[union-attr]
        bounds = range(first * block_size - P, L, block_size)  # each block's first response position (<= 0 first)
        unit_groups = [_groups(key[max(b, 0) : b + block_size], shrink) for b in bounds]
        unit = torch.arange(P, P + L) // block_size - first
    else:
        key, unit_groups = step, [_groups(step, shrink)]
    R = max((len(g) for g in unit_groups), default=0)
    if R == 0:
        return []
    lo, hi = [], []  # [units, R] flattened: each unit's group bounds per round (0, -1: no such round)
    for groups in unit_groups:
        lo += [g[0] for g in groups] + [0] * (R - len(groups))
        hi += [g[-1] for g in groups] + [-1] * (R - len(groups))
    lo_t, hi_t = (list_tensor(x, torch.long).view(len(unit_groups), R) for x in (lo, hi))
    if unit is not None:
        lo_t, hi_t = lo_t[unit], hi_t[unit]
    lo_t, hi_t = lo_t.T, hi_t.T
    key_t = list_tensor(key, torch.long)
    scored = (key_t >= lo_t) & (key_t <= hi_t)
    masked = (key_t >= lo_t) & (lo_t <= hi_t)  # committed at or after the round's first step: masked in its input
    tokens = torch.cat([x0[:P].expand(R, P), x0[P:].expand(R, L).masked_fill(masked, mask_id)], 1)
    coef = torch.cat([torch.zeros(R, P), scored.float()], 1)
    slot = torch.cat([torch.full((R, P), -1, dtype=torch.long), torch.where(scored, torch.arange(L), -1)], 1)
    steps: list[set[int]] = [set() for _ in range(R)]
    for j, k in zip(*(t.tolist() for t in scored.nonzero(as_tuple=True))):
        steps[j].add(step[k])
    return [(View(tokens=tokens[j], coef=coef[j], slot=slot[j]), sorted(steps[j])) for j in range(R)]


def shrunk_steps(s: Trace, block_size: int, shrink: int = 1, block_family: bool = True) -> list[int]:
    """Each response token's step after TraceRL's shrinkage: the last global step of its replay group (per block
    of the sample's grid on block families, over the whole response otherwise) -- dLLM-RL's shrunk step map
    (``collapse_k_unique``, ``train/rl_trado.py:219-231, 516-522``, ``rl_llada.py:256-257``), which its value
    trainer aggregates over (``train_trado_value.py:491-497, 752-790``): one step of the value model's step-level
    GAE is one replayed fragment of one block."""
    _require_trace(s, "trace-replay")
    P, steps = len(s.prompt_ids), [int(t) for t in s.commit_step]  # type: ignore[union-attr]
    units: dict[int, list[int]] = {}
    for k in range(len(steps)):
        units.setdefault((P + k) // block_size if block_family else 0, []).append(k)
    out = list(steps)
    for ks in units.values():
        last = {t: g[-1] for g in _groups([steps[k] for k in ks], shrink) for t in g}
        for k in ks:
            out[k] = last[steps[k]]
    return out
