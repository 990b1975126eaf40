"""Objectives and shared parts of the RL zoo: on-policy gradients against an independent REINFORCE computation on
a toy dLLM with parameters, PPO clipping / dual clip / BGPO's bounds, KL estimators, advantages, loss
aggregation across packed and split micro-batches, algorithm parameters, and Dream's shifted rows.

The toy model, its micro-batch evaluator and the synthetic decoding traces come from algo_toy.py (the toy is
checked in test_algos_estimators.py against exact enumeration and the real slot path)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megadare.algos import REGISTRY, build_algorithm
from megadare.algos.advantages import filter_groups, group_advantages, truncated_as_wrong
from megadare.algos.algorithm import rows_for_views
from megadare.algos.base import Slots, gather_slots
from megadare.algos.policy_loss import PPOClip, kl_penalty, ppo_clip_loss
from megadare.diffusion.trace_replay import replay_views
from megadare.errors import ConfigError
from megadare.models import build_hf_model, get_family
from megadare.models.attention import MaskSpec
from megadare.data.rows import pack_rows

from algo_toy import one_thread  # noqa: F401  (autouse fixture)
from algo_toy import MASK, Toy, mb_logps, sample, synthetic_trace, toy_archs, view_logps

SAMPLES = [([1, 2], [0, 2, 1, 1], 1.0), ([1], [2, 2, 0], -0.5), ([0, 1], [1, 0, 2], 0.75), ([2], [0, 1], -1.0)]
RATIO_ALGOS = ["d1", "coupled_grpo", "random_mask_rl", "tracerl", "cj_grpo", "bgpo", "ebpo"]


def _samples(block_size: int):
    out = []
    for i, (c, y, a) in enumerate(SAMPLES):
        commit, bstep = synthetic_trace(len(c), len(y), block_size, seed=10 + i, per_step=1 + i % 2)
        out.append(sample(c, y, adv=a, index=i, commit_step=commit, block_step=bstep))
    return out


def _views(algo, s, arch, bs, seed):
    if algo.name == "cj_grpo":
        return [v for v, _ in replay_views(s, MASK, bs, 1, block_family=bool(bs))]
    return algo.views(s, arch, bs, torch.Generator().manual_seed(seed))


def _weights(name: str, algo, s, views, bs: int, arch) -> tuple[dict[int, float], float]:
    """The algorithm's aggregation weight of every slot and the sample's share of the denominator, written out
    here from each file's stated objective (not read from the rows)."""
    slots = sorted({int(x) for v in views for x in v.slot.tolist() if x >= 0})
    L, P = len(s.response_ids), len(s.prompt_ids)
    if name == "cj_grpo":  # mean over a step's tokens, then over the sample's steps
        key = [((P + k) // bs, s.block_step[k]) if bs else s.commit_step[k] for k in range(L)]
        K = len(set(key))
        return {k: 1.0 / (K * key.count(key[k])) for k in range(L)}, 1.0
    if name == "bgpo":  # mean over the n MC samples
        return {j: 1.0 / len(views) for j in slots}, 1.0
    if name == "ebpo":  # one sequence slot
        return {0: 1.0}, 1.0
    agg = algo.loss_agg(arch)
    frags = [{int(x) for x in v.slot.tolist() if x >= 0} for v in views]
    if agg == "fragment_mean":  # each view's mean over its slots, then over all views
        return {k: 1.0 / len(f) for f in frags for k in f}, float(sum(1 for f in frags if f))
    if agg == "fragment_width":  # each view's sum / the batch's longest response (the rows of one sample: its own)
        return {k: 1.0 / L for f in frags for k in f}, float(sum(1 for f in frags if f))
    if agg == "token_mean":
        return {k: 1.0 for k in slots}, float(len(slots))
    if agg == "seq_mean_token_mean":
        return {k: 1.0 / len(slots) for k in slots}, 1.0
    if agg == "seq_mean_token_sum":
        return {k: 1.0 for k in slots}, 1.0
    assert agg == "seq_mean_length"
    return {k: 1.0 / L for k in slots}, 1.0


def _direct(toy, views, x0, bs, beta=None):
    """{slot: l_s} (and {slot: (1/beta) log sum c p^beta}) with gradients, from the views directly."""
    lp = view_logps(toy, x0, [v.tokens for v in views], bs)
    lin, pw = {}, {}
    for vi, v in enumerate(views):
        for i in (v.slot >= 0).nonzero().flatten().tolist():
            s, c = int(v.slot[i]), v.coef[i].double()
            lin[s] = lin.get(s, 0.0) + c * lp[vi, i]
            pw[s] = pw.get(s, 0.0) + c * torch.exp((beta or 1.0) * lp[vi, i])
    return lin, {s: torch.log(p) / beta for s, p in pw.items()} if beta else {}


def _trainer_loss(algo, toy, rows, bs, old_toy=None, seq_length=None, mbs_size=1, ref=True, ref_toy=None):
    """What the trainer does with the rows: pack, per micro-batch old (and reference: ``ref_toy``, else the
    current toy) log-probs without grad, the algorithm's objective, summed over micro-batches and divided by the
    global denominator."""
    seq = seq_length or max(len(r) for r in rows) + 3
    mbs = pack_rows(rows, seq_length=seq, micro_batch_size=mbs_size)
    objective = algo.objective(on_policy=False)
    D = sum(mb.denom for mb in mbs)
    total = 0.0
    for mb in mbs:
        with torch.no_grad():
            mb.old = mb_logps(old_toy or toy, mb, bs)
            if ref:
                mb.ref = mb_logps(ref_toy or toy, mb, bs)
        loss, _ = objective(mb, mb_logps(toy, mb, bs))
        total = total + loss
    return total / D, D, mbs


def _grads(loss, toy):
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(toy.parameters()))])


# ================================================================== on-policy gradient == REINFORCE
CASES = [(n, "full") for n in RATIO_ALGOS] + [
    ("tracerl", "block"),
    ("ebpo", "block"),
    ("random_mask_rl", "block"),
    ("cj_grpo", "block"),
]


@pytest.mark.parametrize("name,kind", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_on_policy_gradient_is_the_reinforce_gradient(name, kind):
    """Frozen weights (old = reference = current, ratio 1, one inner step): the gradient of the algorithm's loss
    (its defaults, KL included) equals -(1/D) sum_i sum_s w_s A_i grad l_s, with l_s the algorithm's slot estimate
    and w_s, D its aggregation, computed here from the views."""
    full, blk = toy_archs()
    arch, bs = (full, 0) if kind == "full" else (blk, 2)
    params = {"n_mc": 3} if name in ("bgpo", "ebpo") else {"n_views": 2} if name == "random_mask_rl" else {}
    algo = REGISTRY[name](params)
    toy = Toy(0)
    rows, surrogate, D_want = [], 0.0, 0.0
    for s in _samples(bs):
        rows += algo.rows(s, arch, bs, torch.Generator().manual_seed(7 + s.index))
        views = _views(algo, s, arch, bs, 7 + s.index)
        lin, _ = _direct(toy, views, torch.tensor(s.prompt_ids + s.response_ids), bs)
        w, d = _weights(name, algo, s, views, bs, arch)
        assert sorted(w) == sorted(lin)
        surrogate = surrogate + sum(w[k] * s.advantage * lin[k] for k in lin)
        D_want += d
    loss, D, mbs = _trainer_loss(algo, toy, rows, bs)
    assert D == pytest.approx(D_want) and len(mbs) >= 2
    got, want = _grads(loss, toy), _grads(-surrogate / D_want, toy)
    assert want.abs().max() > 1e-3
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()  # old log-probs are fp32
    # and the loss value itself is -(1/D) sum w A (ratio 1, KL 0)
    val = (
        -sum(
            w * s.advantage
            for s in _samples(bs)
            for w in _weights(name, algo, s, _views(algo, s, arch, bs, 7 + s.index), bs, arch)[0].values()
        )
        / D_want
    )
    assert float(loss) == pytest.approx(val, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("name,params", [("ebpo", {"n_mc": 4}), ("coupled_grpo", {}), ("vrpo", {"n_mc": 3})])
def test_rows_longer_than_seq_length_split_into_one_micro_batch(name, params):
    """A row whose views exceed train.seq_length is cut at view boundaries into sequences of one micro-batch:
    off-policy (old policy != current, clipping active) the loss and gradient equal those of the unsplit row, and
    the trainer refuses when the micro-batch cannot hold the views."""
    full, blk = toy_archs()
    algo = REGISTRY[name](params)
    toy, old = Toy(0), Toy(5)
    samples = _samples(2)
    for i, s in enumerate(samples):  # VRPO pairs the best and the worst of a group
        s.reward, s.group = float(i % 2), 0 if name != "vrpo" else i // 2
    rows = algo.batch_rows(samples, blk, 2, lambda index: torch.Generator().manual_seed(11 + index))
    longest_view = max(int(torch.bincount(r.segment_ids).max()) for r in rows)
    whole, D, _ = _trainer_loss(algo, toy, rows, 2, old_toy=old, seq_length=max(len(r) for r in rows))
    seq = max(longest_view, max(len(r) for r in rows) // 2)
    cut, D_cut, mbs = _trainer_loss(algo, toy, rows, 2, old_toy=old, seq_length=seq, mbs_size=4)
    assert seq < max(len(r) for r in rows) and D_cut == pytest.approx(D)
    assert float(cut) == pytest.approx(float(whole), rel=1e-5)
    assert torch.allclose(_grads(cut, toy), _grads(whole, toy), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="train.micro_batch_size=1"):
        _trainer_loss(algo, toy, rows, 2, old_toy=old, seq_length=seq, mbs_size=1)


def test_d_treerpo_self_distillation_enters_the_trainer_loss_as_its_coefficients():
    """Through rows -> packing -> SlotObjective, switching the SD term on adds exactly -sum_(i,j) c_ij grad log
    p(y_ij | parent) (c from DTreeRPO.self_distillation, log p from the views directly), whatever the packing."""
    full, _ = toy_archs()
    on = REGISTRY["d_treerpo"]({"sd_lambda_max": 0.5, "sd_max_steps": 2, "kl_coef": 0.0})
    off = REGISTRY["d_treerpo"]({"self_distillation": False, "kl_coef": 0.0})
    toy = Toy(3)
    samples = [
        sample([1, 2], y, adv=a, index=i, extra={"parent": (0, 1, 0), "rollout_step": 1})
        for i, (y, a) in enumerate([([0, 2, 1], 1.0), ([0, 1], 0.5), ([2, 2, 1], -1.5)])
    ]
    gen = lambda index: torch.Generator().manual_seed(index)  # noqa: E731
    loss_on, D, _ = _trainer_loss(on, toy, on.batch_rows(samples, full, 0, gen), 0, ref=False, mbs_size=2)
    loss_off, _, _ = _trainer_loss(off, toy, off.batch_rows(samples, full, 0, gen), 0, ref=False, mbs_size=2)
    coef = on.self_distillation(samples)
    direct = 0.0
    for s in samples:
        lin, _ = _direct(toy, on.views(s, full, 0, gen(s.index)), torch.tensor(s.prompt_ids + s.response_ids), 0)
        direct = direct - sum(c * lin[j] for (i, j), c in coef.items() if i == s.index)
    assert coef and D == 3
    got = _grads(loss_on, toy) - _grads(loss_off, toy)
    assert torch.allclose(got, _grads(direct, toy), rtol=1e-5, atol=1e-7)


def _check_spg(params: dict, seed: int, value_of):
    """SPG's trainer loss and gradient == -(1/G) sum_i A_i value_of(algo, toy, sample, views, bs) on both archs;
    returns the last arch's (toy, rows, bs, loss)."""
    full, blk = toy_archs()
    for arch, bs in ((full, 0), (blk, 2)):
        algo = REGISTRY["spg"](params)
        toy = Toy(seed)
        rows, surrogate = [], 0.0
        for s in _samples(bs):
            rows += algo.rows(s, arch, bs, torch.Generator().manual_seed(seed + s.index))
            views = algo.views(s, arch, bs, torch.Generator().manual_seed(seed + s.index))
            surrogate = surrogate + s.advantage * value_of(algo, toy, s, views, bs)
        want = -surrogate / len(SAMPLES)
        loss, D, _ = _trainer_loss(algo, toy, rows, bs, ref=False)
        assert D == len(SAMPLES)
        assert float(loss) == pytest.approx(float(want), rel=1e-4, abs=1e-6)  # fp32 trainer path
        got = _grads(loss, toy)
        assert torch.allclose(got, _grads(want, toy), rtol=1e-4, atol=1e-6)
    return toy, rows, bs, got


def test_spg_gradient_uses_the_bound_of_the_advantage_sign():
    """SPG (no ratio): grad loss = -(1/D) sum_i A_i grad L_i with L_i the sequence mean over token slots of
    ELBO_k for A_i > 0 and w EUBO_k + (1 - w) ELBO_k for A_i <= 0 (EUBO_k = (1/beta) log sum_v c_v p_v^beta)."""

    def value(algo, toy, s, views, bs):
        lin, lse = _direct(toy, views, torch.tensor(s.prompt_ids + s.response_ids), bs, algo.p["eubo_beta"])
        mix = algo.p["mix"]
        bound = {k: lin[k] if s.advantage > 0 else mix * lse[k] + (1 - mix) * lin[k] for k in lin}
        return sum(bound.values()) / len(bound)

    toy, rows, bs, got = _check_spg({"block": 2, "n_mc": 3}, 1, value)
    # the EUBO term matters: with mix 0 (ELBO everywhere) the gradient differs
    loss0, _, _ = _trainer_loss(REGISTRY["spg"]({"block": 2, "n_mc": 3, "mix": 0.0}), toy, rows, bs, ref=False)
    assert not torch.allclose(_grads(loss0, toy), got, rtol=1e-3)


def test_spg_dare_estimator_equals_dare_formula():
    """estimator=dare through the trainer path == DARE's per-sequence value written out from the views' masks
    (``llada_dp_actor_spg.py``: unweighted ELBO over the masked response tokens, 1/t EUBO, mix), loss and
    gradient, on both archs (tests/test_algos_dare_formulas.py checks the masks against DARE's own function)."""

    def value(algo, toy, s, views, bs):
        beta, w = algo.p["eubo_beta"], algo.p["mix"]
        P, L = len(s.prompt_ids), len(s.response_ids)
        lp = view_logps(toy, torch.tensor(s.prompt_ids + s.response_ids), [v.tokens for v in views], bs)[:, P:]
        masked = torch.stack([v.tokens[P:] == MASK for v in views])  # [n_mc, L]
        elbo = torch.stack([lp[m][mk].sum() / mk.sum() for m, mk in enumerate(masked)]).mean()
        avg = (lp.exp() ** beta * masked / (masked.sum(1, keepdim=True) / L)).mean(0)
        eubo = (avg[avg > 0].log() / beta).mean()
        return elbo if s.advantage > 0 else w * eubo + (1 - w) * elbo

    _check_spg({"estimator": "dare", "block": 2, "n_mc": 3}, 2, value)


# ================================================================== clipping, dual clip, BGPO's bounds
def _clip_grad(ratio, adv, **kw):
    logp = torch.tensor([math.log(ratio)], dtype=torch.float64, requires_grad=True)
    loss, clipped = ppo_clip_loss(
        logp, torch.zeros(1, dtype=torch.float64), torch.tensor([adv], dtype=torch.float64), PPOClip(**kw)
    )
    (g,) = torch.autograd.grad(loss.sum(), logp)
    return float(loss), float(g), float(clipped)


def test_ppo_clipping_at_the_bounds():
    # outside the trust region on the side the advantage pushes to: clipped, no gradient
    assert _clip_grad(1.5, 2.0) == pytest.approx((-1.2 * 2.0, 0.0, 1.0))
    assert _clip_grad(0.5, -2.0) == pytest.approx((0.8 * 2.0, 0.0, 1.0))
    # inside: the unclipped -rho A, gradient d(-rho A)/d logp = -rho A
    assert _clip_grad(1.1, 2.0) == pytest.approx((-2.2, -2.2, 0.0))
    assert _clip_grad(0.9, -2.0) == pytest.approx((1.8, 1.8, 0.0))
    # outside on the other side: the pessimistic unclipped term keeps its gradient
    assert _clip_grad(1.5, -2.0) == pytest.approx((3.0, 3.0, 0.0))
    assert _clip_grad(0.5, 2.0) == pytest.approx((-1.0, -1.0, 0.0))
    # asymmetric clip-higher: 1.25 is inside [0.8, 1.28] but outside [0.8, 1.2]
    assert _clip_grad(1.25, 1.0, eps_low=0.2, eps_high=0.28)[1] == pytest.approx(-1.25)
    assert _clip_grad(1.25, 1.0, eps_low=0.2)[1] == 0.0
    assert _clip_grad(0.75, -1.0, eps_low=0.2, eps_high=0.28)[1] == 0.0  # eps_low unchanged
    # dual clip: for A < 0 the loss is capped at -c A (no gradient there); A > 0 untouched
    assert _clip_grad(5.0, -1.0, dual_clip=3.0) == pytest.approx((3.0, 0.0, 0.0))
    assert _clip_grad(2.0, -1.0, dual_clip=3.0) == pytest.approx((2.0, 2.0, 0.0))
    assert _clip_grad(5.0, 1.0, dual_clip=3.0)[0] == pytest.approx(-1.2)
    with pytest.raises(ValueError, match="dual_clip"):
        _clip_grad(1.0, 1.0, dual_clip=1.0)
    # the log-ratio is clamped before exp
    assert _clip_grad(math.exp(30.0), -1.0, log_ratio_clamp=10.0)[0] == pytest.approx(math.exp(10.0))


def _slots(logp, old, adv, ref=None):
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    return lp, Slots(
        logp=lp,
        old=torch.tensor(old, dtype=torch.float64),
        adv=torch.tensor(adv, dtype=torch.float64),
        ref=None if ref is None else torch.tensor(ref, dtype=torch.float64),
        weight=torch.ones(len(logp), dtype=torch.float64),
    )


def test_algorithm_slot_loss_wires_clip_parameters():
    algo = REGISTRY["tracerl"]({"eps_high": 0.28, "dual_clip": 3.0, "kl_coef": 0.0})
    lr = [math.log(1.25), math.log(5.0), math.log(0.5)]
    lp, s = _slots(lr, [0.0, 0.0, 0.0], [1.0, -1.0, -1.0])
    loss, parts = algo.slot_loss(s)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    assert loss.tolist() == pytest.approx([-1.25, 3.0, 0.8])
    assert g.tolist() == pytest.approx([-1.25, 0.0, 0.0])
    assert parts["clipfrac"].tolist() == [0.0, 0.0, 1.0]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_dual_clip_is_one_option_of_every_ppo_clip_algorithm(name):
    """algo.params.dual_clip caps -rho A at -c A for A < 0 (rho = 5 > c = 3: loss 3, no gradient) in every
    PPO-clip algorithm; objectives without a clipped ratio refuse the key."""
    cls = REGISTRY[name]
    if not cls.clipped_ratio:
        with pytest.raises(ConfigError, match="dual_clip"):
            cls({"dual_clip": 3.0})
        return
    cases = ((None, 5.0), (3.0, 3.0)) if cls.defaults.get("dual_clip") is None else ((3.0, 3.0),)  # None = default
    for c, want in cases:
        lp, s = _slots([math.log(5.0), math.log(5.0)], [0.0, 0.0], [-1.0, 1.0])
        loss, _ = cls({"dual_clip": c, "kl_coef": 0.0, "eps_low": 0.2, "eps_high": 0.2}).slot_loss(s)
        (g,) = torch.autograd.grad(loss.sum(), lp)
        assert loss[0].item() == pytest.approx(want)
        assert g[0].item() == pytest.approx(0.0 if c else 5.0)
        assert loss[1].item() == pytest.approx(-1.2)  # A > 0: the ordinary clip, untouched
    with pytest.raises(ConfigError, match="dual_clip"):
        cls({"dual_clip": 1.0})


def test_bgpo_tangent_and_exp_bounds():
    """A >= 0: r = 1 + (l - l_old) (tangent, <= exp); A < 0: r = exp(l - l_old); both inside the clip. On-policy
    the two forms agree with the ratio objective in value (-A) and gradient (-A)."""
    algo = REGISTRY["bgpo"]()
    lp, s = _slots([0.0, 0.0], [0.0, 0.0], [2.0, -2.0])
    loss, _ = algo.slot_loss(s)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    assert loss.tolist() == pytest.approx([-2.0, 2.0]) and g.tolist() == pytest.approx([-2.0, 2.0])
    ref_loss, _ = ppo_clip_loss(lp, s.old, s.adv, PPOClip(0.2))
    (g_ref,) = torch.autograd.grad(ref_loss.sum(), lp)
    assert torch.allclose(g, g_ref) and torch.allclose(loss, ref_loss)
    d = 0.1
    lp, s = _slots([d, d], [0.0, 0.0], [2.0, -2.0])
    loss, _ = algo.slot_loss(s)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    assert loss.tolist() == pytest.approx([-(1 + d) * 2.0, math.exp(d) * 2.0])
    assert g.tolist() == pytest.approx([-2.0, math.exp(d) * 2.0])  # tangent: constant slope
    assert -(1 + d) * 2.0 > -math.exp(d) * 2.0  # tangent objective <= exp objective
    lp, s = _slots([0.5, -0.5], [0.0, 0.0], [2.0, -2.0])  # outside the trust region: clipped
    loss, _ = algo.slot_loss(s)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    assert loss.tolist() == pytest.approx([-1.2 * 2.0, 0.8 * 2.0]) and g.tolist() == [0.0, 0.0]


# ================================================================== KL estimators
def test_kl_estimators_closed_forms_and_exact_expectation():
    logp = torch.tensor([-1.0, -0.3, -2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -0.3, -0.5], dtype=torch.float64)
    d = ref - logp.detach()
    assert torch.allclose(kl_penalty(logp, ref, "k1"), -d)
    assert torch.allclose(kl_penalty(logp, ref, "k2"), 0.5 * d * d)
    assert torch.allclose(kl_penalty(logp, ref, "k3"), torch.exp(d) - d - 1)
    grid = torch.linspace(-6, 6, 241, dtype=torch.float64)
    k3 = kl_penalty(torch.zeros_like(grid), grid, "k3")
    assert bool((k3 >= 0).all()) and float(k3[120]) == 0.0
    at = torch.tensor([-0.7], dtype=torch.float64, requires_grad=True)
    (g3,) = torch.autograd.grad(kl_penalty(at, at.detach(), "k3").sum(), at)
    (g2,) = torch.autograd.grad(kl_penalty(at, at.detach(), "k2").sum(), at)
    (g1,) = torch.autograd.grad(kl_penalty(at, at.detach(), "k1").sum(), at)
    assert float(g3) == 0.0 and float(g2) == 0.0 and float(g1) == 1.0
    # E_{x ~ pi}[k] over a categorical: k1 and k3 are exactly KL(pi || ref), k2 is not
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    rf = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    kl = float((pi * (pi / rf).log()).sum())
    for kind, exact in (("k1", True), ("k3", True), ("k2", False)):
        e = float((pi * kl_penalty(pi.log(), rf.log(), kind)).sum())
        assert (abs(e - kl) < 1e-12) == exact, (kind, e, kl)
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(logp, ref, "k4")


def test_kl_term_enters_only_with_a_coefficient_and_an_anchor():
    lp_vals, old, ref, adv = [-1.0, -2.0], [-1.1, -1.8], [-0.5, -2.5], [1.0, -1.0]
    base, _ = ppo_clip_loss(
        torch.tensor(lp_vals, dtype=torch.float64),
        torch.tensor(old, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        PPOClip(0.2),
    )
    for params in (
        {"kl_coef": 0.1, "kl_anchor": "none"},
        {"kl_coef": 0.0, "kl_anchor": "old"},
        {"kl_coef": 0.0, "kl_anchor": "ref"},
    ):
        algo = REGISTRY["tracerl"](params)
        assert not algo.needs_ref
        _, s = _slots(lp_vals, old, adv)
        loss, parts = algo.slot_loss(s)
        assert torch.allclose(loss, base) and "kl" not in parts
    _, s = _slots(lp_vals, old, adv, ref)
    loss, parts = REGISTRY["tracerl"]({"kl_coef": 0.1, "kl_anchor": "old"}).slot_loss(s)
    assert torch.allclose(loss, base + 0.1 * kl_penalty(s.logp, s.old, "k3_exp10"))
    algo = REGISTRY["tracerl"]({"kl_coef": 0.1, "kl_anchor": "ref", "kl_estimator": "k2"})
    assert algo.needs_ref
    loss, parts = algo.slot_loss(s)
    assert torch.allclose(loss, base + 0.1 * 0.5 * (s.ref - s.logp) ** 2)
    _, s = _slots(lp_vals, old, adv)
    with pytest.raises(RuntimeError, match="reference log-probs"):
        algo.slot_loss(s)
    with pytest.raises(ConfigError, match="kl_anchor"):
        REGISTRY["tracerl"]({"kl_anchor": "policy"})
    assert REGISTRY["d1"]().needs_ref and not REGISTRY["tracerl"]().needs_ref and not REGISTRY["bgpo"]().needs_ref


# ================================================================== advantages
def test_group_advantages_against_hand_computation():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0])
    g = r.view(3, 4).double()
    mean = g.mean(1, keepdim=True)
    want = {
        "unbiased": (g - mean) / (g.std(1, unbiased=True, keepdim=True) + 1e-6),
        "population": (g - mean) / g.std(1, unbiased=False, keepdim=True).clamp(min=1e-300),  # flat: 0 / tiny
        "none": g - mean,
    }
    for std, w in want.items():
        assert torch.allclose(group_advantages(r, 4, "grpo", std), w.flatten().float(), atol=1e-6)
    # by hand, first group: mean 0.75, unbiased std 0.5, population std sqrt(3)/4
    assert group_advantages(r, 4)[:4].tolist() == pytest.approx([0.5, -1.5, 0.5, 0.5], rel=1e-5)
    assert group_advantages(r, 4, std="population")[:4].tolist() == pytest.approx(
        [0.25 / (math.sqrt(3) / 4), -0.75 / (math.sqrt(3) / 4), 0.25 / (math.sqrt(3) / 4), 0.25 / (math.sqrt(3) / 4)],
        rel=1e-5,
    )
    assert group_advantages(r, 4)[8:].tolist() == [0.0] * 4  # all-equal group: no signal
    rloo = group_advantages(r, 4, "rloo")
    assert rloo[:4].tolist() == pytest.approx([1 - 2 / 3, 0 - 1.0, 1 - 2 / 3, 1 - 2 / 3])
    rpp = group_advantages(r, 4, "reinforce_pp", lengths=[3] * 12)  # equal lengths: whitening over responses
    c = (g - mean).flatten()
    assert torch.allclose(rpp, ((c - c.mean()) / c.std(unbiased=False) * math.sqrt(35 / 36)).float(), atol=1e-6)
    assert abs(float(rpp.mean())) < 1e-6 and abs(float(rpp.std(unbiased=False)) - math.sqrt(35 / 36)) < 1e-4
    assert group_advantages(torch.tensor([1.0, 0.0]), 1).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="groups of rl.n_samples=5"):
        group_advantages(r, 5)
    with pytest.raises(ValueError, match="advantage.estimator="):
        group_advantages(r, 4, "ppo")
    with pytest.raises(ValueError, match="advantage.std="):
        group_advantages(r, 4, std="mad")
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(r, 1, "rloo")


def test_group_filters_and_truncation():
    r = torch.tensor(
        [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    )
    keep = filter_groups(r, 4, drop_all_equal=True)
    assert keep.tolist() == [False] * 4 + [True] * 4 + [False] * 4 + [True] * 8
    keep = filter_groups(r, 4, accuracy_band=(0.3, 0.7))  # accuracies 1, .25, 0, .75, .5
    assert keep.view(5, 4)[:, 0].tolist() == [False, False, False, False, True]
    keep = filter_groups(r, 4, accuracy_band=(0.2, 0.8))
    assert keep.view(5, 4)[:, 0].tolist() == [False, True, False, True, True]
    assert filter_groups(r, 4).all()
    t = truncated_as_wrong(torch.tensor([1.0, 1.0, 0.5]), torch.tensor([False, True, True]))
    assert t.tolist() == [1.0, 0.0, 0.0]
    assert truncated_as_wrong(torch.tensor([1.0]), torch.tensor([True]), wrong=-1.0).tolist() == [-1.0]


# ================================================================== aggregation across packing
@pytest.mark.parametrize(
    "agg",
    ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_length", "fragment_mean", "fragment_width"],
)
def test_aggregation_is_global_however_rows_are_packed(agg):
    """Random-masking RL with 3 fragments per response (one row each), 4 samples of different lengths, packed 2-3
    rows per sequence into several micro-batches; an old policy that differs (ratios != 1, some clipped) and
    the KL to it. sum over micro-batches of the objective / global denominator equals the stated normalisation:
    token_mean sum_all l_s / #slots; seq_mean_token_mean mean_i (1/n_i) sum_i l_s; seq_mean_token_sum
    mean_i sum_i l_s; seq_mean_length mean_i (1/L_i) sum_i l_s; fragment_mean mean over all fragments f of
    (1/|f|) sum_f l_s (a view's slots are view * L + k); fragment_width the same with 1/max_i L_i (the rows made
    by batch_rows over the 4 samples: the batch's longest response)."""
    full = toy_archs()[0]
    algo = REGISTRY["random_mask_rl"]({"n_views": 3, "loss_agg": agg, "eps_low": 0.1, "kl_coef": 0.05})
    toy, old_toy = Toy(0), Toy(0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for p in old_toy.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    rows, per_sample = [], []
    samples = _samples(0)
    by_sample = algo.batch_rows(samples, full, 0, lambda i: torch.Generator().manual_seed(i))
    for s in samples:
        r = [row for row in by_sample if int(row.sample[0]) == s.index]
        views = algo.views(s, full, 0, torch.Generator().manual_seed(s.index))
        assert len(r) == len(views) == 3
        for i, row in enumerate(r):
            row.extras["smp"] = torch.full_like(row.slot, s.index)
        rows += r
        x0 = torch.tensor(s.prompt_ids + s.response_ids)
        with torch.no_grad():
            lin, _ = _direct(toy, views, x0, 0)
            old, _ = _direct(old_toy, views, x0, 0)
        losses = {}
        for k in lin:
            rho = torch.exp(lin[k] - old[k])
            a = s.advantage
            d = old[k] - lin[k]
            k3 = float(torch.exp(d.clamp(-10.0, 10.0)) - d - 1)  # dLLM-RL's k3 (rl_trado.py:752), uncapped
            losses[k] = float(-torch.minimum(rho * a, rho.clamp(0.9, 1.1) * a)) + 0.05 * k3
        per_sample.append((losses, len(s.response_ids)))
    loss, D, mbs = _trainer_loss(algo, toy, rows, 0, old_toy=old_toy, seq_length=14, mbs_size=1, ref=False)
    # the packing really mixes samples and splits them
    where = {}
    for m, mb in enumerate(mbs):
        smp = set(mb.extras["smp"][mb.extras["smp"] >= 0].tolist())
        for i in smp:
            where.setdefault(i, set()).add(m)
    assert any(len(set(mb.extras["smp"][mb.extras["smp"] >= 0].tolist())) > 1 for mb in mbs)
    assert any(len(v) > 1 for v in where.values())
    N = len(per_sample)
    if agg == "token_mean":
        want = sum(sum(ls.values()) for ls, _ in per_sample) / sum(len(ls) for ls, _ in per_sample)
    elif agg == "seq_mean_token_mean":
        want = sum(sum(ls.values()) / len(ls) for ls, _ in per_sample) / N
    elif agg == "seq_mean_token_sum":
        want = sum(sum(ls.values()) for ls, _ in per_sample) / N
    elif agg == "fragment_mean":
        frags = [[x for k, x in ls.items() if k // L == f] for ls, L in per_sample for f in range(3)]
        frags = [f for f in frags if f]
        assert len({len(f) for f in frags}) > 1  # fragments of different sizes: not a per-sample mean in disguise
        want = sum(sum(f) / len(f) for f in frags) / len(frags)
    elif agg == "fragment_width":
        W = max(L for _, L in per_sample)
        assert len({L for _, L in per_sample}) > 1
        want = (
            sum(sum(ls.values()) for ls, _ in per_sample) / W / sum(len({k // L for k in ls}) for ls, L in per_sample)
        )
    else:
        want = sum(sum(ls.values()) / L for ls, L in per_sample) / N
    assert float(loss) == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="loss_agg"):
        rows_for_views(_samples(0)[0], algo.views(_samples(0)[0], full, 0, torch.Generator()), full, "mean")


def test_aggregation_sees_clipped_and_unclipped_slots():
    """The aggregation test above is only meaningful if its policies differ enough to clip some slots."""
    full = toy_archs()[0]
    algo = REGISTRY["random_mask_rl"]({"n_views": 3, "eps_low": 0.1})
    toy, old_toy = Toy(0), Toy(0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for p in old_toy.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    ratios = []
    for s in _samples(0):
        views = algo.views(s, full, 0, torch.Generator().manual_seed(s.index))
        x0 = torch.tensor(s.prompt_ids + s.response_ids)
        with torch.no_grad():
            lin, _ = _direct(toy, views, x0, 0)
            old, _ = _direct(old_toy, views, x0, 0)
        ratios += [float(torch.exp(lin[k] - old[k])) for k in lin]
    assert any(abs(r - 1) > 0.1 for r in ratios) and any(abs(r - 1) < 0.1 for r in ratios)


# ================================================================== parameters
def test_unknown_params_fail_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"algo\.params\.epsilon.*no parameter 'epsilon'.*valid: \[.*'eps_low'"):
        REGISTRY["d1"]({"epsilon": 0.2})
    with pytest.raises(ConfigError, match=r"algo\.params\.loss_agg='fragment'.*fragment_mean"):
        REGISTRY["tracerl"]({"loss_agg": "fragment"})  # refused when the algorithm is built, not at row time
    with pytest.raises(ConfigError, match="'p_prompt'"):
        REGISTRY["tracerl"]({"p_prompt": 0.1})  # d1's key is not tracerl's
    with pytest.raises(ConfigError, match="algo.name='grpo' unknown"):
        build_algorithm("grpo")
    assert REGISTRY["d1"]({"eps_low": None}).p["eps_low"] == 0.5  # null keeps the published default


def test_published_defaults():
    p = REGISTRY["d1"]().p
    assert (p["eps_low"], p["kl_coef"], p["kl_anchor"], p["kl_estimator"], p["p_prompt"]) == (
        0.5,
        0.04,
        "ref",
        "k3",
        0.15,
    )
    p = REGISTRY["coupled_grpo"]().p
    assert (p["t_low"], p["t_high"], p["eps_low"], p["kl_coef"], p["kl_anchor"]) == (0.2, 0.8, 0.5, 0.01, "ref")
    p = REGISTRY["tracerl"]().p
    assert (p["eps_low"], p["kl_coef"], p["kl_anchor"], p["kl_estimator"], p["log_ratio_clamp"]) == (
        0.2,
        0.01,
        "old",
        "k3_exp10",
        10.0,
    )
    full, blk = toy_archs()
    for name in ("tracerl", "random_mask_rl"):  # dLLM-RL's aggregation per family (rl_llada.py:589-592)
        assert (REGISTRY[name]().loss_agg(full), REGISTRY[name]().loss_agg(blk)) == ("fragment_mean", "fragment_width")
        assert REGISTRY[name]({"loss_agg": "token_mean"}).loss_agg(full) == "token_mean"
    p = REGISTRY["random_mask_rl"]().p
    assert (p["p_low"], p["p_high"], p["eps_low"], p["kl_coef"], p["kl_anchor"], p["couple"]) == (
        0.1,
        0.9,
        0.2,
        0.01,
        "old",
        False,
    )
    assert (p["kl_estimator"], p["log_ratio_clamp"]) == ("k3_exp10", 10.0)  # dLLM-RL's one forward_process
    s = sample([1], [0, 1, 2])
    assert len(REGISTRY["random_mask_rl"]().views(s, full, 0, torch.Generator())) == 35
    assert len(REGISTRY["random_mask_rl"]().views(s, blk, 2, torch.Generator())) == 1
    assert REGISTRY["tracerl"]().p["shrink"] is None  # 1 for block families, 8 otherwise
    p = REGISTRY["bgpo"]().p
    assert (p["n_mc"], p["eps_low"], p["kl_coef"]) == (16, 0.2, 0.0)
    p = REGISTRY["ebpo"]().p
    assert (p["n_mc"], p["eps_low"], p["kl_estimator"]) == (16, 0.2, "k2")
    p = REGISTRY["spg"]().p
    assert (p["eubo_beta"], p["mix"], p["n_mc"], p["p_prompt"], p["kl_coef"]) == (1.5, 0.5, 2, 0.15, 0.0)
    p = REGISTRY["cj_grpo"]().p
    assert (p["eps_low"], p["kl_coef"]) == (0.2, 0.0)


# ================================================================== Dream's shifted rows
def test_dream_rows_shift_one_position_and_slots_keep_their_tokens():
    """Dream predicts token k at position k-1: views_to_row moves labels, coefficients, slots, advantages and the
    token index one position left in every view; the slot estimates from the tiny Dream model on the packed row
    equal sum_v coef * log softmax(model(view))[P + k - 1, y_k] computed view by view."""
    torch.manual_seed(0)
    fam = get_family("dream")
    cfg = fam.tiny_config()
    model = build_hf_model(cfg).eval()
    arch = fam.arch(cfg)
    assert arch.logits_shift == 1
    s = sample([5, 17, 99], [3, 8, 200, 41, 7], adv=0.5)
    algo = REGISTRY["coupled_grpo"]()
    views = algo.views(s, arch, 0, torch.Generator().manual_seed(1))
    (row,) = algo.rows(s, arch, 0, torch.Generator().manual_seed(1))
    P, L, n = 3, 5, 8
    x0 = torch.tensor(s.prompt_ids + s.response_ids)
    for vi, v in enumerate(views):
        seg = slice(vi * n, (vi + 1) * n)
        assert torch.equal(row.tokens[seg], v.tokens)
        assert torch.equal(row.labels[seg][:-1], x0[1:])
        assert torch.equal(row.weight[seg][:-1], v.coef[1:]) and row.weight[seg][-1] == 0
        assert torch.equal(row.slot[seg][:-1], v.slot[1:]) and row.slot[seg][-1] == -1
        tok = row.tok[seg]
        assert tok.tolist() == [-1, -1] + list(range(L)) + [-1]
        assert torch.equal(row.adv[seg][P - 1 : P - 1 + L], torch.full((L,), 0.5))
    (mb,) = pack_rows([row], seq_length=len(row) + 2)
    S = mb.tokens.shape[1]
    mask = MaskSpec("bidirectional", segment_ids=mb.segment_ids).dense(S, S, 1)
    with torch.no_grad():
        logits = model(mb.tokens, attention_mask=mask, position_ids=mb.position_ids).double()
        logp = F.log_softmax(logits, -1).gather(-1, mb.labels.unsqueeze(-1)).squeeze(-1)
        got = gather_slots(mb, logp, on_policy=True)
        want = torch.zeros(L, dtype=torch.float64)
        for v in views:
            lp = F.log_softmax(model(v.tokens[None]).double()[0], -1)
            for k in range(L):
                want[k] += float(v.coef[P + k]) * lp[P + k - 1, s.response_ids[k]]
    assert torch.allclose(got.logp, want, atol=1e-5)
    # the unshifted reading would be a different number: the test can tell
    with torch.no_grad():
        lp = F.log_softmax(model(views[0].tokens[None]).double()[0], -1)
    assert abs(float(lp[P, s.response_ids[0]] - lp[P - 1, s.response_ids[0]])) > 1e-3
    with pytest.raises(ValueError, match="non-empty prompt"):
        algo.rows(sample([], [1, 2]), arch, 0, torch.Generator())


def test_unknown_kl_estimator_names_the_key_a_user_sets():
    """The error names ``algo.params.kl_estimator`` (the key that exists), not ``rl.kl_estimator`` (none does)."""
    x = torch.zeros(3)
    with pytest.raises(ValueError, match=r"algo\.params\.kl_estimator='k4' unknown"):
        kl_penalty(x, x, "k4")
