"""The corruption samplers' view construction (``CleanSequence.view`` / ``slots``, ``one_step``, ``coupled``)
against the plain construction it replaced, kept here: the same views -- dtype and ``torch.equal`` on tokens,
coef and slot -- and the same generator state after, on random prompts / responses of several lengths and seeds."""

from __future__ import annotations

import random

import pytest
import torch

from megadare.diffusion.corruption import CleanSequence, coupled, one_step
from megadare.diffusion.masking import complementary, mask_tokens
from megadare.diffusion.views import View

from algo_toy import one_thread  # noqa: F401  (autouse fixture)

MASK = 99
KINDS = ("token", "view", "sequence_per_view", "sequence")


def old_slots(seq: CleanSequence, scored: torch.Tensor, kind: str, view: int) -> torch.Tensor:
    P, L = seq.P, seq.L
    k = torch.arange(P + L) - P
    if kind == "token":
        s = k
    elif kind == "view":
        s = view * L + k
    elif kind == "sequence_per_view":
        s = torch.full((P + L,), view, dtype=torch.long)
    else:
        s = torch.zeros(P + L, dtype=torch.long)
    return torch.where(scored, s, torch.full_like(s, -1))


def old_view(seq: CleanSequence, masked, coef, slots: str, vi: int, scored=None) -> View:
    scored = masked.clone() if scored is None else scored
    scored[: seq.P] = False
    return View(
        tokens=mask_tokens(seq.x0, masked, seq.mask_id),
        coef=torch.where(scored, coef, torch.zeros_like(coef)),
        slot=old_slots(seq, scored, slots, vi),
    )


def old_one_step(seq: CleanSequence, g, p_prompt: float = 0.15, slots: str = "token") -> list[View]:
    P, L = seq.P, seq.L
    masked = torch.zeros(P + L, dtype=torch.bool)
    masked[P:] = True
    masked[:P] = torch.rand(P, generator=g, dtype=torch.float64) < p_prompt
    return [old_view(seq, masked, torch.ones(P + L), slots, 0)]


def old_coupled(seq: CleanSequence, g, t_low: float = 0.2, t_high: float = 0.8) -> list[View]:
    P, L = seq.P, seq.L
    t = t_low + (t_high - t_low) * float(torch.rand((), generator=g, dtype=torch.float64))
    u = torch.cat([torch.ones(P, dtype=torch.float64), torch.rand(L, generator=g, dtype=torch.float64)])
    resp = torch.arange(P + L) >= P
    full = resp.clone()
    b = (u < t) & resp
    c = complementary(b, resp)
    return [
        old_view(seq, full, torch.full((P + L,), 0.5), "token", 0),
        old_view(seq, b, torch.full((P + L,), 0.5 / t), "token", 1),
        old_view(seq, c, torch.full((P + L,), 0.5 / (1.0 - t)), "token", 2),
    ]


def same_views(got: list[View], want: list[View]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        for f in ("tokens", "coef", "slot"):
            x, y = getattr(a, f), getattr(b, f)
            assert x.dtype == y.dtype and torch.equal(x, y), f"view {i} {f}: {x} != {y}"
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"view {i} {f}: not bit for bit"


def sequences(seed: int):
    rng = random.Random(seed)
    for P, L in [(0, 3), (5, 0), (1, 1), (16, 4), (rng.randint(1, 40), rng.randint(1, 300)), (64, 512)]:
        yield CleanSequence.of([rng.randrange(3, 90) for _ in range(P)], [rng.randrange(3, 90) for _ in range(L)], MASK)


@pytest.mark.parametrize("seed", range(4))
def test_one_step_and_coupled_match_the_old_construction(seed):
    for seq in sequences(seed):
        for p_prompt, slots in [(0.15, "token"), (0.5, "view"), (1.0, "sequence"), (0.0, "sequence_per_view")]:
            g, h = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            same_views(one_step(seq, g, p_prompt, slots), old_one_step(seq, h, p_prompt, slots))
            assert torch.equal(g.get_state(), h.get_state())
        for lo, hi in [(0.2, 0.8), (0.0, 1.0), (0.5, 0.5)]:
            g, h = torch.Generator().manual_seed(seed + 7), torch.Generator().manual_seed(seed + 7)
            same_views(coupled(seq, g, lo, hi), old_coupled(seq, h, lo, hi))
            assert torch.equal(g.get_state(), h.get_state())


@pytest.mark.parametrize("seed", range(4))
def test_view_matches_the_old_construction(seed):
    g = torch.Generator().manual_seed(seed)
    for seq in sequences(seed):
        n = seq.P + seq.L
        for kind in KINDS:
            for vi in (0, 3):
                masked = torch.rand(n, generator=g) < 0.5
                coef = torch.randn(n, generator=g, dtype=torch.float64 if vi else torch.float32)
                coef[::5] = -0.0
                scored = torch.rand(n, generator=g) < 0.5
                got = seq.view(masked.clone(), coef.clone(), kind, vi, scored=scored.clone())
                want = old_view(seq, masked.clone(), coef.clone(), kind, vi, scored=scored.clone())
                same_views([got, seq.view(masked, coef, kind, vi)], [want, old_view(seq, masked, coef, kind, vi)])
                given = scored.clone()
                seq.view(masked, coef, kind, vi, scored=given)  # a given ``scored`` loses its prompt positions
                assert not given[: seq.P].any() and torch.equal(given[seq.P :], scored[seq.P :])
    with pytest.raises(ValueError, match="slot kind 'row' unknown"):
        seq.view(masked, coef, "row", 0)
