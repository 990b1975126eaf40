"""Trace replay's rounds (``trace_replay.replay_views``: all rounds of an unedited trace as whole tensors) against
the per-position construction it replaced, kept here: the same views (dtype, ``torch.equal``) and scored steps
for random traces -- block and full-attention families, several block sizes, shrink factors, lengths and seeds,
out-of-order commits inside a block, several commits a step, edited traces (the kept per-position path)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from megadare.diffusion import trace_replay
from megadare.diffusion.trace_replay import _groups, replay_views, trace_commits
from megadare.diffusion.views import View

from algo_toy import one_thread  # noqa: F401  (autouse fixture)

MASK = 99


def old_round_view(s, x0, chains, mask_id, start, group, key):
    P = len(s.prompt_ids)
    tokens, labels = x0.tolist(), x0.tolist()
    coef, slot = [0.0] * len(tokens), [-1] * len(tokens)
    steps: set[int] = set()
    for k, chain in chains.items():
        first = start(k)
        if first is None:
            continue
        in_group, latest, scored = group(k), mask_id, None
        for c in chain:
            if key(c) < first:
                latest = c.token
            if key(c) in in_group:
                assert scored is None, "committed twice in one fragment"
                scored = c
        tokens[P + k] = latest
        if scored is not None:
            coef[P + k], slot[P + k], labels[P + k] = 1.0, scored.slot, scored.token
            steps.add(scored.step)
    view = View(
        tokens=torch.tensor(tokens, dtype=torch.long),
        coef=torch.tensor(coef, dtype=torch.float32),
        slot=torch.tensor(slot, dtype=torch.long),
        labels=torch.tensor(labels, dtype=torch.long) if s.superseded else None,
    )
    return view, sorted(steps)


def old_replay_views(s, mask_id, block_size, shrink=1, block_family=True):
    P = len(s.prompt_ids)
    x0 = torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)
    commits = trace_commits(s)
    chains: dict = {}
    for c in sorted(commits, key=lambda c: c.step):
        chains.setdefault(c.position, []).append(c)
    if block_family:
        blk = {k: (P + k) // block_size for k in chains}
        steps_of_block: dict = {}
        for c in commits:
            steps_of_block.setdefault(blk[c.position], []).append(c.block_step)
        per_block = {b: _groups(steps, shrink) for b, steps in steps_of_block.items()}
        rounds = max((len(g) for g in per_block.values()), default=0)
        return [
            old_round_view(
                s, x0, chains, mask_id,
                lambda k, j=j: per_block[blk[k]][j][0] if j < len(per_block[blk[k]]) else None,
                lambda k, j=j: set(per_block[blk[k]][j]),
                lambda c: c.block_step,
            )
            for j in range(rounds)
        ]  # fmt: skip
    return [
        old_round_view(s, x0, chains, mask_id, lambda k, g=g: g[0], lambda k, g=g: set(g), lambda c: c.step)
        for g in _groups([c.step for c in commits], shrink)
    ]


def random_trace(rng: random.Random, P: int, L: int, block: int, edits: int):
    """A block-by-block decode: a random order inside each block, 1-3 tokens a step; ``edits`` superseded
    commits at steps before their position's final one."""
    commit, bstep, first, step = [0] * L, [0] * L, [0] * L, 0
    for b in range(0, L, block):
        order = list(range(b, min(b + block, L)))
        rng.shuffle(order)
        j = 0
        while j < len(order):
            n = rng.randint(1, 3)
            for k in order[j : j + n]:
                commit[k] = step
            j, step = j + n, step + 1
        for k in order:
            first[k], bstep[k] = commit[order[0]], commit[k] - commit[order[0]]
    superseded, taken = [], set()
    for _ in range(edits):
        k = rng.randrange(L)
        if commit[k] > first[k]:
            st = rng.randrange(first[k], commit[k])  # an earlier step of the same block's decode
            if (k, st) not in taken:
                taken.add((k, st))
                superseded.append((k, rng.randrange(3, 90), st, st - first[k], -0.5))
    return SimpleNamespace(
        index=0,
        prompt_ids=[rng.randrange(3, 90) for _ in range(P)],
        response_ids=[rng.randrange(3, 90) for _ in range(L)],
        commit_step=commit,
        block_step=bstep,
        superseded=superseded or None,
    )


def same(got, want) -> None:
    assert len(got) == len(want)
    for j, ((v, st), (w, wt)) in enumerate(zip(got, want)):
        assert st == wt, f"round {j}: steps {st} != {wt}"
        for f in ("tokens", "coef", "slot", "labels", "adv"):
            a, b = getattr(v, f), getattr(w, f)
            if a is None or b is None:
                assert a is None and b is None, f"round {j} {f}"
                continue
            assert a.dtype == b.dtype and torch.equal(a, b), f"round {j} {f}: {a} != {b}"


@pytest.mark.parametrize("whole_from", [0, trace_replay.WHOLE_ROUNDS_FROM])
@pytest.mark.parametrize("seed", range(4))
def test_replay_rounds_match_the_per_position_construction(seed, whole_from, monkeypatch):
    monkeypatch.setattr(trace_replay, "WHOLE_ROUNDS_FROM", whole_from)  # 0: every unedited trace as whole rounds
    rng = random.Random(seed)
    shapes = [(P, L, block) for P, L in [(0, 1), (1, 0), (3, 5), (16, 4)] for block in (1, 3, 4)]
    shapes += [(rng.randint(0, 30), rng.randint(1, 100), rng.choice([4, 32])), (64, 300, 4), (5, 70, 1), (0, 64, 7)]
    edited = 0
    for P, L, block in shapes:
        for edits in (0, 3):
            s = random_trace(rng, P, L, block, edits if L else 0)
            edited += bool(s.superseded)
            for shrink in (1, 2, 3):
                if s.superseded and shrink > 1:
                    continue  # an edited trace needs shrink 1 (its own error)
                for family in (True, False):
                    got = replay_views(s, MASK, block, shrink, block_family=family)
                    same(got, old_replay_views(s, MASK, block, shrink, block_family=family))
    assert edited > 0, "some traces have edits (the per-position path)"
