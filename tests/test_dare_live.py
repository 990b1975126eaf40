"""DARE's own code, run live (``DARE_SRC``: a checkout of yjyddq/DARE, loaded by tests/dare_source.py; @83ae8a3 when
this was written), against the transcriptions in tests/ and, with DARE's functions swapped in for them, megadare end
to end. Without ``DARE_SRC`` every test here is skipped, saying so in one line. Each comparison prints its max
|difference| (``pytest -s``); tests/test_dare_live_zoo.py covers what no transcription did.

* the transcriptions, function by function: ``_forward_process_spg`` (exact, seeded), ``compute_policy_loss_spg``,
  ``compute_policy_loss`` / ``compute_policy_loss_bgpo`` (dual clip, token-mean), ``compute_step_wise_advantage``
  (groups of one included), ``compute_mdpo_policy_loss``, verl's REINFORCE++-baseline and ``kl_penalty``
  (low_var_kl) as DARE ships them, the CJ block weights and step states (``block_diffusion_utils.py``),
  ``get_num_transfer_tokens``;
* end to end, megadare's trainer loss and gradient in the formulas tests with DARE's live functions: SPG, d1,
  Coupled-GRPO, BGPO, CJ-GRPO (full attention and blocks), MDPO, REINFORCE++, k3; and megadare's MDPO rollouts
  against DARE's ``mdpo_diffusion_generate_llada`` / ``_dream`` run as written (``dare_functions``), their
  ``Categorical`` draws replaying megadare's proposals as the transcription does.

The code inside the LLaDA actors' methods (``llada_dp_actor_*.py``: the SPG per-sequence value, the d1 / Coupled /
BGPO l estimators, d-TreeRPO's update) runs live in tests/test_dare_live_actors.py (the actors instantiated on
the toy, their ``compute_log_prob`` / ``update_policy`` against megadare's gradient).
"""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import test_algos_dare_cj_blocks as cj_blocks
import test_algos_dare_formulas as formulas
import test_mdpo_rollout_dare as mdpo_rollout
from algo_toy import one_thread  # noqa: F401  (autouse fixture)
from algo_toy import MASK, sample, view_logps
from dare_source import dare_functions, dare_module, report
from dare_source import dllm, global_rng_restored, mdpo_algos, verl_core  # noqa: F401  (fixtures)


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
    report(f"_forward_process_spg (use_mask_prompt={use_mask_prompt}), 300 draws")


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
        f"{name} megadare trainer loss vs DARE live "
        f"{'compute_policy_loss_bgpo' if name == 'bgpo' else 'compute_policy_loss'}",
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


@pytest.fixture(scope="module")
def block_utils():
    return dare_module("verl.workers.actor.block_diffusion_utils")


def live_cj_token_weights(block_utils, traj: torch.Tensor, P: int) -> torch.Tensor:
    """DARE's ``compute_cj_block_step_token_weights`` for one unpadded sample, ``block_origin='global'``."""
    R = traj.shape[1] - P
    weights, _ = block_utils.compute_cj_block_step_token_weights(
        traj.unsqueeze(0),
        torch.ones(1, R, dtype=torch.bool),
        torch.ones(1, P + R, dtype=torch.bool),
        prompt_section_length=P,
        block_size=cj_blocks.B,
        block_origin="global",
    )
    return weights[0].double()


def live_step_state(block_utils, x0: torch.Tensor, traj: torch.Tensor, P: int, k: int) -> torch.Tensor:
    state, _, _ = block_utils.build_block_parallel_cj_step_inputs(
        clean_input_ids=x0.unsqueeze(0),
        attention_mask=torch.ones(1, len(x0), dtype=torch.long),
        trajectory=traj.unsqueeze(0),
        response_length=len(x0) - P,
        local_step=k,
        mask_token_id=MASK,
    )
    return state[0]


def test_cj_block_weights_and_states_transcriptions_are_dares(block_utils):
    """The transcribed CJ block weights (1 / (tokens of the transition x transitions of the sample)) and step
    states equal DARE's ``compute_cj_block_step_token_weights`` / ``build_block_parallel_cj_step_inputs`` on the
    block traces of test_algos_dare_cj_blocks.py (prompts on and off the block grid, 1 or 2 tokens a step)."""
    worst = 0.0
    for seed in range(6):
        for i, (c, y, _) in enumerate(cj_blocks.BLOCK_BATCH):
            commit, bstep = cj_blocks.block_trace(len(c), len(y), seed=10 * seed + i)
            s = sample(c, y, commit_step=commit, block_step=bstep)
            P, traj, x0 = len(c), cj_blocks.dare_trajectory(s), torch.tensor(c + y)
            want = live_cj_token_weights(block_utils, traj, P)
            worst = max(worst, float((cj_blocks.dare_cj_token_weights(traj, P) - want).abs().max()))
            for k in range(len(traj)):
                assert torch.equal(
                    cj_blocks.dare_step_state(x0, traj, P, k), live_step_state(block_utils, x0, traj, P, k)
                )
    assert worst < 1e-7  # DARE keeps the weights in fp32
    report("CJ block token weights (transcription vs live; step states exact)", worst)


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_cj_block_megadare_is_dares_live_weights_and_states(block_utils, monkeypatch, recorded, family):
    monkeypatch.setattr(cj_blocks, "dare_cj_token_weights", lambda traj, P: live_cj_token_weights(block_utils, traj, P))
    monkeypatch.setattr(cj_blocks, "dare_step_state", lambda *a: live_step_state(block_utils, *a))
    monkeypatch.setattr(cj_blocks, "assert_same_loss_and_grad", formulas.assert_same_loss_and_grad)
    cj_blocks.test_cj_grpo_block_loss_is_dares_block_parallel_actor_loss(family)
    with pytest.raises(ValueError, match="contiguous local steps"):  # DARE refuses a hole inside a block
        commit, bstep = cj_blocks.block_trace(2, 8, 0, gap=(1, 1))
        live_cj_token_weights(
            block_utils, cj_blocks.dare_trajectory(sample([2, 1], [1] * 8, commit_step=commit, block_step=bstep)), 2
        )
    report(f"cj_grpo block ({family}) megadare trainer loss vs DARE live CJ block weights + step states", max(recorded))


# ================================================================== MDPO rollouts (test_mdpo_rollout_dare.py)
def replaying(model, mask_id: int, x0_at, namespace: dict):
    """DARE's rollout calls ``model(x, attention_mask=...).logits`` and ``dists.Categorical(probs=p).sample()``:
    the model here, and a stand-in ``dists`` (set in the rollout function's globals) whose draw is ``x0_at``'s
    replay of megadare's proposals at that step (the transcription's own replay)."""
    seen: list[torch.Tensor] = []
    draws: list[int] = []  # the steps whose draw was replayed (DARE falls back to argmax if a draw raises)

    def call(x, attention_mask=None):
        seen.append(x.clone())
        return types.SimpleNamespace(logits=model(x))

    def replay(step, state, probs):
        x0 = x0_at(step, state == mask_id, probs)
        draws.append(step)
        return x0

    def categorical(probs):
        step, state = len(seen) - 1, seen[-1]
        return types.SimpleNamespace(sample=lambda: replay(step, state, probs))

    namespace["dists"] = types.SimpleNamespace(Categorical=categorical)
    return call, seen, draws


@pytest.fixture(scope="module")
def mdpo_rollouts():
    rollout = "verl/workers/rollout/"
    transfer = dare_functions(rollout + "generate.py", ("get_num_transfer_tokens",))
    scope = {"F": F, "np": np, "get_num_transfer_tokens": transfer.get_num_transfer_tokens}
    llada_scope, dream_scope = dict(scope), dict(scope)  # (the rollouts are @torch.no_grad()-wrapped)
    names = ("top_p_logits", "top_k_logits", "mdpo_diffusion_generate_llada")
    llada = dare_functions(rollout + "mdpo_llada_rollout.py", names, llada_scope).mdpo_diffusion_generate_llada
    dream = dare_functions(rollout + "mdpo_dream_rollout.py", ("mdpo_diffusion_generate_dream",), dream_scope)
    return (llada, llada_scope), (dream.mdpo_diffusion_generate_dream, dream_scope), transfer


@pytest.mark.parametrize("family", sorted(mdpo_rollout.CASES))
@pytest.mark.parametrize("greedy", [False, True])
def test_mdpo_rollout_megadare_is_dares_live_rollout(mdpo_rollouts, monkeypatch, family, greedy):
    """test_mdpo_rollout_is_dares with DARE's ``mdpo_diffusion_generate_llada`` / ``_dream`` (and
    ``get_num_transfer_tokens``) run as written for the transcribed ``dare_llada`` / ``dare_dream``: final tokens,
    every step's input state, predictions and confidences agree with megadare's trajectory; and the transcribed
    ``get_num_transfer_tokens`` is DARE's on every count and step number up to 40."""
    llada, dream, transfer = mdpo_rollouts
    for n in range(41):
        for steps in range(1, 12):
            counts = torch.tensor([[True] * n + [False] * (40 - n)])
            assert torch.equal(
                mdpo_rollout.get_num_transfer_tokens(counts, steps), transfer.get_num_transfer_tokens(counts, steps)
            )
    steps_seen = []

    def live_llada(model, prompt, mask_id, steps, gen_length, block_length, temperature, x0_at):
        call, seen, draws = replaying(model, mask_id, x0_at, llada[1])
        out = llada[0](
            call,
            prompt,
            mask_id,
            steps=steps,
            gen_length=gen_length,
            block_length=block_length,
            temperature=temperature,
            conf_alg="llada",
        )
        steps_seen.append((len(seen), draws))
        return out

    def live_dream(model, prompt, mask_id, steps, gen_length, temperature, x0_at):
        call, seen, draws = replaying(model, mask_id, x0_at, dream[1])
        out = dream[0](
            call, prompt, mask_id, steps=steps, gen_length=gen_length, temperature=temperature, conf_alg="entropy"
        )
        steps_seen.append((len(seen), draws))
        return out

    monkeypatch.setattr(mdpo_rollout, "dare_llada", live_llada)
    monkeypatch.setattr(mdpo_rollout, "dare_dream", live_dream)
    with warnings.catch_warnings():  # DARE's rollouts open a CUDA autocast, which CPU torch disables with a warning
        warnings.simplefilter("ignore", UserWarning)
        mdpo_rollout.test_mdpo_rollout_is_dares(family, greedy)
    (n_steps, draws) = steps_seen[0]
    assert n_steps > 0 and draws == ([] if greedy else list(range(n_steps)))
    report(f"mdpo rollout ({family}, greedy={greedy}) vs DARE live: tokens, states, predictions (confidences to 1e-5)")
