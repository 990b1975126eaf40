"""dLLM-RL's TraceRL / random-masking RL loss pieces (Gen-Verse/dLLM-RL ``train/rl_trado.py``), checked on small
hand-built inputs against values computed here with ``math`` (not megadare's code).

* the log-ratio is clamped to +-10 before the exponential in every training mode (``rl_trado.py:732``: TraceRL,
  random masking and coupled share one ``forward_process``);
* KL3 to the old policy: with l = log p_new - log p_old, ``exp(clamp(-l, +-10)) - 1 + l`` (``rl_trado.py:749-754``):
  only the exponent clamped, the estimate not capped (verl / DARE cap it at 10);
* block families' random masks: every token draws its own p ~ U(0.1, 0.9) (``rl_trado.py:457``).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from megadare.algos import REGISTRY
from megadare.algos.base import Slots
from megadare.data.rows import global_denominator, pack_rows
from megadare.diffusion import corruption as C
from megadare.models import get_family

from algo_toy import one_thread  # noqa: F401  (autouse fixture)
from algo_toy import MASK, sample, synthetic_trace


def slot_loss(algo, logp: list[float], old: list[float], adv: list[float]):
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    s = Slots(
        logp=lp,
        old=torch.tensor(old, dtype=torch.float64),
        ref=None,
        adv=torch.tensor(adv, dtype=torch.float64),
        weight=torch.ones(len(logp), dtype=torch.float64),
    )
    loss, _ = algo.slot_loss(s)
    loss.sum().backward()
    return loss.detach().tolist(), lp.grad.tolist()


def test_random_mask_rl_and_tracerl_clamp_the_log_ratio_at_10():
    """log rho = 15 with A = -1: PPO's min keeps rho A, so the token's loss is exp(clamp(15, +-10)) = e^10 and its
    gradient 0 (megadare's base clamp of 20 gave e^15); log rho = -15, A = 1: min(rho, 0.8) A = e^-10 (not e^-15).
    Inside the clamp (log rho = 9) the loss and its gradient are e^9."""
    for name in ("random_mask_rl", "tracerl"):
        algo = REGISTRY[name]({"kl_coef": 0.0})
        loss, grad = slot_loss(algo, [-1.0, -16.0], [-16.0, -1.0], [-1.0, 1.0])
        assert math.isclose(loss[0], math.exp(10.0), rel_tol=1e-12), (name, loss)
        assert math.isclose(grad[0], 0.0, abs_tol=0.0), (name, grad)  # clamped: no gradient through the clamp
        assert math.isclose(loss[1], -math.exp(-10.0), rel_tol=1e-12), (name, loss)
        loss, grad = slot_loss(algo, [-1.0], [-10.0], [-1.0])  # log rho = 9: inside the clamp
        assert math.isclose(loss[0], math.exp(9.0), rel_tol=1e-12) and math.isclose(grad[0], math.exp(9.0))


def test_tracerl_kl_is_dllm_rls_k3():
    """A = 0 leaves only beta * KL3; d = log p_old - log p_new over {-12, -1, 0.5, 3, 12}:
    k = exp(clamp(d, +-10)) - d - 1, dk/dlogp = 1 - exp(d) inside the clamp and 1 outside."""
    beta = 0.01
    ds = [-12.0, -1.0, 0.5, 3.0, 12.0]
    new = [-2.0] * len(ds)
    old = [n + d for n, d in zip(new, ds)]
    for name in ("tracerl", "random_mask_rl"):
        loss, grad = slot_loss(REGISTRY[name](), new, old, [0.0] * len(ds))
        for d, lo, gr in zip(ds, loss, grad):
            want = beta * (math.exp(max(-10.0, min(10.0, d))) - d - 1.0)
            want_g = beta * (1.0 - (math.exp(d) if abs(d) < 10 else 0.0))
            assert math.isclose(lo, want, rel_tol=1e-12), (name, d, lo, want)
            assert math.isclose(gr, want_g, rel_tol=1e-12, abs_tol=1e-15), (name, d, gr, want_g)


def test_block_random_mask_draws_a_probability_per_token():
    """dLLM-RL masks token i of a block iff rand_i <= u_i, u_i ~ U(0.1, 0.9): tokens masked independently w.p.
    1/2, so a block of 4 is fully masked w.p. 1/16 (one p per block would give E[p^4] = (0.9^5 - 0.1^5) / 4 =
    0.148) and two neighbours are masked together w.p. 1/4 (per block: E[p^2] = 0.303)."""
    P, L, B = 3, 37, 4
    seq = C.CleanSequence.of(list(range(5, 5 + P)), list(range(10, 10 + L)), 99)
    g = torch.Generator().manual_seed(0)
    masks = torch.stack([C.random_mask(seq, g, block_size=B)[0].tokens == 99 for _ in range(600)])
    assert not masks[:, :P].any()
    resp = masks[:, P:].double()
    n = 600 * L
    assert abs(resp.mean().item() - 0.5) < 4.5 * math.sqrt(0.25 / n)
    blocks = masks[:, : (P + L) // B * B].view(600, -1, B)[:, 1:]  # global-grid blocks wholly in the response
    full = blocks.all(-1).double()
    assert abs(full.mean().item() - 1 / 16) < 4.5 * math.sqrt((1 / 16) * (15 / 16) / full.numel())
    pair = (blocks[..., 0] & blocks[..., 1]).double()
    assert abs(pair.mean().item() - 0.25) < 4.5 * math.sqrt(0.25 * 0.75 / pair.numel())


# ================================================================== LLaDA / Dream: dLLM-RL's loss aggregation
def dllm_rl_forward_process(logp_new, logp_old, p_mask, adv, beta, shift, kl_per_target):
    """dLLM-RL's ``forward_process`` from the per-position log-probs on (its line 584 / 612 on), transcribed:
    ``train/rl_llada.py:584-603`` (LLaDA, ``shift=False``) and ``train/rl_dream.py:605-634`` (Dream,
    ``shift=True``: logits position j predicts label j + 1, so the targets' mask moves one left). ``logp_new`` /
    ``logp_old`` [B, T]: the log-prob of each logit position's label; ``p_mask`` [B, T] bool: the fragment's
    targets (p_mask_lm); ``adv`` [B]. ``kl_per_target``: divide the KL sum by num_mask as
    ``train/train_lladav_policy.py:408-409`` does (megadare's choice, algos/tracerl.py DllmRlLoss); False: the
    KL exactly as rl_llada.py:601-602 / rl_dream.py:630-631 (summed over the targets, not normalised)."""
    if shift:  # rl_dream.py:605-607
        logp_new, logp_old, p_mask = logp_new[:, :-1], logp_old[:, :-1], p_mask[:, 1:]
    p_mask = p_mask.to(logp_new.dtype)
    B = logp_new.shape[0]
    eps = 0.2
    ratio = torch.exp(logp_new - logp_old)
    clipped = torch.clamp(ratio, 1 - eps, 1 + eps)
    adv_tok = adv.unsqueeze(1)
    surrogate_tok = torch.min(ratio * adv_tok, clipped * adv_tok)
    surrogate_tok = surrogate_tok * p_mask
    num_mask = torch.clamp(p_mask.sum(dim=1), min=1)
    surrogate_tok = surrogate_tok.sum(dim=1) / num_mask
    policy_loss = -(surrogate_tok.sum() / B)
    kl_seq = logp_new - logp_old
    kl_seq = (-kl_seq).exp() - 1.0 + kl_seq  # use_kl_estimator_k3
    kl_seq = (kl_seq * p_mask).sum(dim=1)
    if kl_per_target:
        kl_seq = kl_seq / num_mask
    kl_loss = beta * kl_seq.sum() / B
    return policy_loss + kl_loss


def dllm_rl_step(theta, theta_old, p_mask, adv, beta, shift, kl_per_target):
    """The training loop around it (``rl_llada.py:630-654``): micro-batches of ``batch_size_lm`` fragments
    (2 in configs/rl_llada.yaml, rl_dream.yaml; 1 here when the count is odd, as a last partial micro-batch
    would weigh its fragments more), each loss / gradient_accumulation_steps; here one accumulation window
    holding every fragment, so the step's gradient is the sum of the backward passes."""
    n = theta.shape[0]
    batch_size = 2 if n % 2 == 0 else 1
    accum = n // batch_size
    total = 0.0
    for i in range(0, n, batch_size):
        sl = slice(i, i + batch_size)
        loss = dllm_rl_forward_process(theta[sl], theta_old[sl], p_mask[sl], adv[sl], beta, shift, kl_per_target)
        total = total + loss / accum
    return total


def megadare_step(algo, arch, rows, theta, theta_old):
    """megadare's trainer path on the rows: packed into several micro-batches (samples mixed), the algorithm's
    objective on each with the per-position log-probs read from the tables (row r = fragment r; position p of a
    row holds the log-prob of its label at logit position p), summed and divided by the global denominator."""
    mbs = pack_rows(rows, seq_length=max(len(r) for r in rows) + 4, micro_batch_size=1)
    assert len(mbs) >= 3
    objective = algo.objective(on_policy=False)
    total = 0.0
    for mb in mbs:
        live = mb.row_ids >= 0  # (padding: row -1, positions counted on)
        r, p = mb.row_ids.clamp(min=0), torch.where(live, mb.position_ids, 0)
        mb.old = torch.where(live, theta_old[r, p], 0.0)
        loss, _ = objective(mb, torch.where(live, theta[r, p], 0.0))
        total = total + loss
    return total / global_denominator(mbs)


# (prompt, response, advantage) of the comparison's four samples
SPECS = [
    ([5, 6], [7, 8, 9, 10, 11, 12], 1.0),
    ([5], [9, 9, 8], -0.5),
    ([6, 7, 5], [8, 10, 12, 7, 9], 0.75),
    ([7, 5], [11, 12, 8, 10, 9, 7, 8], -1.25),
]


def _dllm_rl_case(family: str, name: str, bs: int = 0):
    """Four samples of different prompt / response lengths and advantages (both signs), their fragments (TraceRL:
    replayed step groups at shrink 2 of a synthetic trace, 1-2 tokens a step; random masking: 3 masks each; block
    families (``bs`` > 0): TraceRL rounds at shrink 1, one random mask each) under the family's arch, built by
    the algorithm's ``batch_rows`` as the trainer does, and per-fragment tables of current and old log-probs
    (old = current + noise: some ratios clipped)."""
    fam = get_family(family)
    arch = replace(fam.arch(fam.tiny_config()), mask_token_id=MASK)
    if bs:
        algo = REGISTRY[name]()
    else:
        algo = REGISTRY[name]({"shrink": 2} if name == "tracerl" else {"n_views": 3})
    samples = []
    for i, (c, y, a) in enumerate(SPECS):
        commit, bstep = synthetic_trace(len(c), len(y), bs, seed=30 + i, per_step=1 + i % 2)
        samples.append(sample(c, y, adv=a, index=i, commit_step=commit, block_step=bstep))
    rows = algo.batch_rows(samples, arch, bs, lambda i: torch.Generator().manual_seed(11 + i))
    frags = []
    for s in samples:
        views = algo.views(s, arch, bs, torch.Generator().manual_seed(11 + s.index))
        frags += [(v, s.advantage) for v in views]
    assert len(rows) == len(frags)
    T = max(len(v.tokens) for v, _ in frags)
    p_mask = torch.zeros(len(frags), T, dtype=torch.bool)
    for f, (v, _) in enumerate(frags):
        p_mask[f, : len(v.slot)] = v.slot >= 0  # the fragment's targets, at their own positions
    adv = torch.tensor([a for _, a in frags], dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    theta = (-0.2 - 2.0 * torch.rand(len(frags), T, generator=g, dtype=torch.float64)).requires_grad_()
    theta_old = (theta + 0.35 * torch.randn(len(frags), T, generator=g, dtype=torch.float64)).detach()
    return algo, arch, rows, theta, theta_old, p_mask, adv


@pytest.mark.parametrize("name", ["tracerl", "random_mask_rl"])
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_llada_dream_loss_and_gradient_are_dllm_rls(family, name):
    """megadare's default TraceRL / random-masking loss on LLaDA and Dream against dLLM-RL's forward_process
    (transcribed above), fp64, the same fragments, log-probs and advantages: the policy term (beta 0) and, with
    beta 0.01, the KL normalised per target as megadare keeps it; loss and gradient to 1e-6 (fp32 weights). The KL exactly as
    rl_llada.py / rl_dream.py sum it differs (the deviation algos/tracerl.py DllmRlLoss states)."""
    algo, arch, rows, theta, theta_old, p_mask, adv = _dllm_rl_case(family, name)
    shift = family == "dream"
    assert arch.logits_shift == int(shift)
    sizes = p_mask.sum(1)
    assert len(set(sizes.tolist())) > 1 and p_mask.shape[0] > len({int(r.sample[0]) for r in rows})
    assert float((theta - theta_old).abs().max()) < 10.0  # inside megadare's log-ratio clamp (+-10)
    for beta in (0.0, 0.01):
        algo.p["kl_coef"] = beta
        got = megadare_step(algo, arch, rows, theta, theta_old)
        (g_got,) = torch.autograd.grad(got, theta)
        want = dllm_rl_step(theta, theta_old, p_mask, adv, beta, shift, kl_per_target=True)
        (g_want,) = torch.autograd.grad(want, theta)
        # megadare keeps aggregation weights (1/|f|) and old log-probs in fp32 (as the trainer does): ~1e-7
        assert float(got) == pytest.approx(float(want), rel=1e-6, abs=1e-12), (beta, float(got), float(want))
        tgt = torch.cat([p_mask[:, 1:], p_mask[:, :1] & False], 1) if shift else p_mask  # logit positions
        moved = g_want != 0  # only targets; without the KL, the clipped ones not
        assert not (moved & ~tgt).any() and moved.sum() > tgt.sum() // 2 and g_want.abs().max() > 1e-3
        assert (moved.sum() < tgt.sum()) == (beta == 0)
        assert torch.allclose(g_got, g_want, rtol=1e-6, atol=1e-10), (g_got - g_want).abs().max()
    exact_kl = dllm_rl_step(theta, theta_old, p_mask, adv, 0.01, shift, kl_per_target=False)
    assert abs(float(exact_kl) - float(want)) > 1e-6


def dllm_rl_block_forward_process(logp_new, logp_old, p_mask, adv, beta, L1):
    """dLLM-RL's block-family ``forward_process`` from the per-position log-probs on, transcribed from
    ``train/rl_trado.py:731-760``: ``L1`` is the step's padded response width (``prompting_utils.py``
    ``lm_prompt`` pads every response of the step to the longest; ``rl_trado.py:715-717``)."""
    p_mask = p_mask.to(torch.bool)
    B = logp_new.shape[0]
    eps = 0.2
    ratio = logp_new - logp_old
    ratio = torch.where(p_mask, ratio, torch.zeros_like(ratio)).clamp(-10.0, 10.0)
    ratio = torch.exp(ratio)
    clipped = torch.clamp(ratio, 1 - eps, 1 + eps)
    adv_tok = adv.unsqueeze(1)
    surrogate_tok = torch.min(ratio * adv_tok, clipped * adv_tok)
    surrogate_tok = surrogate_tok * p_mask
    surrogate_tok = surrogate_tok.sum(dim=1) / L1
    policy_loss = -(surrogate_tok.sum() / B)
    kl_seq = logp_new - logp_old
    kl_seq = torch.where(p_mask, kl_seq, torch.zeros_like(kl_seq))
    t = (-kl_seq).clamp(-10.0, 10.0)  # use_kl_estimator_k3
    kl_seq = t.exp() - 1.0 + kl_seq
    kl_seq = (kl_seq * p_mask).sum(dim=1) / L1
    kl_loss = beta * kl_seq.sum() / B
    return policy_loss + kl_loss


@pytest.mark.parametrize("name", ["tracerl", "random_mask_rl"])
def test_block_family_loss_and_gradient_are_dllm_rls(name):
    """megadare's default TraceRL / random-masking loss on a block family (SDAR, blocks of 2) against dLLM-RL's
    block ``forward_process`` (transcribed above) in its loop (``rl_trado.py:783-812``: ``batch_size_lm`` 1 in
    configs/rl_trado.yaml, each loss / gradient_accumulation_steps, here one window over every fragment), fp64,
    with L1 = the longest response of the step: loss and gradient, KL included, to 1e-6 (fp32 weights)."""
    algo, arch, rows, theta, theta_old, p_mask, adv = _dllm_rl_case("sdar", name, bs=2)
    assert arch.is_block_diffusion and float((theta - theta_old).abs().max()) < 10.0
    L1 = max(len(y) for _, y, _ in SPECS)  # the step's longest response
    assert len(set(p_mask.sum(1).tolist())) > 1 and len({len(y) for _, y, _ in SPECS}) > 1
    for beta in (0.0, 0.01):
        algo.p["kl_coef"] = beta
        got = megadare_step(algo, arch, rows, theta, theta_old)
        (g_got,) = torch.autograd.grad(got, theta)
        n = theta.shape[0]  # micro-batches of one fragment, one accumulation window of n
        one = lambda t, i: t[i : i + 1]  # noqa: E731
        want = sum(
            dllm_rl_block_forward_process(one(theta, i), one(theta_old, i), one(p_mask, i), one(adv, i), beta, L1) / n
            for i in range(n)
        )
        (g_want,) = torch.autograd.grad(want, theta)
        assert float(got) == pytest.approx(float(want), rel=1e-6, abs=1e-12), (beta, float(got), float(want))
        assert g_want.abs().max() > 1e-3 and not ((g_want != 0) & ~p_mask).any()
        assert torch.allclose(g_got, g_want, rtol=1e-6, atol=1e-10), (g_got - g_want).abs().max()
