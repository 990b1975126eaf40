"""DARE's own code, run live (``DARE_SRC``: a checkout of yjyddq/DARE, loaded by tests/dare_source.py; @83ae8a3 when
this was written), against the transcriptions in tests/test_algos_dare_formulas.py and against megadare on the
same inputs. Without ``DARE_SRC`` every test here is skipped, saying so in one line.

* the transcriptions, function by function: ``_forward_process_spg`` (exact, seeded), ``compute_policy_loss_spg``,
  ``compute_policy_loss`` / ``compute_policy_loss_bgpo`` (dual clip, token-mean), ``compute_step_wise_advantage``,
  ``compute_mdpo_policy_loss``, verl's ``compute_reinforce_plus_plus_baseline_outcome_advantage`` and
  ``kl_penalty`` (low_var_kl) as DARE ships them;
* end to end, megadare's trainer loss and gradient against DARE's live functions: the formulas tests of
  test_algos_dare_formulas.py rerun with DARE's functions swapped in for the transcribed ones (SPG, d1,
  Coupled-GRPO, BGPO, CJ-GRPO, MDPO, REINFORCE++, k3);
* what no transcription covered: the masked counts of DARE's ``_forward_process_bgpo`` / ``_forward_process_vrpo``
  (enumerated over k) and ``_forward_process_espo`` against megadare's ESPO ``stratified_counts`` (enumerated over
  k0), ``select_top_k_steps`` against megadare's MDPO ``top_steps``, megadare's ESPO / EBPO / VRPO slot losses
  against ``compute_policy_loss_espo`` + ``compute_espo_kl``, ``compute_policy_loss_ebpo`` + ``compute_ebpo_kl``
  (and ``compute_ebpo_composite_elbo``), ``compute_dpo_loss``, and MDPO's step advantages for rl.n_samples = 1, 2, 3
  (a group of one keeps its scores in DARE: megadare gave 0 until this comparison found it).

Each comparison prints its max |difference| (``pytest -s``). The actors' in-method code (``llada_dp_actor_*.py``:
the SPG per-sequence value, d-TreeRPO's update, the CJ block-parallel actor) and the MDPO rollouts need verl's
FSDP / ray stack and a model: they stay transcription-only (their tests cite the lines).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megadare.algos import REGISTRY
from megadare.algos.espo import stratified_counts
from megadare.algos.mdpo import top_steps
from megadare.algos.base import RLSample, Slots

import test_algos_dare_formulas as formulas
from algo_toy import one_thread  # noqa: F401  (autouse fixture)
from algo_toy import MASK, view_logps
from dare_source import dare_module


@pytest.fixture(scope="module")
def dllm():
    """DARE's ``verl/trainer/ppo/dllm_core_algos.py`` (which re-exports its ``core_algos``)."""
    return dare_module("verl.trainer.ppo.dllm_core_algos")


@pytest.fixture(scope="module")
def verl_core():
    """DARE's ``verl/trainer/ppo/core_algos.py`` (verl's, as DARE ships it)."""
    return dare_module("verl.trainer.ppo.core_algos")


@pytest.fixture(scope="module")
def mdpo_algos():
    return dare_module("verl.trainer.ppo.mdpo_algos")


def report(name: str, worst: float) -> None:
    print(f"\nDARE live | {name}: max |diff| {worst:.3g}")


@pytest.fixture
def recorded(monkeypatch):
    """The |got - want| of every ``assert_same_loss_and_grad`` of the formulas tests run inside the test."""
    diffs: list[float] = []
    check = formulas.assert_same_loss_and_grad

    def recording(got, want, toy):
        diffs.append(abs(float(got) - float(want)))
        check(got, want, toy)

    monkeypatch.setattr(formulas, "assert_same_loss_and_grad", recording)
    return diffs


# ================================================================== the transcriptions, function by function
SPG_CASES = [  # (prompt, response canvas, valid response tokens, block, num_t)
    (2, 8, 8, 2, 1),
    (3, 8, 8, 4, 2),
    (1, 12, 7, 4, 1),
    (2, 12, 5, 2, 3),
    (4, 16, 16, 4, 4),
    (1, 6, 1, 2, 2),
]


@pytest.mark.parametrize("use_mask_prompt", [True, False])
def test_spg_forward_process_transcription_is_dares(dllm, use_mask_prompt):
    """The transcribed ``_forward_process_spg`` gives DARE's noisy batch, mask and p_mask exactly, seed for seed,
    with padded completions (fewer valid blocks than the canvas) and several MC blocks."""
    for P, R, valid, block, num_t in SPG_CASES:
        attention = torch.cat([torch.ones(P + valid, dtype=torch.long), torch.zeros(R - valid, dtype=torch.long)])
        for seed in range(25):
            x0 = torch.randint(0, 50, (1, P + R), generator=torch.Generator().manual_seed(seed))
            kw = dict(seed=seed, block_length=block, num_t=num_t, use_mask_prompt=use_mask_prompt, MASK_TOKEN_ID=99)
            for want, got in zip(
                dllm._forward_process_spg(x0, attention, P, **kw),
                formulas.dare_forward_process_spg(x0, attention, P, **kw),
            ):
                assert torch.equal(got, want), (P, R, valid, block, num_t, seed)
    report(f"_forward_process_spg (use_mask_prompt={use_mask_prompt}), 300 draws", 0.0)


def test_spg_policy_loss_transcription_is_dares(dllm):
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(50):
        B, R = 5, 7
        value = torch.randn(1, B, generator=g, dtype=torch.float64)
        adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, R)
        mask = (torch.arange(R) < torch.randint(0, R + 1, (B, 1), generator=g)).double()
        want = dllm.compute_policy_loss_spg(value, adv, mask)[0]
        worst = max(worst, abs(float(formulas.dare_compute_policy_loss_spg(value, adv, mask) - want)))
    assert worst < 1e-12
    report("compute_policy_loss_spg", worst)


def test_ppo_losses_transcription_is_dares(dllm):
    """``dare_ppo_terms`` + token-mean == ``compute_policy_loss`` (ratio exp(l - l_old)) and
    ``compute_policy_loss_bgpo`` (ratio 1 + l - l_old for A > 0), eps 0.2, dual clip 3, ratios far off 1."""
    g = torch.Generator().manual_seed(1)
    worst = {"compute_policy_loss": 0.0, "compute_policy_loss_bgpo": 0.0}
    for _ in range(50):
        B, R = 4, 6
        old = torch.randn(B, R, generator=g, dtype=torch.float64)
        new = old + 0.9 * (2 * torch.rand(B, R, generator=g, dtype=torch.float64) - 1)
        adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, R)
        mask = (torch.rand(B, R, generator=g) < 0.7).double()
        want = dllm.compute_policy_loss(old, new, adv, mask, cliprange=0.2, clip_ratio_c=3.0)[0]
        got = formulas.dare_masked_mean(formulas.dare_ppo_terms(torch.exp(new - old), adv), mask)
        worst["compute_policy_loss"] = max(worst["compute_policy_loss"], abs(float(got - want)))
        want = dllm.compute_policy_loss_bgpo(old, new, adv, mask, cliprange=0.2, clip_ratio_c=3.0)[0]
        ratio = torch.where(adv > 0, 1 + new - old, torch.exp(new - old))
        got = formulas.dare_masked_mean(formulas.dare_ppo_terms(ratio, adv), mask)
        worst["compute_policy_loss_bgpo"] = max(worst["compute_policy_loss_bgpo"], abs(float(got - want)))
    for name, w in worst.items():
        assert w < 1e-12, name
        report(name, w)


def test_step_wise_advantage_and_mdpo_loss_transcriptions_are_dares(mdpo_algos):
    g = torch.Generator().manual_seed(2)
    worst_adv = worst_loss = 0.0
    for _ in range(30):
        rewards = torch.randint(0, 3, (8, 5), generator=g).double() / 2
        uid = [0, 0, 1, 1, 1, 2, 3, 3]  # a uid of one: mean 0, std 1 (fp32 ones in DARE: hence 1e-6 below)
        want = mdpo_algos.compute_step_wise_advantage(rewards.clone(), np.array(uid))
        worst_adv = max(worst_adv, float((formulas.dare_step_wise_advantage(rewards, uid) - want).abs().max()))
        B, R = 3, 6
        lp, olp = torch.randn(B, R, generator=g, dtype=torch.float64), torch.randn(B, R, generator=g).double()
        mask = (torch.rand(B, R, generator=g) < 0.6).double()
        conf, a = torch.rand(B, R, generator=g).double(), torch.randn(B, generator=g).double()
        want = mdpo_algos.compute_mdpo_policy_loss(lp, olp, a, mask, conf, R, epsilon=0.2)[0]
        lam = R / mask.sum(-1, keepdim=True).clamp(min=1.0)
        ratio, A = torch.exp(lp - olp), a.unsqueeze(-1)
        per_token = torch.maximum(-A * ratio * lam, -A * ratio.clamp(0.8, 1.2) * lam)  # formulas.dare_mdpo_row_loss
        got = (per_token * mask * conf).sum() / mask.sum().clamp(min=1e-4)
        worst_loss = max(worst_loss, abs(float(got - want)))
    assert worst_adv < 1e-6 and worst_loss < 1e-12
    report("compute_step_wise_advantage (groups of 1, 2, 3)", worst_adv)
    report("compute_mdpo_policy_loss (the row formula of dare_mdpo_row_loss, batched)", worst_loss)


# ================================================================== megadare end to end, DARE's functions swapped in
@pytest.mark.parametrize("n_mc", [1, 2])
def test_spg_megadare_is_dares_live_spg(dllm, monkeypatch, n_mc):
    """test_spg_dare_estimator_is_dares_spg_on_identical_draws with DARE's ``_forward_process_spg`` and
    ``compute_policy_loss_spg``: the corrupted sequences equal DARE's and the loss agrees (it asserts < 1e-5)."""
    monkeypatch.setattr(formulas, "dare_forward_process_spg", dllm._forward_process_spg)
    monkeypatch.setattr(formulas, "dare_compute_policy_loss_spg", lambda *a: dllm.compute_policy_loss_spg(*a)[0])
    wants, gots = [], []
    dare_loss, trainer_loss = formulas.dare_spg_loss, formulas._trainer_loss
    monkeypatch.setattr(formulas, "dare_spg_loss", lambda *a: wants.append(dare_loss(*a)) or wants[-1])
    monkeypatch.setattr(formulas, "_trainer_loss", lambda *a, **k: gots.append(trainer_loss(*a, **k)) or gots[-1])
    formulas.test_spg_dare_estimator_is_dares_spg_on_identical_draws(n_mc)
    assert len(wants) == len(gots) == 24
    worst = max(abs(float(got[0]) - float(want[0])) for got, want in zip(gots, wants))
    report(f"SPG megadare trainer loss vs DARE live forward process + loss (n_mc={n_mc}, 24 batches)", worst)


def live_actor_loss(dllm, name, toy, old, s, views, R):
    """``formulas.dare_actor_loss`` with DARE's ``compute_policy_loss`` / ``compute_policy_loss_bgpo`` for the PPO
    step (token-mean, eps 0.2, dual clip 3); the estimators of l are the actors' (in-method, transcribed)."""
    x0 = torch.tensor(s.prompt_ids + s.response_ids)
    masks = [v.tokens[-R:] == MASK for v in views]
    adv = torch.full((1, R), s.advantage, dtype=torch.float64)
    lp = view_logps(toy, x0, [v.tokens for v in views])[:, -R:]
    with torch.no_grad():
        olp = view_logps(old, x0, [v.tokens for v in views])[:, -R:]
    ppo = dict(cliprange=0.2, clip_ratio_c=3.0)
    if name == "d1":
        return dllm.compute_policy_loss(olp[:1], lp[:1], adv, masks[0].double().unsqueeze(0), **ppo)[0]
    if name == "coupled_grpo":
        t = s.extra["t"]

        def est(x):
            w = torch.where(masks[0], x[0], 0.0) + torch.where(masks[1], x[1] / t, 0.0)
            return ((w + torch.where(masks[2], x[2] / (1 - t), 0.0)) / 2).unsqueeze(0)

        return dllm.compute_policy_loss(est(olp), est(lp), adv, torch.ones(1, R), **ppo)[0]
    total = 0.0  # bgpo: l_j = sum log p / p_mask / R per MC draw, one compute_policy_loss_bgpo each, / mc_num
    for j, m in enumerate(masks):
        p_mask = m.sum() / R
        lj, oj = (lp[j][m] / p_mask).sum() / R, (olp[j][m] / p_mask).sum() / R
        total = total + dllm.compute_policy_loss_bgpo(oj.expand(1, R), lj.expand(1, R), adv, torch.ones(1, R), **ppo)[0]
    return total / len(masks)


@pytest.mark.parametrize("name", ["d1", "coupled_grpo", "bgpo"])
def test_ratio_algos_megadare_is_dares_live_policy_loss(dllm, monkeypatch, recorded, name):
    monkeypatch.setattr(formulas, "dare_actor_loss", lambda *a: live_actor_loss(dllm, *a))
    formulas.test_dare_preset_loss_is_dares_actor_loss_on_the_same_masks(name)
    assert len(recorded) == 3
    report(
        f"{name} megadare trainer loss vs DARE live {'compute_policy_loss_bgpo' if name == 'bgpo' else 'compute_policy_loss'}",
        max(recorded),
    )


def test_cj_grpo_megadare_is_dares_live_policy_loss(dllm, monkeypatch, recorded):
    def live_cj_loss(toy, old, s):
        P, R = len(s.prompt_ids), len(s.response_ids)
        x0, commit = torch.tensor(s.prompt_ids + s.response_ids), torch.tensor(s.commit_step)
        steps, adv = max(s.commit_step) + 1, torch.full((1, R), float(s.advantage), dtype=torch.float64)
        total = 0.0
        for t in range(steps):
            cur = torch.cat([x0[:P], torch.where(commit < t, x0[P:], torch.full((R,), MASK))])
            lp = view_logps(toy, x0, [cur])[:, -R:]
            with torch.no_grad():
                olp = view_logps(old, x0, [cur])[:, -R:]
            mask = (commit == t).double().unsqueeze(0)
            total = total + dllm.compute_policy_loss(olp, lp, adv, mask, cliprange=0.2, clip_ratio_c=3.0)[0] / steps
        return total

    monkeypatch.setattr(formulas, "dare_cj_grpo_loss", live_cj_loss)
    formulas.test_cj_grpo_preset_loss_is_dares_actor_loss_on_the_same_trace()
    report("cj_grpo megadare trainer loss vs DARE live compute_policy_loss per step", max(recorded))


def test_mdpo_megadare_is_dares_live_advantage_and_loss(mdpo_algos, monkeypatch, recorded):
    def live_row_loss(toy, old, s, t, adv):
        R = len(s.response_ids)
        commit, y = torch.tensor(s.commit_step), torch.tensor(s.response_ids)
        x_resp = torch.where(commit < t, y, torch.full((R,), MASK))
        pred = torch.tensor(s.extra["step_predictions"][t])
        target = torch.cat([torch.tensor(s.prompt_ids), torch.where(commit < t, y, pred)])
        inp = torch.cat([torch.tensor(s.prompt_ids), x_resp])
        conf = torch.tensor(s.extra["step_confidences"][t], dtype=torch.float64).unsqueeze(0)
        lp = view_logps(toy, target, [inp])[:, -R:]
        with torch.no_grad():
            olp = view_logps(old, target, [inp])[:, -R:]
        mask = (x_resp == MASK).double().unsqueeze(0)
        a = torch.tensor([adv], dtype=torch.float64)
        return mdpo_algos.compute_mdpo_policy_loss(lp, olp, a, mask, conf, R, epsilon=0.2)[0]

    monkeypatch.setattr(formulas, "dare_mdpo_row_loss", live_row_loss)
    monkeypatch.setattr(
        formulas,
        "dare_step_wise_advantage",
        lambda rewards, uid: mdpo_algos.compute_step_wise_advantage(rewards.clone(), np.array(uid)),
    )
    formulas.test_mdpo_preset_loss_is_dares_mdpo_loss_on_the_same_steps()
    report(
        "mdpo megadare trainer loss vs DARE live compute_mdpo_policy_loss + compute_step_wise_advantage", max(recorded)
    )


@pytest.mark.parametrize("G", [1, 2, 4])
def test_reinforce_pp_megadare_is_dares_live_verl(verl_core, monkeypatch, G):
    live = verl_core.compute_reinforce_plus_plus_baseline_outcome_advantage
    worst, transcribed = [0.0], formulas.verl_reinforce_pp_baseline

    def both(token_rewards, mask, index):
        want = live(token_rewards.clone(), mask, index)[0]
        worst[0] = max(worst[0], float((transcribed(token_rewards, mask, index) - want).abs().max()))
        return want

    monkeypatch.setattr(formulas, "verl_reinforce_pp_baseline", both)
    formulas.test_reinforce_pp_is_verls_reinforce_pp_baseline(G)
    assert worst[0] < 1e-6
    report(f"reinforce_pp megadare (G={G}) vs DARE live verl baseline; transcription vs live", worst[0])


def test_k3_megadare_is_dares_live_low_var_kl(verl_core, monkeypatch):
    d = torch.linspace(-30, 30, 601, dtype=torch.float64)
    logp = torch.full_like(d, -1.0)
    live = verl_core.kl_penalty  # (dllm_core_algos redefines kl_penalty for BGPO's l-space KL)
    worst = float((live(logp, logp + d, "low_var_kl") - formulas.verl_kl_penalty_forward(logp, logp + d)).abs().max())
    monkeypatch.setattr(formulas, "verl_kl_penalty_forward", lambda a, b: live(a, b, "low_var_kl"))
    formulas.test_k3_kl_is_verls_low_var_kl()
    assert worst == 0.0
    report("k3: DARE live core_algos.kl_penalty(low_var_kl) vs transcription (no clamp of d at +-20 in DARE)", worst)


# ================================================================== what no transcription covered
@pytest.fixture
def forced_randint(monkeypatch):
    """``torch.randint`` returning ``value[0]`` (shaped as asked): the draw of k / k0 set by the test."""
    value = [0]

    def fixed(*args, **kwargs):
        size = kwargs.get("size", args[-1] if args and isinstance(args[-1], tuple) else ())
        return torch.full(size, value[0], dtype=torch.long)

    monkeypatch.setattr(torch, "randint", fixed)
    return value


def test_bgpo_vrpo_counts_are_dares_live_forward_process(dllm, forced_randint):
    """The masked counts and p_mask of DARE's ``_forward_process_bgpo`` / ``_forward_process_vrpo``, for every k,
    equal the ``round(linspace)`` lines ``formulas.dare_count_distribution`` enumerates (which pin megadare's
    deviation: uniform counts)."""
    for fn in (dllm._forward_process_bgpo, dllm._forward_process_vrpo):
        for n in (1, 2, 3, 4, 8):
            for L in range(1, 25):
                P = 2
                batch, attention = torch.zeros(n, P + L, dtype=torch.long), torch.ones(P + L, dtype=torch.long)
                for k in range(1, L + 1):
                    forced_randint[0] = k
                    _, mask, p_mask = fn(batch, attention, P, MASK_TOKEN_ID=7)
                    x = torch.round(torch.linspace(float(k), k + (n - 1) * (L / n), steps=n)).long()
                    x = ((x - 1) % L) + 1
                    assert torch.equal(mask.sum(1), x) and not mask[:, :P].any(), (fn.__name__, n, L, k)
                    assert torch.equal(p_mask[:, 0], x / L)
    report("_forward_process_bgpo / _forward_process_vrpo counts vs the enumerated transcription", 0.0)


def test_espo_counts_are_dares_live_forward_process(dllm, forced_randint):
    """megadare's ESPO ``stratified_counts`` (k_i = round(k0 + i (L+1) / B) mod (L+1)) == the masked counts of
    DARE's ``_forward_process_espo`` (float32 ``linspace``, half to even) for every k0, B <= 16, L <= 40, and
    DARE's p_mask is k / (L + 1)."""
    mismatches = []
    for B in (1, 2, 3, 4, 5, 6, 8, 16):
        for L in range(1, 41):
            P = 1
            batch, attention = torch.zeros(B, P + L, dtype=torch.long), torch.ones(P + L, dtype=torch.long)
            for k0 in range(L + 1):
                forced_randint[0] = k0
                _, mask, p_mask = dllm._forward_process_espo(batch, attention, P, MASK_TOKEN_ID=7)
                want = mask.sum(1).tolist()
                got = [c[0] for c in stratified_counts([L] * B, 1, torch.Generator())]
                if got != want:
                    mismatches.append((B, L, k0, got, want))
                assert torch.allclose(p_mask[:, P], torch.tensor(want, dtype=torch.float32) / (L + 1))
    assert not mismatches, f"{len(mismatches)} (B, L, k0) differ, e.g. {mismatches[:3]}"
    report("ESPO stratified_counts vs DARE live _forward_process_espo counts (all k0, B<=16, L<=40)", 0.0)


def test_mdpo_batch_top_k_is_dares_select_top_k_steps(mdpo_algos):
    """megadare's ``top_steps(scope=batch)`` keeps the steps DARE's ``select_top_k_steps`` keeps (continuous
    advantages: no ties)."""
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        adv = torch.randn(6, 9, generator=g, dtype=torch.float64)
        for K in (1, 3, 9, 12):
            samples = [RLSample([1], [0], 0.0, 0.0, extra={"step_adv": dict(enumerate(row))}) for row in adv.tolist()]
            top_steps(samples, K, "batch")
            want = mdpo_algos.select_top_k_steps(adv, K).tolist()
            assert all(s.extra["steps"] == want for s in samples), (K, want, samples[0].extra["steps"])
    report("mdpo top_steps(batch) vs DARE live select_top_k_steps", 0.0)


def _slots(logp, old, adv, ref=None, **extra) -> Slots:
    return Slots(logp=logp, old=old, ref=ref, adv=adv, weight=torch.ones(len(logp), dtype=torch.float64), extra=extra)


def _random_sequences(g, B):
    """Sequence values l, l_old, l_ref (log-ratios up to +-1.5: both clip sides), advantages of both signs."""
    old = -3 * torch.rand(B, generator=g, dtype=torch.float64)
    new = (old + 1.5 * (2 * torch.rand(B, generator=g, dtype=torch.float64) - 1)).requires_grad_(True)
    ref = old + 0.8 * torch.randn(B, generator=g, dtype=torch.float64)
    return new, old, ref, torch.randn(B, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("eps", [0.2, 0.0])
def test_espo_slot_loss_is_dares_live_espo_loss_and_kl(dllm, eps):
    """megadare's ESPO slot loss (mean over the sequences) == ``compute_policy_loss_espo`` on the per-token ELBO
    l expanded over the canvas R + beta ``compute_espo_kl`` (k2 of R l vs R l_ref, / R), value and gradient in l."""
    g = torch.Generator().manual_seed(4)
    beta, worst = 1e-2, 0.0
    algo = REGISTRY["espo"]({"eps_low": eps, "kl_coef": beta})
    for _ in range(40):
        B, R = 6, 5
        new, old, ref, adv = _random_sequences(g, B)
        canvas = torch.full((B,), float(R), dtype=torch.float64)
        got = algo.slot_loss(_slots(new, old, adv, ref, canvas=canvas))[0].mean()
        expand = lambda v: v.unsqueeze(-1).expand(B, R)  # noqa: E731
        pg = dllm.compute_policy_loss_espo(expand(old), expand(new), expand(adv), torch.ones(B, R), cliprange=eps)[0]
        want = pg + beta * dllm.compute_espo_kl(new * R, ref * R, R, kl_estimator="k2").mean()
        worst = max(worst, abs(float(got - want)))
        (gg,), (gw,) = torch.autograd.grad(got, new), torch.autograd.grad(want, new)
        assert torch.allclose(gg, gw, rtol=1e-10, atol=1e-12)
    assert worst < 1e-12
    report(f"espo slot_loss vs DARE live compute_policy_loss_espo + compute_espo_kl (eps {eps})", worst)


def test_ebpo_slot_loss_is_dares_live_ebpo_loss_and_kl(dllm):
    """megadare's EBPO slot loss == ``compute_policy_loss_ebpo`` (log-domain clip, no dual clip, mean over the
    samples) + beta ``compute_ebpo_kl`` (k2 of the composite ELBOs) on the composite ELBOs, value and gradient."""
    g = torch.Generator().manual_seed(5)
    beta, worst = 0.05, 0.0
    algo = REGISTRY["ebpo"]({"kl_coef": beta})
    for _ in range(40):
        B = 6
        new, old, ref, adv = _random_sequences(g, B)
        got = algo.slot_loss(_slots(new, old, adv, ref))[0].mean()
        pg = dllm.compute_policy_loss_ebpo(old, new, adv, torch.ones(B, dtype=torch.bool), cliprange=0.2)[0]
        want = pg + beta * dllm.compute_ebpo_kl(new, ref, kl_estimator="k2").mean()
        worst = max(worst, abs(float(got - want)))
        (gg,), (gw,) = torch.autograd.grad(got, new), torch.autograd.grad(want, new)
        assert torch.allclose(gg, gw, rtol=1e-10, atol=1e-12)
    assert worst < 1e-12
    report("ebpo slot_loss vs DARE live compute_policy_loss_ebpo + compute_ebpo_kl", worst)


def test_ebpo_composite_elbo_is_dares_live(dllm):
    """DARE's ``compute_ebpo_composite_elbo`` (mean over the N rows of the sum over the blocks' token terms) is
    the l of megadare's EBPO docstring: (1/N) sum_n sum_b (|b| / count) sum_{masked} log p, on random terms."""
    g = torch.Generator().manual_seed(6)
    B, N, R = 3, 4, 8
    token_elbo = torch.randn(B, N, R, generator=g, dtype=torch.float64)
    mask = (torch.arange(R) < torch.tensor([[8], [5], [1]])).double()
    want = dllm.compute_ebpo_composite_elbo(token_elbo, contribution_mask=mask[:, None, :])
    got = (token_elbo * mask[:, None, :]).sum(-1).mean(-1)
    worst = float((got - want).abs().max())
    assert worst < 1e-12
    report("compute_ebpo_composite_elbo vs (1/N) sum_n sum_tokens", worst)


def test_vrpo_slot_loss_is_dares_live_dpo_loss(dllm):
    """megadare's VRPO slot loss with ``margin_norm=canvas`` == ``compute_dpo_loss`` on the ELBOs B / R expanded
    over the canvas (DARE's actor), per pair, value and gradient."""
    g = torch.Generator().manual_seed(7)
    R, worst = 6, 0.0
    algo = REGISTRY["vrpo"]({"margin_norm": "canvas", "canvas_length": R})
    for _ in range(40):
        P = 4
        B = (-8 * torch.rand(P, 2, generator=g, dtype=torch.float64)).requires_grad_(True)
        B_ref = B.detach() + torch.randn(P, 2, generator=g, dtype=torch.float64)
        sign = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(P)
        loss = algo.slot_loss(_slots(B.view(-1), B_ref.view(-1), sign, B_ref.view(-1)))[0]
        got = loss.sum() / P
        per_token = lambda v: (v / R).unsqueeze(-1).expand(P, R)  # noqa: E731
        want = dllm.compute_dpo_loss(
            per_token(B[:, 0]), per_token(B[:, 1]), per_token(B_ref[:, 0]), per_token(B_ref[:, 1]), beta=0.2
        )
        worst = max(worst, abs(float(got - want)))
        (gg,), (gw,) = torch.autograd.grad(got, B), torch.autograd.grad(want, B)
        assert torch.allclose(gg, gw, rtol=1e-10, atol=1e-12)
    assert worst < 1e-12
    report("vrpo slot_loss (margin_norm=canvas) vs DARE live compute_dpo_loss", worst)


@pytest.mark.parametrize("G", [1, 2, 3])
def test_mdpo_step_advantages_are_dares_live_for_any_group_size(mdpo_algos, G):
    """megadare's MDPO step advantages == DARE's ``compute_step_wise_advantage`` on the same step rewards, with
    rl.n_samples = G (DARE's uid grouping: a group of one keeps its score, / (1 + 1e-6))."""
    g = torch.Generator().manual_seed(8)
    algo, worst = REGISTRY["mdpo"]({"top_k_steps": 2}), 0.0
    for _ in range(20):
        groups = [i // G for i in range(3 * G)]
        rewards = torch.randint(0, 3, (len(groups), 4), generator=g).double() / 2
        samples = [formulas.mdpo_trace_sample(i, [1], [0, 2, 1, 1], i) for i in range(len(groups))]
        for s, u in zip(samples, groups):
            s.group = u
        table = iter(rewards.tolist())
        algo.prepare(samples, lambda answers, idx: next(table), group_size=G)
        got = torch.tensor([[s.extra["step_adv"][t] for t in range(4)] for s in samples], dtype=torch.float64)
        want = mdpo_algos.compute_step_wise_advantage(rewards.clone(), np.array(groups))
        worst = max(worst, float((got - want).abs().max()))
    assert worst < (1e-6 if G == 1 else 1e-12), worst  # DARE's std of a uid of one is fp32 ones: 1 + 1e-6 in fp32
    report(f"mdpo step advantages vs DARE live compute_step_wise_advantage (n_samples={G})", worst)
