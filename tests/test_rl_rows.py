"""The RL update's rows (``algos/base.py::views_to_row``) position by position against their definition, written
here as plain per-position loops: each view one segment (block-diffusion families: x_t ++ x_0, the clean half
context only), labels / advantages the sample's unless the view carries its own, a slot's aggregation weight on its
first scored position in the row, Dream's targets one position left. The row builder joins tensor pieces (it runs
for every sample of every step); this pins what it must lay out."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from megadare.algos.base import RLSample, views_to_row
from megadare.diffusion.views import View
from megadare.models import get_family


def arch_of(family: str):
    fam = get_family(family)
    return replace(fam.arch(fam.tiny_config()), mask_token_id=99)


def random_views(rng: random.Random, P: int, L: int, n_views: int) -> list[View]:
    """Views of varying length with overlapping slots; every other view with its own labels and advantages."""
    views = []
    for vi in range(n_views):
        n = rng.randint(P + 1, P + L)
        slot = [rng.choice([-1, rng.randrange(L)]) if k >= P else -1 for k in range(n)]
        views.append(
            View(
                tokens=torch.tensor([rng.randrange(100) for _ in range(n)]),
                coef=torch.tensor([rng.random() if s >= 0 else 0.0 for s in slot], dtype=torch.float64),
                slot=torch.tensor(slot),
                labels=torch.tensor([rng.randrange(100) for _ in range(n)]) if vi % 2 else None,
                adv=torch.tensor([rng.uniform(-1, 1) for _ in range(n)]) if vi % 2 else None,
            )
        )
    return views


def expected_columns(s: RLSample, views: list[View], shift: bool, block: bool, weight: dict) -> dict[str, list]:
    P = len(s.prompt_ids)
    x0 = s.prompt_ids + s.response_ids
    col: dict[str, list] = {k: [] for k in ("tokens", "labels", "weight", "pos", "stream", "seg", "slot", "adv", "tok")}
    col["head"] = []
    seen = set()
    for vi, v in enumerate(views):
        n = len(v.tokens)
        labels = v.labels.tolist() if v.labels is not None else x0[:n]
        adv = v.adv.float().tolist() if v.adv is not None else [0.0] * P + [s.advantage] * (n - P)
        coef, slot = v.coef.float().tolist(), v.slot.tolist()
        tok = [k - P if k >= P else -1 for k in range(n)]
        if shift:  # position k-1 predicts token k; the last position scores nothing
            labels, coef, slot = labels[1:] + labels[:1], coef[1:] + [0.0], slot[1:] + [-1]
            adv, tok = adv[1:] + [0.0], tok[1:] + [-1]
        head = []
        for s_ in slot:
            head.append(weight.get(s_, 0.0) if s_ >= 0 and s_ not in seen else 0.0)
            seen.add(s_)
        halves = [(v.tokens.tolist(), labels, coef, list(range(n)), [0] * n, slot, head, adv, tok)]
        if block:
            halves.append(
                (x0[:n], x0[:n], [0.0] * n, list(range(n)), [1] * n, [-1] * n, [0.0] * n, [0.0] * n, [-1] * n)
            )
        for half in halves:
            for name, values in zip(
                ("tokens", "labels", "weight", "pos", "stream", "slot", "head", "adv", "tok"), half
            ):
                col[name] += values
            col["seg"] += [vi] * n
    return col


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
@pytest.mark.parametrize("n_views", [1, 3])
def test_row_columns_follow_their_definition(family, n_views):
    arch = arch_of(family)
    rng = random.Random(n_views)
    for trial in range(4):
        P, L = rng.randint(1, 5), rng.randint(2, 9)
        s = RLSample([rng.randrange(100) for _ in range(P)], [rng.randrange(100) for _ in range(L)], 1.0, 0.25, index=7)
        views = random_views(rng, P, L, n_views)
        weight = {k: rng.random() for k in range(L) if k % 3}  # slots missing from the table weigh 0
        row = views_to_row(s, views, arch, weight, denom=0.5)
        want = expected_columns(s, views, arch.logits_shift == 1, arch.is_block_diffusion, weight)
        got = {
            "tokens": row.tokens, "labels": row.labels, "weight": row.weight, "pos": row.position_ids,
            "slot": row.slot, "head": row.head, "adv": row.adv, "tok": row.tok,
        }  # fmt: skip
        for name, t in got.items():
            dtype = torch.long if name in ("tokens", "labels", "pos", "slot", "tok") else torch.float32
            assert t.dtype == dtype and torch.equal(t, torch.tensor(want[name], dtype=dtype)), (family, trial, name)
        stream = torch.tensor(want["stream"]) if arch.is_block_diffusion else None
        assert (row.stream_ids is None) == (stream is None) and (stream is None or torch.equal(row.stream_ids, stream))
        seg = torch.tensor(want["seg"]) if n_views > 1 else None
        assert (row.segment_ids is None) == (seg is None) and (seg is None or torch.equal(row.segment_ids, seg))
        assert row.denom == 0.5 and torch.equal(row.sample, torch.full((len(row),), 7))
        for v in views:  # the row owns its tensors: writing into it leaves the views as they were
            before = v.tokens.clone()
            row.tokens.fill_(-5)
            assert torch.equal(v.tokens, before)
