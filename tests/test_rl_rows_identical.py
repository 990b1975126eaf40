"""The fast row builder (``algos/base.py::views_to_row`` with ``SampleColumns``, and ``views.list_tensor``) against a
straightforward construction kept here (the per-column ``torch.cat`` builder it replaced): every algorithm's rows
of a batch of traced samples, on block, full-attention and shifted-logit (Dream) families, must be the same tensors
-- same dtype, ``torch.equal`` -- column by column, and the packed micro-batches too."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from megadare.algos import algorithm, build_algorithm, vrpo
from megadare.algos.base import RLSample, segment_ids
from megadare.data.rows import MB_COLUMNS, Row, _first_fit_decreasing, pack_rows
from megadare.diffusion.views import list_tensor
from megadare.models import get_family

from algo_toy import one_thread  # noqa: F401  (autouse fixture)

MASK = 99
ROW_FIELDS = ("tokens", "labels", "weight", "position_ids", "stream_ids", "segment_ids", "denom", "sample")
ROW_FIELDS += ("slot", "head", "adv", "tok")


def reference_row(sample, views, arch, slot_weight, denom, cols=None) -> Row:
    """The plain construction: per view, each column's pieces (x_t half, then the clean x_0 half on block families)
    joined by one ``torch.cat`` per column; ``cols`` ignored."""
    block = arch.is_block_diffusion
    x0 = torch.tensor(list(sample.prompt_ids) + list(sample.response_ids), dtype=torch.long)
    P, N = len(sample.prompt_ids), len(x0)
    adv_pos = torch.cat([torch.zeros(P), sample.token_advantages()])
    tok_pos = torch.cat([torch.full((P,), -1, dtype=torch.long), torch.arange(len(sample.response_ids))])
    zero, none = torch.zeros(N), torch.full((N,), -1, dtype=torch.long)
    names = ("tokens", "labels", "weight", "pos", "stream", "slot", "head", "adv", "tok", "seg")
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in names}
    seen: set[int] = set()
    for vi, v in enumerate(views):
        n = v.tokens.shape[0]
        labels = x0[:n] if v.labels is None else v.labels
        coef, slot = v.coef.float(), v.slot
        adv = adv_pos[:n] if v.adv is None else v.adv.float()
        tok = tok_pos[:n]
        if arch.logits_shift:
            labels = torch.cat([labels[1:], labels[:1]])
            coef, slot = torch.cat([coef[1:], zero[:1]]), torch.cat([slot[1:], none[:1]])
            adv, tok = torch.cat([adv[1:], zero[:1]]), torch.cat([tok[1:], none[:1]])
        head = [0.0] * n
        for i, s in enumerate(slot.tolist()):
            if s >= 0 and s not in seen:
                seen.add(s)
                head[i] = slot_weight.get(s, 0.0)
        halves = [(v.tokens, labels, coef, torch.arange(n), torch.zeros(n, dtype=torch.long), slot)]
        halves[0] += (torch.tensor(head), adv, tok)
        if block:
            halves.append((x0[:n], x0[:n], zero[:n], torch.arange(n), torch.ones(n, dtype=torch.long), none[:n]))
            halves[1] += (zero[:n], zero[:n], none[:n])
        for half in halves:
            for k, a in zip(names, half):
                parts[k].append(a)
            parts["seg"].append(torch.full((n,), vi, dtype=torch.long))
    c = {k: torch.cat(v) for k, v in parts.items()}
    return Row(
        tokens=c["tokens"], labels=c["labels"], weight=c["weight"], position_ids=c["pos"],
        stream_ids=c["stream"] if block else None, denom=denom, segment_ids=c["seg"] if len(views) > 1 else None,
        slot=c["slot"], head=c["head"], adv=c["adv"], tok=c["tok"], sample=torch.full_like(c["tok"], sample.index),
    )  # fmt: skip


def traced_samples(n: int, block: int, seed: int) -> list[RLSample]:
    """Responses with a decoding trace (a random order inside each ``block``-token block, 1-2 tokens a step),
    prompts of varying length, per-response and per-token advantages."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        P, L = rng.randint(1, 7), rng.randint(1, 11)
        steps, step = [0] * L, 0
        for b in range(0, L, block):
            order = list(range(b, min(b + block, L)))
            rng.shuffle(order)
            for j, k in enumerate(order):
                steps[k] = step + j // 2
            step += (len(order) + 1) // 2
        adv = [rng.uniform(-1, 1) for _ in range(L)] if i % 3 == 2 else rng.uniform(-1, 1)
        out.append(
            RLSample(
                prompt_ids=[rng.randrange(3, 90) for _ in range(P)],
                response_ids=[rng.randrange(3, 90) for _ in range(L)],
                reward=float(i % 2), advantage=adv, index=i, group=i // 4,
                commit_step=steps, block_step=[s - min(steps[(k // block) * block : (k // block + 1) * block])
                                               for k, s in enumerate(steps)],
            )
        )  # fmt: skip
    return out


def rows_of(algo, samples, arch, block: int, reference: bool, monkeypatch) -> list[Row]:
    with monkeypatch.context() as m:
        if reference:
            for mod in (algorithm, vrpo):
                m.setattr(mod, "views_to_row", reference_row)
            m.setattr(algorithm, "SampleColumns", lambda s: None)
        samples = [replace(s, extra=dict(s.extra)) for s in samples]
        return algo.batch_rows(samples, arch, block, lambda i: torch.Generator().manual_seed(1000 + i))


def assert_same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: {a} != {b}"
    else:
        assert a == b, where


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
@pytest.mark.parametrize("name", ["tracerl", "d1", "coupled_grpo", "cj_grpo", "bgpo", "spg", "vrpo", "random_mask_rl"])
def test_rows_and_packing_match_the_reference(family, name, monkeypatch):
    fam = get_family(family)
    arch = replace(fam.arch(fam.tiny_config()), mask_token_id=MASK)
    block = 4
    if arch.is_block_diffusion:
        arch = replace(arch, block_size=block)
    algo = build_algorithm(name)
    samples = traced_samples(16, block, seed=len(family) + len(name))
    got = rows_of(algo, samples, arch, block, False, monkeypatch)
    want = rows_of(algo, samples, arch, block, True, monkeypatch)
    assert len(got) == len(want) > 0
    for i, (r, s) in enumerate(zip(got, want)):
        for f in ROW_FIELDS:
            assert_same(getattr(r, f), getattr(s, f), f"{family} {name} row {i} {f}")
        assert r.extras.keys() == s.extras.keys()
        for k in r.extras:
            assert_same(r.extras[k], s.extras[k], f"{family} {name} row {i} extras[{k}]")
    for a, b in zip(pack_rows(got, 96, 4), pack_rows(want, 96, 4), strict=True):
        for f in ("tokens", "labels", "weight", "position_ids", "segment_ids", "stream_ids", "padding") + MB_COLUMNS:
            assert_same(getattr(a, f), getattr(b, f), f"{family} {name} micro-batch {f}")
        assert (a.denom, a.num_rows) == (b.denom, b.num_rows)


@pytest.mark.parametrize(
    "values, dtype",
    [
        ([0, -1, 5, 2**62, -(2**63)], torch.long),
        ([0.0, 1 / 3, 0.1, -2.5e-39, 1e38, 3.4028235e38, 1 / 7], torch.float32),
        ([0.1, 1 / 3, 1e-300], torch.float64),
        ([], torch.long),
        ([True, False], torch.bool),
    ],
)
def test_list_tensor_is_torch_tensor(values, dtype):
    want = torch.tensor(values, dtype=dtype)
    got = list_tensor(values, dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bit for bit (-0.0, subnormals)


def reference_first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing, every bin scanned for every row."""
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, f in enumerate(free):
            if lengths[i] <= f:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


@pytest.mark.parametrize("seed", range(6))
def test_first_fit_skips_only_full_bins(seed):
    rng = random.Random(seed)
    lo = rng.choice([1, 10, 40])
    lengths = [rng.randint(lo, 128) for _ in range(rng.randint(0, 300))]
    assert _first_fit_decreasing(lengths, 128) == reference_first_fit(lengths, 128)
    assert _first_fit_decreasing([40] * 50, 128) == reference_first_fit([40] * 50, 128)


@pytest.mark.parametrize("seed", range(5))
def test_segment_ids_repeat_each_segment(seed):
    rng = random.Random(seed)
    for _ in range(20):
        sizes = [rng.choice([0, 1, rng.randint(2, 300)]) for _ in range(rng.randint(1, 9))]
        want = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes, dtype=torch.long))
        got = segment_ids(sizes)
        assert got.dtype == want.dtype and torch.equal(got, want), sizes
