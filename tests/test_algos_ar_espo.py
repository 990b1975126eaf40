"""JustGRPO and ESPO on the exact toy dLLM (tests/algo_toy.py), the response canvas, and per-epoch corruptions.

* JustGRPO: its estimator is exact, so the real slot path (rows -> packing -> toy forward with the rows' 1/T
  -> gather_slots) must equal log softmax(f(c ++ y_<t ++ M..M)_t / T)[y_t] computed here from the toy directly,
  and its sum the toy's left-to-right autoregressive log-likelihood (enumerated); on-policy gradient == the
  REINFORCE form; PPO clip and the dual clip (c = 3) at their bounds.
* ESPO: both antithetic views are unbiased for the exact ELBO (enumerated) -- Monte-Carlo over the code's draws;
  the stratified counts are uniform per row and a permutation of {0..L} over L+1 rows; on-policy gradient; the
  sequence ratio clipped at 1 +- eps (eps 0 too), no dual clip; the KL is k2 of the raw ELBO divided by R.
* Canvas: a full-canvas sample (post-EOS tokens kept) is masked, scored and normalised over every position.
* ``rl.ppo_epochs`` with redrawn corruptions: epoch e draws from its own generator (epoch 0 is the old stream).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megadare.algos import REGISTRY
from megadare.algos.base import SlotIndex, Slots, gather_slots
from megadare.algos.espo import stratified_counts
from megadare.algos.sft import example_generator
from megadare.config import config_from_dict
from megadare.data.rows import pack_rows
from megadare.trainer.rl_update import corruption_draws

from algo_toy import one_thread  # noqa: F401  (autouse fixture)
from algo_toy import MASK, Exact, Toy, assert_mc, mb_logps, sample, toy_archs, view_logps

SAMPLES = [([1, 2], [0, 2, 1, 1], 1.0), ([1], [2, 2, 0], -0.5), ([0, 1], [1, 0, 2], 0.75), ([2], [0, 1], -1.0)]
T = 0.7


def _samples():
    return [sample(c, y, adv=a, index=i, extra={"sampling_temperature": T}) for i, (c, y, a) in enumerate(SAMPLES)]


def _trainer_loss(algo, toy, rows, ref_toy=None):
    """Pack, old / reference log-probs without grad, the algorithm's objective, / the global denominator."""
    mbs = pack_rows(rows, seq_length=max(len(r) for r in rows) + 5, micro_batch_size=1)
    objective = algo.objective(on_policy=False)
    D = sum(mb.denom for mb in mbs)
    total = 0.0
    for mb in mbs:
        with torch.no_grad():
            mb.old = mb_logps(toy, mb)
            mb.ref = mb_logps(ref_toy or toy, mb)
        total = total + objective(mb, mb_logps(toy, mb))[0]
    return total / D, D


def _grads(loss, toy):
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(toy.parameters()))])


def _ar_logp(toy, c, y, t, temp):
    """log softmax(f(c ++ y_<t ++ M..M)_t / T)[y_t], from the toy directly."""
    ctx = torch.tensor([list(c) + list(y[:t]) + [MASK] * (len(y) - t)])
    return F.log_softmax(toy.forward(ctx)[0, len(c) + t] / temp, -1)[y[t]]


def _slot(s_lp, s_old, adv, **extra):
    lp = torch.tensor(s_lp, dtype=torch.float64, requires_grad=True)
    return lp, Slots(
        logp=lp,
        old=torch.tensor(s_old, dtype=torch.float64),
        ref=extra.pop("ref", None),
        adv=torch.tensor(adv, dtype=torch.float64),
        weight=torch.ones(len(s_lp), dtype=torch.float64),
        extra=extra,
    )


# ================================================================== JustGRPO
def test_justgrpo_estimator_is_the_tempered_ar_likelihood():
    full, _ = toy_archs()
    algo, toy = REGISTRY["justgrpo"](), Toy(0)
    rows, want = [], []
    for s in _samples():
        r = algo.rows(s, full, 0, torch.Generator())
        assert len(r) == len(s.response_ids)  # one view per position
        for t, row in enumerate(r):
            P = len(s.prompt_ids)
            assert row.tokens.tolist() == s.prompt_ids + s.response_ids[:t] + [MASK] * (len(s.response_ids) - t)
            assert (row.extras["logit_scale"] == 1 / T).all() and (row.extras["excluded_token"] == MASK).all()
            assert row.weight.nonzero().flatten().tolist() == [P + t]
        rows += r
        want.append([float(_ar_logp(toy, s.prompt_ids, s.response_ids, t, T)) for t in range(len(s.response_ids))])
    got: dict[tuple, float] = {}
    for mb in pack_rows(rows, seq_length=16, micro_batch_size=2):
        sl, idx = gather_slots(mb, mb_logps(toy, mb), on_policy=True), SlotIndex(mb)
        sample, slot = mb.sample[idx.sel], mb.slot[idx.sel]
        for j, v in enumerate(sl.logp.tolist()):  # slot j of the micro-batch: any of its positions names it
            k = int((idx.inv == j).nonzero()[0])
            got[(int(sample[k]), int(slot[k]))] = v
    for i, w in enumerate(want):
        assert [got[(i, t)] for t in range(len(w))] == pytest.approx(w, rel=1e-6)  # 1/T stored in fp32
    # at T = 1 the sum is the toy's exact left-to-right likelihood (the enumerated order's product)
    c, y = SAMPLES[0][0], SAMPLES[0][1]
    ex = Exact(toy, c, y)
    ar = sum(ex.lp(ex.ctx(set(range(t, len(y)))), t) for t in range(len(y)))
    assert sum(float(_ar_logp(toy, c, y, t, 1.0)) for t in range(len(y))) == pytest.approx(ar, abs=1e-12)


def test_justgrpo_needs_the_sampling_temperature():
    full, _ = toy_archs()
    with pytest.raises(ValueError, match="rollout temperature"):
        REGISTRY["justgrpo"]().rows(sample([1], [0, 2]), full, 0, torch.Generator())


def test_justgrpo_on_policy_gradient_and_clipping():
    """Ratio 1: grad = -(1/N) sum_i A_i sum_t grad l_t (token mean over all N tokens); then clip and dual clip."""
    full, _ = toy_archs()
    algo, toy = REGISTRY["justgrpo"](), Toy(2)
    rows = [r for s in _samples() for r in algo.rows(s, full, 0, torch.Generator())]
    loss, D = _trainer_loss(algo, toy, rows)
    N = sum(len(y) for _, y, _ in SAMPLES)
    surrogate = sum(a * _ar_logp(toy, c, y, t, T) for c, y, a in SAMPLES for t in range(len(y)))
    assert D == N
    assert torch.allclose(_grads(loss, toy), _grads(-surrogate / N, toy), rtol=1e-5, atol=1e-7)
    assert algo.p["dual_clip"] == 3.0 and algo.p["eps_low"] == 0.2 and algo.p["kl_coef"] == 0.0
    lp, s = _slot([math.log(1.5), math.log(5.0), math.log(2.0), math.log(0.5)], [0.0] * 4, [1.0, -1.0, -1.0, -1.0])
    loss, parts = algo.slot_loss(s)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    assert loss.tolist() == pytest.approx([-1.2, 3.0, 2.0, 0.8])  # clip, dual clip at -c A, inside, clip
    assert g.tolist() == pytest.approx([0.0, 0.0, 2.0, 0.0])


# ================================================================== ESPO
def test_espo_views_are_unbiased_for_the_exact_elbo():
    full, _ = toy_archs()
    algo, toy = REGISTRY["espo"]({"n_mc": 1}), Toy(1)
    for c, y in (([1, 2], [0, 2, 1, 1]), ([1], [2, 0, 1])):
        s = sample(c, y)
        x0 = torch.tensor(c + y)
        vals = []
        for d in range(2500):
            views = algo.views(s, full, 0, torch.Generator().manual_seed(d))
            for v in views:  # coefficient (L+1) / |masked| / (2 n_mc R), complement exactly the other half
                n = int((v.coef > 0).sum())
                assert torch.allclose(v.coef[v.coef > 0], torch.tensor((len(y) + 1) / n / (2 * len(y))))
            if len(views) == 2:
                assert not (views[0].coef > 0).logical_and(views[1].coef > 0).any()
                assert int(((views[0].coef > 0) | (views[1].coef > 0)).sum()) == len(y)
            lp = view_logps(toy, x0, [v.tokens for v in views])
            vals.append(float(sum((v.coef.double() * lp[i]).sum() for i, v in enumerate(views))) * len(y))
        assert_mc(torch.tensor(vals), Exact(toy, c, y).elbo(), f"ESPO ELBO (L={len(y)})")


def test_espo_counts_are_stratified_and_uniform():
    L, B = 4, 5
    g = torch.Generator().manual_seed(0)
    seen = torch.zeros(B, L + 1)
    for _ in range(2000):
        ks = [k[0] for k in stratified_counts([L] * B, 1, g)]
        assert sorted(ks) == list(range(L + 1))  # B = L + 1 rows cover every count once
        for i, k in enumerate(ks):
            seen[i, k] += 1
    assert torch.allclose(seen / 2000, torch.full((B, L + 1), 1 / (L + 1)), atol=0.04)  # uniform per row
    mixed = stratified_counts([3, 4, 3, 2], 2, torch.Generator().manual_seed(1))
    assert all(0 <= k <= L for row in mixed for k in row) and mixed[0] != mixed[2]


def test_espo_on_policy_gradient_clip_and_kl():
    full, _ = toy_archs()
    algo, toy, ref = REGISTRY["espo"]({"n_mc": 2, "kl_coef": 0.05}), Toy(3), Toy(4)
    samples = _samples()
    rows = algo.batch_rows(samples, full, 0, lambda i: example_generator(5, 0, i))
    assert len(rows) == len(samples)  # one row per sample: its views share the slot
    loss, D = _trainer_loss(algo, toy, rows, ref_toy=ref)
    assert D == len(samples)
    surrogate, kl = 0.0, 0.0
    for mb in pack_rows(rows, seq_length=max(len(r) for r in rows) + 5, micro_batch_size=1):
        with torch.no_grad():
            mb.ref = mb_logps(ref, mb)
        sl = gather_slots(mb, mb_logps(toy, mb), on_policy=True)
        R = sl.extra["canvas"]
        assert sorted(sl.adv.tolist()) == pytest.approx(
            sorted(samples[i].advantage for i in mb.sample[mb.weight > 0].unique().tolist())
        )
        assert sorted(R.tolist()) == sorted(
            float(len(samples[i].response_ids)) for i in mb.sample[mb.weight > 0].unique().tolist()
        )
        surrogate = surrogate + (sl.adv * sl.logp).sum()
        kl = kl + (0.5 * (R * sl.logp - R * sl.ref) ** 2 / R).sum()  # k2 of the raw ELBO, / R (DARE)
    want = -surrogate / D + 0.05 * kl / D
    assert torch.allclose(_grads(loss, toy), _grads(want, toy), rtol=1e-5, atol=1e-7)
    # sequence ratio clip (eps 0.2, and DARE's countdown eps 0), never a dual clip
    lp, s = _slot(
        [math.log(1.5), math.log(5.0), math.log(0.9), math.log(1.1)],
        [0.0] * 4,
        [1.0, -1.0, 1.0, 1.0],
        canvas=torch.ones(4, dtype=torch.float64),
    )
    loss, _ = REGISTRY["espo"]({"kl_coef": 0.0}).slot_loss(s)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    assert loss.tolist() == pytest.approx([-1.2, 5.0, -0.9, -1.1]) and g.tolist() == pytest.approx([0, 5.0, -0.9, -1.1])
    lp, s = _slot([math.log(0.9), math.log(1.1)], [0.0, 0.0], [1.0, 1.0], canvas=torch.ones(2, dtype=torch.float64))
    loss, _ = REGISTRY["espo"]({"kl_coef": 0.0, "eps_low": 0.0}).slot_loss(s)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    assert loss.tolist() == pytest.approx([-0.9, -1.0]) and g.tolist() == pytest.approx([-0.9, 0.0])
    # kl_anchor: none trains without reference log-probs; old takes the same canvas-scaled k2 against the old ELBO
    canvas = torch.tensor([3.0, 5.0], dtype=torch.float64)
    _, s = _slot([-1.0, -2.0], [-1.5, -1.0], [1.0, 1.0], canvas=canvas)
    plain, _ = REGISTRY["espo"]({"kl_coef": 0.0}).slot_loss(s)
    none, parts = REGISTRY["espo"]({"kl_coef": 0.05, "kl_anchor": "none"}).slot_loss(s)
    assert torch.equal(none, plain) and "kl" not in parts
    old, parts = REGISTRY["espo"]({"kl_coef": 0.05, "kl_anchor": "old"}).slot_loss(s)
    k2 = canvas * 0.5 * torch.tensor([0.5, -1.0], dtype=torch.float64) ** 2
    assert torch.allclose(parts["kl"], k2) and torch.allclose(old, plain + 0.05 * k2)


# ================================================================== canvas and per-epoch corruptions
def test_full_canvas_rows_cover_every_position():
    """A full-canvas response (answer 0 2, EOS 1, then two decoded pad positions) is corrupted, scored and
    normalised over all R = 5 positions, by DARE's formulas written out here: d1 masks and scores all five (token
    mean over five); ESPO's weights (R+1)/k / (2 n_mc R); JustGRPO one view per position; Coupled-GRPO's three
    views; BGPO's count-stratified weights (R/m)/R."""
    full, _ = toy_archs()
    s = sample([1, 2], [0, 2, 1, 1, 0], extra={"sampling_temperature": 1.0})
    (row,) = REGISTRY["d1"]().rows(s, full, 0, torch.Generator().manual_seed(0))
    assert row.tokens[2:].tolist() == [MASK] * 5 and row.weight[2:].tolist() == [1.0] * 5 and row.denom == 5
    views = REGISTRY["espo"]({"n_mc": 1}).views(s, full, 0, torch.Generator().manual_seed(3))
    for v in views:
        n = int((v.coef > 0).sum())
        assert torch.allclose(v.coef[v.coef > 0], torch.tensor(6 / n / (2 * 5)))
    assert len(REGISTRY["justgrpo"]().rows(s, full, 0, torch.Generator())) == 5
    # Coupled-GRPO: view a masks all five (1/2), b and c split the five between them (1/(2t), 1/(2(1-t)))
    a, b, c = REGISTRY["coupled_grpo"]().views(s, full, 0, torch.Generator().manual_seed(4))
    assert a.tokens[2:].tolist() == [MASK] * 5 and a.coef[2:].tolist() == [0.5] * 5
    mb, mc = b.tokens[2:] == MASK, c.tokens[2:] == MASK
    assert (mb ^ mc).all() and mb.any() and mc.any()
    t = 0.5 / float(b.coef[2:][mb][0])
    assert torch.allclose(c.coef[2:][mc], torch.tensor(0.5 / (1 - t))) and 0.2 <= t <= 0.8
    # BGPO: count-stratified masks over R = 5 positions, weight (R / m) / R = 1 / m
    for v in REGISTRY["bgpo"]({"n_mc": 4}).views(s, full, 0, torch.Generator().manual_seed(5)):
        m = int((v.tokens[2:] == MASK).sum())
        assert torch.allclose(v.coef[2:][v.tokens[2:] == MASK], torch.tensor(1.0 / m))


def test_canvas_defaults_and_sampling():
    from megadare.rollout.setup import resolve_canvas
    from megadare.rollout.setup import sampling_params

    full, blk = toy_archs(4)
    cfg = config_from_dict({"rollout": {"block_size": 4}})
    assert resolve_canvas(cfg, full) == "full" and resolve_canvas(cfg, blk) == "eos"
    assert not sampling_params(cfg, full, 0).stop_at_eos and sampling_params(cfg, blk, 0).stop_at_eos
    assert sampling_params(cfg, full, 0, evaluation=True).stop_at_eos  # evaluation always stops at EOS
    cfg = config_from_dict({"rollout": {"block_size": 4}, "rl": {"canvas": "eos"}})
    assert sampling_params(cfg, full, 0).stop_at_eos


def test_redrawn_corruptions_per_epoch():
    full, _ = toy_archs()
    cfg = config_from_dict({"rl": {"ppo_epochs": 3}})
    assert corruption_draws(cfg, REGISTRY["espo"]()) == 3 and corruption_draws(cfg, REGISTRY["d1"]()) == 3
    assert corruption_draws(cfg, REGISTRY["tracerl"]()) == 1
    assert (
        corruption_draws(config_from_dict({"rl": {"ppo_epochs": 3, "redraw_corruptions": False}}), REGISTRY["espo"]())
        == 1
    )
    assert (
        corruption_draws(
            config_from_dict({"rl": {"ppo_epochs": 3, "redraw_corruptions": True}}), REGISTRY["coupled_grpo"]()
        )
        == 3
    )
    assert torch.equal(example_generator(1, 2, 3).get_state(), example_generator(1, 2, 3, 0).get_state())
    for name in ("espo", "d1"):
        algo = REGISTRY[name]()
        per_epoch = [
            algo.batch_rows(_samples(), full, 0, lambda i, e=e: example_generator(1, 2, i, e)) for e in range(3)
        ]
        again = algo.batch_rows(_samples(), full, 0, lambda i: example_generator(1, 2, i, 1))
        assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(per_epoch[1], again))  # deterministic
        for a, b in ((0, 1), (1, 2)):
            assert any(
                not torch.equal(x.tokens, y.tokens) or not torch.equal(x.weight, y.weight)
                for x, y in zip(per_epoch[a], per_epoch[b])
            ), (name, a, b)


def test_config_check_refuses_what_justgrpo_and_espo_cannot_train():
    from megadare.trainer.checks import validate
    from megadare.errors import ConfigError
    from megadare.models import get_family

    def arch(name):
        fam = get_family(name)
        return fam.arch(fam.tiny_config())

    ok = {"algo": {"name": "justgrpo"}, "rollout": {"block_size": 1, "steps_per_block": 1}}
    validate(config_from_dict(ok), arch("llada"))
    for over, arch_name, msg in (
        ({"rollout": {"block_size": 4}}, "llada", "rollout.block_size=1"),
        ({"rollout": {"block_size": 1, "temperature": 0.0}}, "llada", "temperature"),
        ({"rollout": {"block_size": 1, "top_p": 0.9}}, "dream", "top_p"),
        ({}, "sdar", "full-attention family"),
    ):
        cfg = config_from_dict({"algo": {"name": "justgrpo"}, **over})
        with pytest.raises(ConfigError, match=msg):
            validate(cfg, arch(arch_name))
    assert REGISTRY["espo"]().p["dual_clip"] is None  # the paper's default: no dual clip (an option)
    with pytest.raises(ConfigError, match="rl.partial_rollout"):
        validate(config_from_dict({"rl": {"partial_rollout": 1}}), arch("llada"))


def test_full_canvas_rewards_read_the_answer_up_to_its_first_eos():
    from megadare.data.prompt_data import PromptRecord
    from megadare.data.tokenizer import ByteTokenizer
    from megadare.rollout.engine import SamplingParams, Trajectory
    from megadare.trainer.reward_step import score_rollouts

    tok = ByteTokenizer()
    canvas = tok.encode("cba") + [tok.eos_token_id] + tok.encode("xy")  # decoded past the EOS
    t = Trajectory(
        prompt_ids=[1],
        response_ids=canvas,
        commit_step=list(range(6)),
        block_step=[0] * 6,
        logprobs=[0.0] * 6,
        finish_reason="eos",
        num_forwards=6,
        params=SamplingParams(max_new_tokens=6),
    )
    assert t.answer_ids(tok.eos_token_id) == canvas[:4]
    scores, _ = score_rollouts(
        config_from_dict({}),
        lambda text, rec: float(text == rec["answer"]),
        tok,
        [t],
        [PromptRecord([1], {"answer": "cba"}, "mem:1")],
        "test",
    )
    assert scores == [1.0]


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_exclude_tokens_masks_only_this_ranks_entry(monkeypatch, tp_rank):
    """-inf exactly at each position's excluded token when it lies in this TP rank's vocabulary slice (-1: none;
    another rank's token: nothing here); every other logit unchanged and differentiable."""
    from megatron.core import parallel_state

    from megadare.trainer.logprob import exclude_tokens

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: tp_rank)
    logits = torch.randn(2, 3, 4, requires_grad=True)  # this rank's slice: 4 entries (fp32, as scored)
    token = torch.tensor([[1, -1, 6], [4, 7, 0]])  # global vocabulary ids
    out = exclude_tokens(logits, token)
    want = logits.detach().clone()
    for (i, j), t in zip([(i, j) for i in range(2) for j in range(3)], token.flatten().tolist()):
        if t >= 0 and tp_rank * 4 <= t < tp_rank * 4 + 4:
            want[i, j, t - tp_rank * 4] = float("-inf")
    assert torch.equal(out.detach(), want) and int(torch.isinf(want).sum()) == [2, 3][tp_rank]
    (g,) = torch.autograd.grad(out.masked_fill(torch.isinf(want), 0.0).sum(), logits)
    assert torch.equal(g, (~torch.isinf(want)).float())
