"""Diffusion core and SFT corruptions, checked against independent computations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megadare.algos.sft import SFTRecipe, example_rows, mask_kind, trace_groups
from megadare.config import Config
from megadare.data.sft_data import SFTExample
from megadare.diffusion.masking import complementary, iid_mask, mask_tokens
from megadare.diffusion.schedule import NoiseSchedule, elbo_weight
from megadare.models import build_hf_model, get_family
from megadare.models.attention import MaskSpec, block_causal
from megadare.data.rows import pack_rows
from megadare.trainer.sft_loop import sft_recipe

MASK = 255


def _arch(name: str, **over):
    fam = get_family(name)
    cfg = fam.tiny_config(**over)
    return cfg, fam.arch(cfg)


def _example(P=5, L=11, seed=0, steps=None) -> SFTExample:
    g = torch.Generator().manual_seed(seed)
    return SFTExample(
        torch.randint(0, 250, (P,), generator=g).tolist(), torch.randint(0, 250, (L,), generator=g).tolist(), steps
    )


def _weighted_ce(model, tokens, labels, weight, mask, positions) -> torch.Tensor:
    logits = model(tokens[None], attention_mask=mask, position_ids=positions[None])[0]
    return (weight * F.cross_entropy(logits.double(), labels, reduction="none")).sum()


@torch.no_grad()
def test_block_diffusion_loss_equals_sum_of_per_block_losses():
    """One x_t ++ x_0 forward == each block denoised separately with only the clean earlier blocks in view."""
    torch.manual_seed(0)
    cfg, arch = _arch("sdar", block_size=4)
    model = build_hf_model(cfg).eval()
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.05)
    recipe = SFTRecipe("block", block_size=4, schedule=NoiseSchedule(0.3, 0.9))
    ex = _example()
    (row,) = example_rows(ex, arch, recipe, torch.Generator().manual_seed(3))
    n = len(row) // 2
    spec = MaskSpec(
        "block_diffusion", block_size=4, position_ids=row.position_ids[None], stream_ids=row.stream_ids[None]
    )
    one_pass = _weighted_ce(model, row.tokens, row.labels, row.weight, spec.dense(2 * n, 2 * n), row.position_ids)

    xt, x0, w = row.tokens[:n], row.tokens[n:], row.weight[:n]
    assert torch.equal(x0, torch.tensor(ex.prompt_ids + ex.response_ids))
    per_block = torch.zeros((), dtype=torch.float64)
    n_scored_blocks = 0
    for start in range(0, n, 4):
        end = min(n, start + 4)
        if w[start:end].sum() == 0:
            continue
        n_scored_blocks += 1
        tokens = torch.cat([x0[:start], xt[start:end]])
        weight = torch.cat([torch.zeros(start), w[start:end]])
        per_block += _weighted_ce(model, tokens, x0[:end], weight, block_causal(4).dense(end, end), torch.arange(end))
    assert n_scored_blocks >= 2
    assert torch.allclose(one_pass, per_block, rtol=1e-5), (one_pass, per_block)


@torch.no_grad()
def test_packed_rows_do_not_see_each_other():
    torch.manual_seed(1)
    cfg, arch = _arch("sdar", block_size=4)
    model = build_hf_model(cfg).eval()
    recipe = SFTRecipe("block", block_size=4)
    rows = [
        example_rows(_example(seed=s, L=6 + s), arch, recipe, torch.Generator().manual_seed(s))[0] for s in range(3)
    ]
    (mb,) = pack_rows(rows, seq_length=sum(len(r) for r in rows) + 3)
    spec = mb.mask("block_diffusion", 4)
    S = mb.tokens.shape[1]
    packed = _weighted_ce(model, mb.tokens[0], mb.labels[0], mb.weight[0], spec.dense(S, S, 1), mb.position_ids[0])
    alone = torch.zeros((), dtype=torch.float64)
    for r in rows:
        m = MaskSpec("block_diffusion", block_size=4, position_ids=r.position_ids[None], stream_ids=r.stream_ids[None])
        alone += _weighted_ce(model, r.tokens, r.labels, r.weight, m.dense(len(r), len(r)), r.position_ids)
    assert torch.allclose(packed, alone, rtol=1e-5)
    assert mb.denom == sum(r.denom for r in rows)


def test_random_masking_row_layout_and_unbiased_elbo_weights():
    _, arch = _arch("llada")
    recipe = SFTRecipe("random", schedule=NoiseSchedule(1e-3, 1.0))
    ex = _example(P=4, L=8)
    totals = []
    for s in range(20000):
        (row,) = example_rows(ex, arch, recipe, torch.Generator().manual_seed(s))
        masked = row.tokens == arch.mask_token_id
        assert not masked[:4].any()  # the prompt is never masked
        assert torch.equal(row.labels, torch.tensor(ex.prompt_ids + ex.response_ids))
        assert torch.equal(row.weight > 0, masked)  # scored exactly where masked
        totals.append(float(row.weight.sum()))
    # E_t E_mask [ (1/t) * #masked / L ] = 1: the 1/t-weighted estimator is unbiased for the token count
    assert abs(sum(totals) / len(totals) - 1.0) < 0.03


def test_dream_rows_are_shifted_by_one():
    _, dream = _arch("dream")
    _, llada = _arch("llada")
    recipe = SFTRecipe("random", schedule=NoiseSchedule(0.5, 0.5))
    ex = _example(P=3, L=6)
    (plain,) = example_rows(ex, llada, recipe, torch.Generator().manual_seed(1))
    (shifted,) = example_rows(ex, dream, recipe, torch.Generator().manual_seed(1))
    assert torch.equal(shifted.tokens, plain.tokens)
    assert torch.equal(shifted.labels[:-1], plain.labels[1:])
    assert torch.equal(shifted.weight[:-1], plain.weight[1:]) and shifted.weight[-1] == 0
    with pytest.raises(ValueError, match="non-empty prompt"):
        example_rows(SFTExample([], [1, 2, 3]), dream, recipe, torch.Generator())


def test_masking_primitives():
    g = torch.Generator().manual_seed(0)
    eligible = torch.rand(4000, generator=g) < 0.7
    m = iid_mask(eligible, 0.25, g)
    assert not (m & ~eligible).any()
    assert abs(float(m.sum()) / float(eligible.sum()) - 0.25) < 0.03
    comp = complementary(m, eligible)
    assert torch.equal(m ^ comp, eligible) and not (m & comp).any()
    forced = iid_mask(torch.ones(3, 5, dtype=torch.bool), 0.0, g, force_one=True)
    assert forced.sum(dim=1).tolist() == [1, 1, 1]
    x = torch.arange(6)
    assert mask_tokens(x, x % 2 == 0, MASK).tolist() == [MASK, 1, MASK, 3, MASK, 5]
    assert torch.equal(elbo_weight(torch.tensor([0.5, 0.25])), torch.tensor([2.0, 4.0]))
    t = NoiseSchedule(0.3, 0.8).sample(1000, g)
    assert t.min() >= 0.3 and t.max() <= 0.8
    with pytest.raises(ValueError, match="noise range"):
        NoiseSchedule(0.0, 1.0)


def test_block_rows_mask_only_the_response_with_per_block_t():
    _, arch = _arch("sdar", block_size=4)
    recipe = SFTRecipe("block", block_size=4, schedule=NoiseSchedule(0.2, 0.9, "none"), normalize="masked_tokens")
    ex = _example(P=6, L=14)
    (row,) = example_rows(ex, arch, recipe, torch.Generator().manual_seed(5))
    n = 20
    assert row.stream_ids.tolist() == [0] * n + [1] * n
    assert torch.equal(row.position_ids, torch.cat([torch.arange(n), torch.arange(n)]))
    masked = row.tokens[:n] == arch.mask_token_id
    assert not masked[:6].any() and masked.any()
    assert torch.equal(row.weight[:n] > 0, masked) and not row.weight[n:].any()
    assert row.denom == float(masked.sum())  # masked-token normalisation
    assert mask_kind(recipe, arch) == "block_diffusion"
    _, llada = _arch("llada")
    with pytest.raises(ValueError, match="full attention"):
        mask_kind(recipe, llada)


def test_semi_ar_rows_slice_after_the_masked_block():
    _, arch = _arch("llada")
    recipe = SFTRecipe("semi_ar", block_size=4, schedule=NoiseSchedule(0.5, 0.5, "none"))
    ex = _example(P=3, L=10)
    seen = set()
    for s in range(50):
        (row,) = example_rows(ex, arch, recipe, torch.Generator().manual_seed(s))
        resp = row.tokens[3:]
        masked = (resp == arch.mask_token_id).nonzero().squeeze(1)
        b = int(masked[0]) // 4
        seen.add(b)
        assert len(resp) == min(10, (b + 1) * 4)  # later blocks sliced off
        assert (masked // 4 == b).all()  # only block b is noised
        assert torch.allclose(row.weight.sum(), torch.tensor(len(masked) * 3 / 10.0))  # n_blocks / L each
    assert seen == {0, 1, 2}


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_trace_rows_score_every_token_once_from_the_recorded_state(family):
    _, arch = _arch(family, **({"block_size": 4} if family == "sdar" else {}))
    steps = [0, 0, 1, 1, 2, 3, 3, 2, 4, 5, 5, 4]  # two tokens per step, blocks of 4 in order
    ex = _example(P=4, L=12, steps=steps)
    recipe = SFTRecipe("trace", block_size=4, trace_shrink=2)
    rows = example_rows(ex, arch, recipe, torch.Generator())
    assert len(rows) == len(trace_groups(steps, 2)) == 3
    scored = torch.zeros(12)
    for row, group in zip(rows, trace_groups(steps, 2)):
        resp = row.tokens[4:]
        for k in range(len(resp)):
            assert (resp[k] == arch.mask_token_id) == (steps[k] >= group[0])
        scored[: len(resp)] += (row.weight[4:] > 0).float()
        assert torch.allclose(row.weight[4:][row.weight[4:] > 0], torch.tensor(1 / 12))
        if family == "sdar":
            assert len(resp) % 4 == 0 and len(resp) <= 4 * (max(k for k in range(12) if steps[k] in group) // 4 + 1)
    assert scored.tolist() == [1.0] * 12
    assert sum(r.denom for r in rows) == 1.0
    assert mask_kind(recipe, arch) == ("block_causal" if family == "sdar" else "bidirectional")
    with pytest.raises(ValueError, match="steps"):
        example_rows(_example(), arch, recipe, torch.Generator())


def test_block_rows_draw_t_again_until_a_token_is_masked_as_sdar_does():
    """SDAR's rule (DARE @83ae8a3, models/SDAR-1dot7B-Chat/modeling_sdar.py:235-259, ``forward_add_noise_packed``):
    while no eligible token is masked, t and the mask are drawn again (up to 10 times), then one token is forced.
    On a 2-token answer E[sum_masked 1/t] / L is then 1 / P(>= 1 masked) = 1 / (1 - E(1 - t)^2) = 1.4985; forcing
    a token at the first empty draw kept its tiny t (weight 1/t up to 1000) and gave ~3.7."""
    _, arch = _arch("sdar", block_size=4)
    recipe = SFTRecipe("block", block_size=4, schedule=NoiseSchedule(1e-3, 1.0), t_per="sample")
    ex = _example(P=3, L=2)
    total = 0.0
    for s in range(6000):
        (row,) = example_rows(ex, arch, recipe, torch.Generator().manual_seed(s))
        assert (row.tokens[3:5] == arch.mask_token_id).any()  # at least one answer token masked
        total += float(row.weight.sum())  # sum_masked 1/(t L)
    want = 1.0 / (1.0 - (1 - 1e-3) ** 2 / 3)
    assert abs(total / 6000 - want) < 0.12, (total / 6000, want)


@pytest.mark.parametrize("family,t_per", [("sdar", "sample"), ("sdar_moe", "sample"), ("llada2", "sample")])
def test_sft_t_per_defaults_to_the_family_publishers_draw(family, t_per):
    """sft.t_per unset (auto) takes the family's declared draw: SDAR's ``forward_add_noise_packed`` and DARE's
    LLaDA2 dataset draw one t per sample (tests/test_dare_live_sft.py compares the draws live); an explicit
    setting wins."""
    _, arch = _arch(family, block_size=4)
    assert sft_recipe(Config(), arch).t_per == t_per
    cfg = Config()
    cfg.sft.t_per = "block"
    assert sft_recipe(cfg, arch).t_per == "block"


@pytest.mark.parametrize("family,redraw", [("sdar", True), ("llada2", False)])
def test_block_rows_redraw_an_empty_mask_as_the_family_publisher_does(family, redraw):
    """SDAR's code draws t again while nothing is masked; DARE's LLaDA2 dataset keeps the empty draw (the sample
    scores nothing): on a 1-token answer with t ~ U(0.3, 0.8), 45% of LLaDA2's draws mask nothing, none of SDAR's."""
    _, arch = _arch(family, block_size=4)
    cfg = Config()
    cfg.sft.noise_low, cfg.sft.noise_high = 0.3, 0.8
    recipe = sft_recipe(cfg, arch)
    assert recipe.redraw_empty is redraw
    ex = _example(P=3, L=1)
    rows = [example_rows(ex, arch, recipe, torch.Generator().manual_seed(s))[0] for s in range(400)]
    empty = sum(float(r.weight.sum()) == 0.0 for r in rows) / len(rows)
    assert (abs(empty - 0.45) < 0.08) if not redraw else empty == 0.0, empty


def _dare_micro_batch_loss(ce, masked, t) -> torch.Tensor:
    """DARE's LLaDA / Dream / LLaDA2 SFT loss of one micro-batch (verl/trainer/llada_fsdp_sft_trainer.py:344-345,
    410, 423 @83ae8a3, one rank): sum(CE / t * loss_mask) / (sum(loss_mask) + 1e-8)."""
    loss = ce / t.unsqueeze(-1)
    loss = loss * masked
    return torch.sum(loss) / (torch.sum(masked) + 1e-8)


@pytest.mark.parametrize("normalize,micro", [("masked_tokens", 4), ("masked_tokens_per_sample", 1)])
def test_masked_token_normalisations_are_dares_micro_batch_means(normalize, micro):
    """DARE averages its micro-batches' losses (``training_step``: loss / n_micro_batches, :442): megadare's
    ``masked_tokens`` is that with one micro-batch a step, ``masked_tokens_per_sample`` at micro_batch_size_per_gpu=1
    (a sample with nothing masked counts 0 in both)."""
    _, arch = _arch("llada")
    recipe = SFTRecipe("random", schedule=NoiseSchedule(0.4, 0.4), normalize=normalize)
    examples = [_example(P=3, L=L, seed=L) for L in (1, 5, 9, 13)]
    rows = [example_rows(ex, arch, recipe, torch.Generator().manual_seed(i))[0] for i, ex in enumerate(examples)]
    ce = [torch.rand(len(r), generator=torch.Generator().manual_seed(7 + i)) for i, r in enumerate(rows)]
    ours = sum(float((r.weight * c).sum()) for r, c in zip(rows, ce)) / sum(r.denom for r in rows)
    groups = [range(i, min(i + micro, len(rows))) for i in range(0, len(rows), micro)]
    dare = 0.0
    for g in groups:
        width = max(len(rows[i]) for i in g)
        pad = [torch.nn.functional.pad(x, (0, width - len(x))) for x in (ce[i] for i in g)]
        masked = [
            torch.nn.functional.pad((rows[i].tokens == arch.mask_token_id).float(), (0, width - len(rows[i])))
            for i in g
        ]
        dare += float(_dare_micro_batch_loss(torch.stack(pad), torch.stack(masked), torch.full((len(g),), 0.4))) / len(
            groups
        )
    assert abs(ours - dare) < 1e-6, (ours, dare)
