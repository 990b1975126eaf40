"""Rollout correction (trainer/offpolicy/importance.py): IS weights / rejection at the thresholds, metrics against
closed forms, unbiasedness on an enumerable toy, and the decoupled / bypass PPO losses and their gradients."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from megadare.algos.base import SlotObjective
from megadare.algos.policy_loss import PPOClip, ppo_clip_loss
from megadare.config import Config
from megadare.data.rows import MicroBatch
from megadare.trainer.offpolicy.correction import bypass_rejection
from megadare.trainer.offpolicy.importance import RolloutIS, rollout_is_weights
from offpolicy_reference import OffPolicyLoss, bypass_ppo_loss, decoupled_ppo_loss

LEVELS = ("token", "sequence", "geometric")


def _log(x: float, dtype=torch.float32) -> torch.Tensor:
    return torch.log(torch.tensor(x, dtype=dtype))


# ---------------------------------------------------------------------------------------------------------------
# identity
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", ("truncate", "mask"))
def test_identity_weights_are_one(level, mode):
    g = torch.Generator().manual_seed(0)
    t = -torch.rand(12, generator=g) * 5
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4])
    w, keep, m = rollout_is_weights(
        t, t.clone(), groups, RolloutIS(level=level, mode=mode, threshold_high=2.0, veto_threshold=1e-4)
    )
    assert torch.equal(w, torch.ones(12))
    assert bool(keep.all())
    assert m["ess"] == 1.0 and m["chi2"] == 0.0 and m["k3_kl"] == 0.0 and m["kl"] == 0.0
    assert m["is_mean"] == m["is_max"] == m["is_min"] == 1.0 and m["is_std"] == 0.0
    assert m["rejected_fraction"] == m["truncated_fraction"] == m["veto_fraction"] == 0.0
    assert m["applied_ess"] == 1.0


def test_decoupled_equals_ppo_clip_when_proximal_is_behaviour():
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(64, generator=g) * 3
    logp = old + 0.6 * torch.randn(64, generator=g)
    adv = torch.randn(64, generator=g)
    for kw in ({}, {"eps_high": 0.28}, {"dual_clip": 3.0}):
        ref, ref_clip = ppo_clip_loss(logp, old, adv, PPOClip(0.2, **kw))
        for mode in ("truncate", "mask"):
            loss, parts = decoupled_ppo_loss(
                logp, old, old.clone(), adv, OffPolicyLoss(0.2, rollout_is=RolloutIS(mode=mode), **kw)
            )
            assert torch.equal(loss, ref)
            assert torch.equal(parts["clipped"], ref_clip)
            assert torch.equal(parts["behave_weight"], torch.ones(64))
        bl, _ = bypass_ppo_loss(logp, old, adv, OffPolicyLoss(0.2, **kw))
        assert torch.equal(bl, ref)


# ---------------------------------------------------------------------------------------------------------------
# thresholds, table-driven
# ---------------------------------------------------------------------------------------------------------------


def _sequence(level: str, x: torch.Tensor) -> torch.Tensor:
    """Per-token log-ratios of a 2-token sequence whose aggregated log-ratio is exactly x at ``level``
    (token: each token alone carries x)."""
    if level == "geometric":
        return torch.stack([x, x])  # mean of (x, x) is x exactly
    return torch.stack([x, torch.zeros(())])  # token: element 0 carries x; sequence: x + 0 = x


D = 1e-3
HI, LO = 2.0, 0.5
# (name, log-ratio, truncate: (weight, truncated), mask: kept)
CASES = [
    ("at_high", _log(HI), (HI, False), True),
    ("below_high", _log(HI) - D, (math.exp(math.log(HI) - D), False), True),
    ("above_high", _log(HI) + D, (HI, True), False),
    ("at_low", _log(LO), (LO, False), True),
    ("above_low", _log(LO) + D, (math.exp(math.log(LO) + D), False), True),
    ("below_low", _log(LO) - D, (math.exp(math.log(LO) - D), False), False),  # TIS: no lower truncation
    ("one", torch.zeros(()), (1.0, False), True),
]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_threshold_table(level, case):
    _, x, (w_trunc, truncated), kept = case
    lr = _sequence(level, x)
    b = torch.zeros(2)  # behaviour 0, so t - b is the intended log-ratio bit for bit
    t = lr.clone()
    assert torch.equal(t - b, lr)
    groups = torch.tensor([0, 0])
    # token level: element 0 carries the case, element 1 has ratio 1; sequence / geometric: the pair carries it
    idx = 0
    w, keep, m = rollout_is_weights(t, b, groups, RolloutIS(level=level, mode="truncate", threshold_high=HI))
    assert bool(keep.all())
    assert w[idx].item() == pytest.approx(w_trunc, rel=1e-6)
    assert w[idx].item() <= HI
    if truncated:
        assert w[idx].item() == HI
    n_trunc_el = (1 if level == "token" else 2) if truncated else 0
    assert m["truncated_fraction"] == n_trunc_el / 2
    if level != "token":
        assert w[0] == w[1]

    w, keep, m = rollout_is_weights(t, b, groups, RolloutIS(level=level, mode="mask", threshold_high=HI))
    expect_keep = [kept, True] if level == "token" else [kept, kept]
    assert keep.tolist() == expect_keep
    for i in range(2):
        if expect_keep[i]:
            assert w[i].item() == pytest.approx(
                math.exp(float(lr[i])) if level == "token" else math.exp(float(x)), rel=1e-6
            )
        else:
            assert w[i].item() == 0.0
    assert m["rejected_fraction"] == expect_keep.count(False) / 2
    assert m["rejected_seq_fraction"] == (0.0 if all(expect_keep) else 1.0)
    assert m["truncated_fraction"] == 0.0


def test_truncate_with_explicit_lower_bound_clamps_from_below():
    lr = torch.stack([_log(0.25), _log(4.0), _log(1.0)])
    w, keep, m = rollout_is_weights(
        lr, torch.zeros(3), None, RolloutIS(level="token", mode="truncate", threshold_high=2.0, threshold_low=0.5)
    )
    assert w.tolist() == [0.5, 2.0, 1.0] and bool(keep.all())
    assert m["truncated_fraction"] == pytest.approx(2 / 3)


def test_sequence_weight_is_the_product_and_geometric_the_mean():
    # seq 7: ratios (2, 2) -> product 4, geometric 2; seq 3: (2, 0.5) -> 1, 1 ; unsorted, non-contiguous ids
    lr = torch.stack([_log(2.0), _log(2.0), _log(0.5), _log(2.0)])
    groups = torch.tensor([7, 7, 3, 3])
    w, _, _ = rollout_is_weights(lr, torch.zeros(4), groups, RolloutIS(level="sequence", threshold_high=None))
    assert torch.allclose(w, torch.tensor([4.0, 4.0, 1.0, 1.0]))
    w, _, _ = rollout_is_weights(lr, torch.zeros(4), groups, RolloutIS(level="sequence", threshold_high=2.0))
    assert w[:2].tolist() == [2.0, 2.0] and torch.allclose(w[2:], torch.ones(2))
    w, keep, _ = rollout_is_weights(
        lr, torch.zeros(4), groups, RolloutIS(level="sequence", mode="mask", threshold_high=2.0)
    )
    assert keep.tolist() == [False, False, True, True] and w[:2].tolist() == [0.0, 0.0]
    w, _, _ = rollout_is_weights(lr, torch.zeros(4), groups, RolloutIS(level="geometric", threshold_high=None))
    assert torch.allclose(w, torch.tensor([2.0, 2.0, 1.0, 1.0]))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", ("truncate", "mask"))
def test_veto_drops_the_whole_sequence(level, mode):
    # seq 0 has one catastrophic token (1e-5 < 1e-4); seq 1's smallest ratio equals the veto threshold (strict <)
    lr = torch.stack([_log(1.2), _log(1e-5), _log(1.0), _log(1e-4), _log(1.0)])
    groups = torch.tensor([0, 0, 0, 1, 1])
    w, keep, m = rollout_is_weights(
        lr,
        torch.zeros(5),
        groups,
        RolloutIS(level=level, mode=mode, threshold_high=1e9, threshold_low=1e-9, veto_threshold=1e-4),
    )
    assert keep.tolist() == [False, False, False, True, True]
    assert w[:3].tolist() == [0.0, 0.0, 0.0] and bool((w[3:] > 0).all())
    assert m["veto_fraction"] == 0.5
    assert m["rejected_fraction"] == pytest.approx(3 / 5)
    assert m["rejected_seq_fraction"] == 0.5


@pytest.mark.parametrize("level", LEVELS)
def test_log_clamp_prevents_inf(level):
    t = torch.tensor([100.0, 100.0, 100.0, -100.0, -100.0, -100.0])
    b = torch.zeros(6)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    assert torch.isinf(torch.exp((t - b)[:3].sum()))  # what an unclamped sequence weight would be
    w, keep, m = rollout_is_weights(t, b, groups, RolloutIS(level=level, threshold_high=None))
    assert bool(torch.isfinite(w).all()) and bool(keep.all())
    assert torch.equal(w[:3], torch.exp(torch.tensor(20.0)).expand(3))
    assert torch.equal(w[3:], torch.exp(torch.tensor(-20.0)).expand(3))
    assert all(math.isfinite(v) for v in m.values())
    w, _, _ = rollout_is_weights(t, b, groups, RolloutIS(level=level, threshold_high=2.0))
    assert w[:3].tolist() == [2.0] * 3
    w, _, _ = rollout_is_weights(t, b, groups, RolloutIS(level=level, threshold_high=2.0, log_clamp=5.0))
    assert torch.equal(w[3:], torch.exp(torch.tensor(-5.0)).expand(3))


def test_valid_mask_nan_and_no_gradient():
    t = torch.tensor([0.0, _log(3.0).item(), float("-inf"), _log(2.0).item()], requires_grad=True)
    b = torch.tensor([0.0, 0.0, float("-inf"), 0.0], requires_grad=True)
    valid = torch.tensor([True, True, True, False])
    w, keep, m = rollout_is_weights(t, b, None, RolloutIS(level="token", threshold_high=2.0), valid=valid)
    assert not w.requires_grad
    assert keep.tolist() == [True, True, False, False]  # NaN log-ratio (-inf - -inf) and padding
    assert w.tolist() == [1.0, 2.0, 0.0, 0.0]
    assert m["rejected_fraction"] == pytest.approx(1 / 3)
    assert m["is_max"] == pytest.approx(3.0) and m["is_min"] == 1.0  # padding and the NaN element excluded
    groups = torch.tensor([0, 0, 0, 1])
    w, keep, _ = rollout_is_weights(t, b, groups, RolloutIS(level="sequence", threshold_high=None), valid=valid)
    assert keep.tolist() == [False, False, False, False]  # the NaN rejects its whole sequence; seq 1 padding


def test_bad_arguments():
    x = torch.zeros(3)
    with pytest.raises(ValueError):
        rollout_is_weights(x, x, None, RolloutIS(level="tokens"))
    with pytest.raises(ValueError):
        rollout_is_weights(x, x, None, RolloutIS(mode="clip"))
    with pytest.raises(ValueError):
        rollout_is_weights(x, x, None, RolloutIS(threshold_high=0.0))
    with pytest.raises(ValueError):
        rollout_is_weights(x, x, None, RolloutIS(threshold_high=2.0, threshold_low=3.0))
    with pytest.raises(ValueError):
        rollout_is_weights(x, x, torch.zeros(2, dtype=torch.long), RolloutIS(level="sequence"))
    with pytest.raises(ValueError):
        bypass_ppo_loss(x, x, x, OffPolicyLoss(loss_type="gspo"))


# ---------------------------------------------------------------------------------------------------------------
# metrics against hand computations and closed forms
# ---------------------------------------------------------------------------------------------------------------


def test_metrics_by_hand():
    ratios = [1.0, 2.0, 0.5, 3.0]
    t = torch.tensor([math.log(r) for r in ratios], dtype=torch.float64)
    b = torch.zeros(4, dtype=torch.float64)
    w, keep, m = rollout_is_weights(t, b, None, RolloutIS(level="token", mode="truncate", threshold_high=2.0))
    n = 4
    s, s2 = sum(ratios), sum(r * r for r in ratios)
    mean = s / n
    assert m["is_mean"] == pytest.approx(1.625)
    assert m["is_std"] == pytest.approx(math.sqrt(s2 / n - mean * mean))
    assert m["is_max"] == pytest.approx(3.0) and m["is_min"] == pytest.approx(0.5)
    assert m["ess"] == pytest.approx(s * s / (n * s2))  # 42.25 / 57
    assert m["ess"] == pytest.approx(42.25 / 57)
    assert m["chi2"] == pytest.approx(s2 / n - 1)  # 2.5625
    k3 = [r - math.log(r) - 1 for r in ratios]
    assert m["k3_kl"] == pytest.approx(sum(k3) / n)
    assert m["kl"] == pytest.approx(-math.log(3.0) / 4)  # mean(b - t) = -(log 2 + log .5 + log 3)/4
    assert m["truncated_fraction"] == 0.25 and m["rejected_fraction"] == 0.0
    applied = [1.0, 2.0, 0.5, 2.0]
    assert m["applied_mean"] == pytest.approx(sum(applied) / n)
    assert m["applied_ess"] == pytest.approx(sum(applied) ** 2 / (n * sum(a * a for a in applied)))
    _, keep, m = rollout_is_weights(t, b, None, RolloutIS(level="token", mode="mask", threshold_high=2.0))
    assert keep.tolist() == [True, True, True, False]  # 2.0 and 0.5 sit exactly on the bounds
    assert m["rejected_fraction"] == 0.25 and m["truncated_fraction"] == 0.0


def test_sequence_level_metrics_count_sequences():
    # 3 sequences of different lengths: products 4, 1, 0.5 -> stats over 3 units (verl chi2_seq)
    lr = torch.tensor([math.log(2), math.log(2), math.log(2), math.log(0.5), 0.0, math.log(0.5)], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 1, 2])
    _, _, m = rollout_is_weights(
        lr, torch.zeros(6, dtype=torch.float64), groups, RolloutIS(level="sequence", threshold_high=None)
    )
    u = [4.0, 1.0, 0.5]
    assert m["is_mean"] == pytest.approx(sum(u) / 3)
    assert m["chi2"] == pytest.approx(sum(x * x for x in u) / 3 - 1)
    assert m["ess"] == pytest.approx(sum(u) ** 2 / (3 * sum(x * x for x in u)))


# the enumerable toy: behaviour q and target p over three outcomes
Q = [0.5, 0.3, 0.2]
P = [0.25, 0.25, 0.5]
F = [1.0, -2.0, 3.0]


def test_metrics_are_the_divergences_under_behaviour_samples():
    """A batch whose outcome frequencies are exactly q: k3_kl = KL(q || p) (the direction stated in the module),
    chi2 = chi^2(p || q) = sum p^2/q - 1, ess = 1 / (1 + chi2)."""
    counts = [5, 3, 2]  # 10 samples, frequencies exactly Q
    xs = [x for x, c in enumerate(counts) for _ in range(c)]
    t = torch.tensor([math.log(P[x]) for x in xs], dtype=torch.float64)
    b = torch.tensor([math.log(Q[x]) for x in xs], dtype=torch.float64)
    _, _, m = rollout_is_weights(t, b, None, RolloutIS(level="token", threshold_high=None))
    kl_qp = sum(q * math.log(q / p) for q, p in zip(Q, P))
    kl_pq = sum(p * math.log(p / q) for q, p in zip(Q, P))
    chi2 = sum(p * p / q for q, p in zip(Q, P)) - 1
    assert m["k3_kl"] == pytest.approx(kl_qp, abs=1e-12)
    assert m["kl"] == pytest.approx(kl_qp, abs=1e-12)
    assert abs(m["k3_kl"] - kl_pq) > 1e-2  # not the other direction
    # exp(b - t) - (b - t) - 1 (k3 with the roles swapped) estimates neither KL from behaviour samples:
    # its q-mean is chi^2(q || p) - KL(q || p)
    d = b - t
    swapped = float((torch.exp(d) - d - 1).mean())
    chi2_qp = sum(q * q / p for q, p in zip(Q, P)) - 1
    assert swapped == pytest.approx(chi2_qp - kl_qp, abs=1e-12)
    assert abs(swapped - kl_qp) > 1e-3 and abs(swapped - kl_pq) > 1e-3
    assert m["is_mean"] == pytest.approx(1.0, abs=1e-12)  # E_q[p/q] = 1
    assert m["chi2"] == pytest.approx(chi2, abs=1e-12)
    assert m["ess"] == pytest.approx(1.0 / (1.0 + chi2), abs=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# unbiasedness (exact enumeration)
# ---------------------------------------------------------------------------------------------------------------


def _expect(weights: list[float], probs: list[float], f: list[float]) -> float:
    return sum(pr * w * v for pr, w, v in zip(probs, weights, f))


def test_token_is_is_unbiased_and_truncation_biases_by_the_computed_amount():
    t = torch.tensor([math.log(p) for p in P], dtype=torch.float64)
    b = torch.tensor([math.log(q) for q in Q], dtype=torch.float64)
    w, _, _ = rollout_is_weights(t, b, None, RolloutIS(level="token", threshold_high=None))
    target = sum(p * v for p, v in zip(P, F))
    assert _expect(w.tolist(), Q, F) == pytest.approx(target, abs=1e-12)
    assert _expect(w.tolist(), Q, [1.0] * 3) == pytest.approx(1.0, abs=1e-12)

    c = 2.0  # ratio of outcome 2 is 2.5 > c
    w, _, m = rollout_is_weights(t, b, None, RolloutIS(level="token", threshold_high=c))
    rho = [p / q for p, q in zip(P, Q)]
    bias = -sum(q * max(r - c, 0.0) * v for q, r, v in zip(Q, rho, F))
    assert bias == pytest.approx(-0.2 * 0.5 * 3.0)
    assert _expect(w.tolist(), Q, F) - target == pytest.approx(bias, abs=1e-12)
    # biased low for f >= 0: E_q[min(rho, c)] = 1 - sum q (rho - c)_+ = 0.9
    assert _expect(w.tolist(), Q, [1.0] * 3) == pytest.approx(0.9, abs=1e-12)
    assert m["truncated_fraction"] == pytest.approx(1 / 3)


def test_sequence_is_is_unbiased_over_all_two_token_sequences():
    """Autoregressive toy over 3 symbols, length 2: q(y2 | y1) and p(y2 | y1) differ per prefix. Enumerating
    every sequence, sum_y q(y) w(y) f(y) = sum_y p(y) f(y) with the sequence-level weight."""
    q1, p1 = Q, P
    q2 = {0: [0.6, 0.2, 0.2], 1: [0.1, 0.8, 0.1], 2: [0.3, 0.3, 0.4]}
    p2 = {0: [0.2, 0.2, 0.6], 1: [0.4, 0.4, 0.2], 2: [0.3, 0.5, 0.2]}
    seqs = list(itertools.product(range(3), repeat=2))
    t, b, groups = [], [], []
    for i, (y1, y2) in enumerate(seqs):
        t += [math.log(p1[y1]), math.log(p2[y1][y2])]
        b += [math.log(q1[y1]), math.log(q2[y1][y2])]
        groups += [i, i]
    w, _, _ = rollout_is_weights(
        torch.tensor(t, dtype=torch.float64),
        torch.tensor(b, dtype=torch.float64),
        torch.tensor(groups),
        RolloutIS(level="sequence", threshold_high=None),
    )
    ws = w[0::2].tolist()
    f = [float(y1 * 3 + y2) ** 1.5 - 2.0 for y1, y2 in seqs]
    qy = [q1[y1] * q2[y1][y2] for y1, y2 in seqs]
    py = [p1[y1] * p2[y1][y2] for y1, y2 in seqs]
    assert sum(qy) == pytest.approx(1.0) and sum(py) == pytest.approx(1.0)
    assert _expect(ws, qy, f) == pytest.approx(sum(p * v for p, v in zip(py, f)), abs=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# decoupled / bypass losses: reference formula and gradients
# ---------------------------------------------------------------------------------------------------------------


def test_decoupled_matches_the_areal_formula():
    g = torch.Generator().manual_seed(2)
    beh = -torch.rand(200, generator=g) * 3
    prox = beh + 0.8 * torch.randn(200, generator=g)
    logp = prox + 0.4 * torch.randn(200, generator=g)
    adv = torch.randn(200, generator=g)
    eps_lo, eps_hi, cap = 0.2, 0.28, 2.0
    r = torch.exp(logp - prox)
    w_ref = torch.exp(prox - beh).clamp(max=cap)
    ref = -w_ref * torch.minimum(r * adv, r.clamp(1 - eps_lo, 1 + eps_hi) * adv)
    loss, parts = decoupled_ppo_loss(
        logp, prox, beh, adv, OffPolicyLoss(eps_lo, eps_hi, rollout_is=RolloutIS(threshold_high=cap))
    )
    assert torch.allclose(loss, ref, atol=1e-6)
    assert torch.allclose(parts["behave_weight"], w_ref)
    assert bool((parts["behave_weight"] == cap).any())  # the cap is exercised
    # mask mode (AReaL action="mask"): outside [1/cap, cap] the element contributes nothing
    loss, parts = decoupled_ppo_loss(
        logp, prox, beh, adv, OffPolicyLoss(eps_lo, eps_hi, rollout_is=RolloutIS(mode="mask", threshold_high=cap))
    )
    ratio = torch.exp(prox - beh)
    inside = (ratio >= 1 / cap) & (ratio <= cap)
    assert bool((~inside).any()) and bool(inside.any())
    assert torch.equal(loss[~inside], torch.zeros(int((~inside).sum())))
    assert torch.allclose(
        loss[inside], (-ratio * torch.minimum(r * adv, r.clamp(1 - eps_lo, 1 + eps_hi) * adv))[inside], atol=1e-6
    )
    # no behaviour weight
    loss, _ = decoupled_ppo_loss(
        logp, prox, beh, adv, OffPolicyLoss(eps_lo, eps_hi, rollout_is=RolloutIS(threshold_high=None))
    )
    assert torch.equal(loss, ppo_clip_loss(logp, prox, adv, PPOClip(eps_lo, eps_hi))[0])


# (advantage, ppo ratio r, inside the clip range?) with eps 0.2
GRAD_CASES = [
    (1.0, 1.1, True),
    (1.0, 1.5, False),
    (1.0, 0.5, True),
    (-1.0, 0.5, False),
    (-1.0, 1.5, True),
    (-1.0, 0.9, True),
    (2.0, 1.2 - 1e-3, True),
    (-0.5, 0.8 + 1e-3, True),
]


@pytest.mark.parametrize("w_prox,cap", [(1.5, 2.0), (3.0, 2.0), (0.7, 2.0)])
def test_decoupled_gradient(w_prox, cap):
    n = len(GRAD_CASES)
    adv = torch.tensor([c[0] for c in GRAD_CASES], dtype=torch.float64)
    r = torch.tensor([c[1] for c in GRAD_CASES], dtype=torch.float64)
    beh = torch.full((n,), -1.0, dtype=torch.float64)
    prox = (beh + math.log(w_prox)).requires_grad_(True)
    logp = (prox.detach() + torch.log(r)).requires_grad_(True)
    beh.requires_grad_(True)
    loss, parts = decoupled_ppo_loss(logp, prox, beh, adv, OffPolicyLoss(0.2, rollout_is=RolloutIS(threshold_high=cap)))
    loss.sum().backward()
    w = min(w_prox, cap)
    inside = torch.tensor([c[2] for c in GRAD_CASES])
    expect = torch.where(inside, -w * adv * r, torch.zeros(n, dtype=torch.float64))
    assert torch.allclose(logp.grad, expect, atol=1e-12)
    assert prox.grad is None and beh.grad is None  # weights and proximal are constants
    assert parts["clipped"].tolist() == [0.0 if c[2] else 1.0 for c in GRAD_CASES]


def test_bypass_reinforce_and_rejection():
    g = torch.Generator().manual_seed(3)
    beh = -torch.rand(50, generator=g) * 3
    logp = (beh + 0.7 * torch.randn(50, generator=g)).requires_grad_(True)
    adv = torch.randn(50, generator=g)
    loss, parts = bypass_ppo_loss(
        logp, beh, adv, OffPolicyLoss(loss_type="reinforce", rollout_is=RolloutIS(threshold_high=2.0))
    )
    w = torch.exp(logp.detach() - beh).clamp(max=2.0)
    assert torch.allclose(loss, -w * logp.detach() * adv, atol=1e-6)
    loss.sum().backward()
    assert torch.allclose(logp.grad, -w * adv, atol=1e-6)  # sg(w): no d w / d logp term
    # ppo_clip with rejection: no IS weight, but the elements outside [1/2, 2] are masked
    loss, parts = bypass_ppo_loss(
        logp.detach(), beh, adv, OffPolicyLoss(rollout_is=RolloutIS(mode="mask", threshold_high=2.0))
    )
    ratio = torch.exp(logp.detach() - beh)
    inside = (ratio >= 0.5) & (ratio <= 2.0)
    assert bool((~inside).any())
    ref = ppo_clip_loss(logp.detach(), beh, adv)[0]
    assert torch.equal(loss, torch.where(inside, ref, torch.zeros(())))
    assert torch.equal(parts["keep"], inside.float())
    # plain REINFORCE when IS is off
    loss, _ = bypass_ppo_loss(
        logp.detach(), beh, adv, OffPolicyLoss(loss_type="reinforce", rollout_is=RolloutIS(threshold_high=None))
    )
    assert torch.equal(loss, -logp.detach() * adv)


# ---------------------------------------------------------------------------------------------------------------
# the training path (SlotObjective) against the reference forms
# ---------------------------------------------------------------------------------------------------------------


def _token_slots(old: torch.Tensor, behave: torch.Tensor, adv: torch.Tensor, is_weight=None) -> MicroBatch:
    """One row whose every position is its own slot (a token-level algorithm's micro-batch)."""
    n = old.numel()
    z = torch.zeros(1, n, dtype=torch.long)
    return MicroBatch(
        tokens=z,
        labels=z,
        weight=torch.ones(1, n),
        position_ids=z,
        segment_ids=z,
        row_ids=z.clone(),
        slot=torch.arange(n).view(1, n),
        head=torch.ones(1, n),
        adv=adv.view(1, n),
        old=old.view(1, n),
        behave=behave.view(1, n),
        is_weight=None if is_weight is None else is_weight.view(1, n),
    )


def _ppo_slots(s):
    loss, clipped = ppo_clip_loss(s.logp, s.old, s.adv, PPOClip(0.2, 0.28))
    return loss, {"clipfrac": clipped}


@pytest.mark.parametrize("mode", ("truncate", "mask"))
def test_slot_objective_equals_the_reference_forms(mode):
    """offpolicy.loss_mode=decoupled / bypass as training applies them (SlotObjective, with the IS weights
    correction_weights stores and bypass_rejection's keep) == decoupled_ppo_loss / bypass_ppo_loss: loss and
    gradient."""
    g = torch.Generator().manual_seed(4)
    beh = -torch.rand(64, generator=g) * 3
    prox = beh + 0.8 * torch.randn(64, generator=g)
    logp = prox + 0.4 * torch.randn(64, generator=g)
    adv = torch.randn(64, generator=g)
    cfg = Config()
    cfg.offpolicy.rollout_is, cfg.offpolicy.rollout_is_mode, cfg.offpolicy.rollout_is_threshold = "token", mode, 2.0
    setting = RolloutIS.of(cfg.offpolicy)
    w = rollout_is_weights(prox, beh, torch.arange(64), setting)[0]
    assert bool((w == 0).any()) if mode == "mask" else bool((w == 2.0).any())  # the thresholds are exercised
    bypass = SlotObjective(_ppo_slots, loss_mode="bypass")
    bypass.reject = bypass_rejection(cfg)
    cases = [
        (SlotObjective(_ppo_slots, loss_mode="decoupled"), _token_slots(prox, beh, adv, w), decoupled_ppo_loss, prox),
        (bypass, _token_slots(prox, beh, adv), bypass_ppo_loss, None),
    ]
    for objective, mb, reference, proximal in cases:
        cur, ref_logp = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
        total, _ = objective(mb, cur.view(1, -1))
        args = (ref_logp, beh, adv) if proximal is None else (ref_logp, proximal, beh, adv)
        ref, _ = reference(*args, OffPolicyLoss(0.2, 0.28, rollout_is=setting))
        assert torch.allclose(total, ref.sum(), atol=1e-5), reference.__name__
        total.backward()
        ref.sum().backward()
        assert torch.allclose(cur.grad, ref_logp.grad, atol=1e-6), reference.__name__
