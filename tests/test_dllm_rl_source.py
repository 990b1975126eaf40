"""megadare's TraceRL / random-masking RL / value model / KL against dLLM-RL's own code (Gen-Verse/dLLM-RL
@10b4fd1) on the same inputs (advantages, rewards, prompt, config keys: tests/test_dllm_rl_rewards.py).

Every expected value below was produced by dLLM-RL's functions themselves (loaded from a checkout by
tests/dllm_rl_source.py, nothing copied) on the inputs built here: ``train/rl_trado.py`` (step-map padding,
``collect_training_data``, ``compute_logp_old_tok_parallel``, ``forward_process`` in its loop), ``train/rl_llada.py``
and ``rl_dream.py`` (``prepare_inputs_and_labels_for_text``, their ``forward_process``) and
``train/train_trado_value.py`` (``collect_training_data``, ``compute_returns_and_advantages_from_fragments``, the
value ``forward_process``). The model is a stand-in scoring logits E[token] + W[position]
(``dllm_rl_source.PositionModel``), the same parameters for both sides; losses and gradients in float64 (dLLM-RL
keeps old log-probs in float32, megadare its aggregation weights: agreement to ~1e-7 relative). Its logits see
only the token and the position, so the loss tests check targets, ratios, clip, KL and normalisation; which input
positions are masked is compared as the fragments themselves (TraceRL) and as the masks' law (random masking).

Setting ``DLLM_RL_SRC`` to a dLLM-RL checkout also runs dLLM-RL's code on these inputs (the ``test_live_*`` tests)
and checks it gives the recorded values and what megadare gives (fragments included); without it they are
skipped, saying so.

Findings (the tests name them): block-family TraceRL and random-masking loss and gradient equal (shrink 1 and 2,
coupled or not), KL included; LLaDA / Dream policy term equal, the KL term not (rl_llada.py / rl_dream.py sum it
per fragment, megadare divides by the targets: algos/tracerl.py DllmRlLoss says why); value model GAE, returns
and value loss equal; k3_exp10 equal on |d| up to 15; random masks: the same law (statistics; the streams differ).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

import dllm_rl_source as D
from megadare.algos import REGISTRY
from megadare.algos.base import ANSWER_LENGTH, RLSample
from megadare.algos.policy_loss import kl_penalty
from megadare.algos.value_model import step_advantages, value_loss
from megadare.diffusion import corruption as C
from megadare.diffusion.trace_replay import shrunk_steps

from algo_toy import one_thread  # noqa: F401  (autouse fixture)
from test_algos_dllm_rl import megadare_step
from test_tracerl_fragments import EOS, MASK, PAD, fragments_of, tiny_arch, trace

P, BS, V = 8, 4, 100
ADVS = [1.0, -0.5, 0.75]


# ------------------------------------------------------------------ inputs
def block_samples() -> list[RLSample]:
    """Three TraDo/SDAR responses ending at their EOS (``rl.canvas=eos``), 6-13 tokens, a dynamic-threshold trace
    on the grid of blocks of 4 from position 0 (the prompt fills two blocks: dLLM-RL's blocks are the sampler's)."""
    out = []
    for i, L in enumerate([9, 13, 6]):
        g = torch.Generator().manual_seed(i)
        y = torch.randint(0, 50, (L - 1,), generator=g).tolist() + [EOS]
        s = RLSample(prompt_ids=list(range(10, 10 + P)), response_ids=y, reward=0.0, advantage=ADVS[i], index=i)
        s.commit_step, s.block_step = trace(P, L, BS, seed=i)
        out.append(s)
    return out


def llada_samples() -> list[RLSample]:
    """Three LLaDA full canvases of 16 (answer, EOS, then pads: ``rl.canvas=full``), answers of 5-16 tokens."""
    out = []
    for i, a in enumerate([9, 16, 5]):
        g = torch.Generator().manual_seed(i)
        y = torch.randint(0, 50, (a - 1,), generator=g).tolist() + [EOS] + [PAD] * (16 - a)
        s = RLSample(prompt_ids=list(range(10, 16)), response_ids=y, reward=0.0, advantage=ADVS[i], index=i)
        s.commit_step, s.block_step = trace(6, 16, 8, seed=i)
        s.extra[ANSWER_LENGTH] = a
        out.append(s)
    return out


def models():
    """(new, old) stand-in models and the probes of the gradient's fingerprint."""
    g = torch.Generator().manual_seed(7)
    E = torch.randn(V, V, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(64, V, generator=g, dtype=torch.float64, requires_grad=True)
    Eo = (E + 0.3 * torch.randn(V, V, generator=g, dtype=torch.float64)).detach()
    Wo = (W + 0.3 * torch.randn(64, V, generator=g, dtype=torch.float64)).detach()
    probes = (torch.randn(V, V, generator=g, dtype=torch.float64), torch.randn(64, V, generator=g, dtype=torch.float64))
    return D.PositionModel(E, W), D.PositionModel(Eo, Wo), probes


def fingerprint(loss: torch.Tensor, new: D.PositionModel, probes) -> tuple[float, float]:
    """(loss, <gradient, probes>): one number that moves with every gradient entry."""
    gE, gW = torch.autograd.grad(loss, [new.E, new.W])
    return float(loss), float((gE * probes[0]).sum() + (gW * probes[1]).sum())


def megadare_loss(family: str, samples, shrink: int, beta: float, bs: int) -> tuple[float, float]:
    """megadare's TraceRL step (rows of ``batch_rows``, packed, the objective, the global denominator) with the
    per-position log-probs of every view under the stand-in models."""
    arch = tiny_arch(family, bs)
    algo = REGISTRY["tracerl"]({"shrink": shrink, "kl_coef": beta})
    rows = algo.batch_rows(samples, arch, bs, lambda i: torch.Generator().manual_seed(i))
    pairs = [(s, v) for s in samples for v in algo.views(s, arch, bs, None)]
    T = max(len(v.tokens) for _, v in pairs)
    new, old, probes = models()

    def table(m):
        out = []
        for s, v in pairs:
            x0 = torch.tensor(s.prompt_ids + s.response_ids)
            x0 = torch.cat([x0[arch.logits_shift :], x0[: arch.logits_shift]])  # Dream: logit p predicts p + 1
            logits = m(v.tokens[None], position_ids=torch.arange(len(v.tokens))[None]).logits[0]
            out.append(F.pad(F.log_softmax(logits, -1).gather(-1, x0[:, None])[:, 0], (0, T - len(x0))))
        return torch.stack(out)

    theta_old = table(old).float().double().detach()  # old log-probs kept in float32, as both trainers do
    return fingerprint(megadare_step(algo, arch, rows, table(new), theta_old), new, probes)


def dllm_rl_trado(samples, shrink: int, beta: float) -> tuple[dict, tuple[float, float]]:
    """dLLM-RL's block-family TraceRL on ``samples``: its fragments per sample and (loss, fingerprint)."""
    ids, start = D.lm_prompt([s.prompt_ids for s in samples], [s.response_ids for s in samples], PAD)
    cfg = dict(block_size=BS, method="TraceRL", shrink=shrink, beta=beta, post_num=0)
    g = D.trado_training(cfg, ids, start, [list(s.commit_step) for s in samples], ADVS, MASK, PAD)
    r, frags = g["rows"], {}
    for i in range(r.ext.shape[0]):
        k = ADVS.index(r.rewards[i])
        n = len(samples[k].response_ids)  # its pad positions (masked in its inputs) are not megadare's canvas
        masked = {j for j, t in enumerate(r.ext[i, start + r.L1 :].tolist()) if t == MASK and j < n}
        frags.setdefault(k, []).append((masked, {j for j, x in enumerate(r.p_mask[i, start:].tolist()) if x}))
    new, old, probes = models()
    return frags, fingerprint(D.trado_loss(g, new, old), new, probes)


def dllm_rl_llada(samples, shrink: int, beta: float, script: str = "llada") -> tuple[dict, tuple[float, float]]:
    """rl_llada.py's (rl_dream.py's) TraceRL (``batch_size_lm`` 1: one fragment a micro-batch) on ``samples``."""
    cfg = dict(method="TraceRL", shrink=shrink, beta=beta, post_num=0, batch_size_lm=1)
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    g = D.llada_training(cfg, prompts, responses, [list(s.commit_step) for s in samples], ADVS, MASK, PAD, script)
    r, frags = g["rows"], {}
    for i in range(r.noisy.shape[0]):
        masked = {j for j, t in enumerate(r.noisy[i, r.start :].tolist()) if t == MASK}
        targets = {j for j, x in enumerate(r.p_mask[i, r.start :].tolist()) if x}
        frags.setdefault(ADVS.index(r.rewards[i]), []).append((masked, targets))
    new, old, probes = models()
    return frags, fingerprint(D.llada_loss(g, new, old), new, probes)


def megadare_fragments(family: str, samples, shrink: int, bs: int) -> dict:
    arch, algo = tiny_arch(family, bs), REGISTRY["tracerl"]({"shrink": shrink})
    return {s.index: fragments_of(algo.views(s, arch, bs, None), len(s.prompt_ids)) for s in samples}


def close(got: tuple[float, float], want: tuple[float, float]) -> bool:
    return all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12) for a, b in zip(got, want))


# ------------------------------------------------------------------ TraceRL's loss
# (shrink, beta) -> (loss, gradient fingerprint) of dLLM-RL's rl_trado.py on block_samples()
TRADO = {
    (1, 0.0): (-0.05876714702440795, 0.035800255013675134),
    (1, 0.01): (-0.058580320574702825, 0.035310500795179695),
    (2, 0.0): (-0.08815072053661195, 0.053700382520512686),
    (2, 0.01): (-0.08787048086205423, 0.052965751192769556),
}
# (script, shrink, beta) -> the same of rl_llada.py / rl_dream.py on llada_samples()
FULL = {
    ("llada", 1, 0.0): (-0.21263429689352967, 0.0355941258761411),
    ("llada", 1, 0.01): (-0.21168590218926003, 0.03605335700419032),
    ("llada", 3, 0.0): (-0.24016935529090938, 0.09051891222728795),
    ("llada", 3, 0.01): (-0.2377456799355537, 0.09169250288785816),
    ("dream", 1, 0.0): (-0.22744507641231523, 0.052283963173060416),
    ("dream", 1, 0.01): (-0.2265317722549994, 0.05224091046130133),
    ("dream", 3, 0.0): (-0.2940580671033764, 0.05987110545320984),
    ("dream", 3, 0.01): (-0.291962544646393, 0.05802359421218775),
}


@pytest.mark.parametrize("shrink,beta", list(TRADO))
def test_block_tracerl_loss_and_gradient_are_dllm_rls(shrink, beta):
    """SDAR / TraDo TraceRL: megadare's step on its rows = dLLM-RL's rl_trado.py loop (rows, old log-probs, PPO clip
    with the +-10 log-ratio clamp, k3_exp10, each fragment / L1, mean over fragments), loss and gradient."""
    assert close(megadare_loss("sdar", block_samples(), shrink, beta, BS), TRADO[shrink, beta])


@pytest.mark.parametrize("script,shrink,beta", list(FULL))
def test_full_attention_tracerl_policy_term_is_dllm_rls_and_kl_is_normalised(script, shrink, beta):
    """LLaDA / Dream TraceRL (Dream: logit p predicts token p + 1): the policy term equals rl_llada.py's /
    rl_dream.py's; with beta > 0 it differs by their KL sum per fragment (megadare divides it by the fragment's
    targets as rl_trado.py and train_lladav_policy.py do: algos/tracerl.py DllmRlLoss says why)."""
    got = megadare_loss(script, llada_samples(), shrink, beta, 0)
    assert close(got, FULL[script, shrink, beta]) == (beta == 0), (got, FULL[script, shrink, beta])


@pytest.mark.parametrize("shrink,beta", list(TRADO))
def test_live_block_tracerl_is_dllm_rls(shrink, beta):
    samples = block_samples()
    frags, theirs = dllm_rl_trado(samples, shrink, beta)
    assert frags == megadare_fragments("sdar", samples, shrink, BS)
    assert close(theirs, TRADO[shrink, beta]), theirs
    assert close(megadare_loss("sdar", samples, shrink, beta, BS), theirs)


@pytest.mark.parametrize("script,shrink,beta", list(FULL))
def test_live_full_attention_tracerl_is_dllm_rls(script, shrink, beta):
    samples = llada_samples()
    frags, theirs = dllm_rl_llada(samples, shrink, beta, script)
    assert frags == megadare_fragments(script, samples, shrink, 0)
    assert close(theirs, FULL[script, shrink, beta]), theirs
    assert close(megadare_loss(script, samples, shrink, beta, 0), theirs) == (beta == 0)


# ------------------------------------------------------------------ value model
REWARDS = [1.0, 0.0, -1.0]


def old_value(b: int, k: int) -> float:
    """V_old of response token k of sample b (float32, as dLLM-RL's dataset holds it)."""
    return float(torch.tensor(random.Random(100 * b + k).uniform(-1, 1), dtype=torch.float32))


def megadare_returns(shrink: int, gam: float, lam: float) -> list[list[tuple[float, float]]]:
    """Per sample and response token: (A_j, R_j) of megadare's step-level GAE over the shrunk trace."""
    out = []
    for s in block_samples():
        vals = [old_value(s.index, k) for k in range(len(s.response_ids))]
        adv, ret = step_advantages(vals, shrunk_steps(s, BS, shrink, True), REWARDS[s.index], gam, lam)
        out.append(list(zip(adv, ret)))
    return out


def dllm_rl_returns(shrink: int, gam: float, lam: float) -> list[list[tuple[float, float]]]:
    samples = block_samples()
    ids, start = D.lm_prompt([s.prompt_ids for s in samples], [s.response_ids for s in samples], PAD)
    cfg = dict(block_size=BS, shrink=shrink, post_num=0, gam=gam, lam=lam)
    out = D.trado_value_returns(cfg, ids, start, [list(s.commit_step) for s in samples], REWARDS, old_value, MASK, PAD)
    for s, row in zip(samples, out):  # the pads after the EOS are not trainable (post_num 0)
        assert all(x is None for x in row[len(s.response_ids) :]) and None not in row[: len(s.response_ids)]
    return [row[: len(s.response_ids)] for s, row in zip(samples, out)]


# (shrink, gamma, lambda) -> train_trado_value.py's (A_j, R_j) per sample and response token
VALUE_RETURNS = {
    (1, 1.0, 1.0): [
        [
            (0.3111563, 1.0),
            (1.7312715, 1.0),
            (0.0879315, 1.0),
            (1.5240707, 1.0),
            (1.5279038, 1.0),
            (0.7541966, 1.0),
            (0.4133199, 1.0),
            (1.3523345, 1.0),
            (1.5465883, 1.0),
        ],
        [
            (0.7086615, 0.0),
            (-0.1623043, 0.0),
            (0.7036576, 0.0),
            (-0.9581003, 0.0),
            (-0.9199219, 0.0),
            (-0.7561987, 0.0),
            (-0.4213675, 0.0),
            (0.5070361, 0.0),
            (0.7389596, 0.0),
            (0.4408339, 0.0),
            (-0.8685239, 0.0),
            (-0.6543411, 0.0),
            (0.0375067, 0.0),
        ],
        [
            (-0.0912186, -1.0),
            (-0.1342045, -1.0),
            (-1.5277631, -1.0),
            (-0.1815163, -1.0),
            (-0.793813, -1.0),
            (-0.8688336, -1.0),
        ],
    ],
    (2, 0.9, 0.8): [
        [
            (-0.3939867, 0.7289999),
            (1.0261285, 0.7289999),
            (-0.6172115, 0.7289999),
            (0.8189278, 0.7289999),
            (0.9120458, 0.8099999),
            (0.1383387, 0.8099999),
            (-0.2025381, 0.8099999),
            (0.9739486, 0.9),
            (1.5465883, 1.0),
        ],
        [
            (0.8403646, 0.0),
            (-0.0199592, 0.0),
            (0.8353607, 0.0),
            (-0.8263971, 0.0),
            (-0.8898816, 0.0),
            (-0.7456213, 0.0),
            (-0.3913271, 0.0),
            (0.5176135, 0.0),
            (0.7322083, 0.0),
            (0.4340827, 0.0),
            (-0.8752751, 0.0),
            (-0.6610923, 0.0),
            (0.0375067, 0.0),
        ],
        [
            (0.1584196, -0.9),
            (0.1619544, -0.8099999),
            (-1.2316043, -0.8099999),
            (0.1146426, -0.8099999),
            (-0.793813, -1.0),
            (-0.8688336, -1.0),
        ],
    ],
    (3, 1.0, 0.0): [
        [
            (-0.7007824, 1.0),
            (0.7193328, 1.0),
            (-0.9240072, 1.0),
            (0.512132, 1.0),
            (-0.0186845, 1.0),
            (-0.7923917, 1.0),
            (-1.1332685, 1.0),
            (-0.1942538, 1.0),
            (1.5465883, 1.0),
        ],
        [
            (1.1062745, 0.0),
            (0.2353087, 0.0),
            (1.1012706, 0.0),
            (-0.5604873, 0.0),
            (-0.834154, 0.0),
            (-0.6704308, 0.0),
            (-0.3355996, 0.0),
            (0.592804, 0.0),
            (0.7014528, 0.0),
            (0.4033272, 0.0),
            (-0.9060307, 0.0),
            (-0.6918479, 0.0),
            (0.0375067, 0.0),
        ],
        [
            (0.7401047, -1.0),
            (0.6971188, -1.0),
            (-0.6964399, -1.0),
            (0.649807, -1.0),
            (-0.793813, -1.0),
            (-0.8688336, -1.0),
        ],
    ],
}


def same_returns(got, want) -> bool:
    return all(
        math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
        for g_s, w_s in zip(got, want, strict=True)
        for g_t, w_t in zip(g_s, w_s, strict=True)
        for a, b in zip(g_t, w_t)
    )


@pytest.mark.parametrize("key", list(VALUE_RETURNS))
def test_value_model_returns_and_advantages_are_dllm_rls(key):
    """The value model's token A_j, R_j (reward on the last trainable step, per-step means over the shrunk trace,
    R*, delta*, A* backwards) = train_trado_value.py's ``compute_returns_and_advantages_from_fragments``."""
    assert same_returns(megadare_returns(*key), VALUE_RETURNS[key])


@pytest.mark.parametrize("key", list(VALUE_RETURNS))
def test_live_value_model_returns_are_dllm_rls(key):
    theirs = dllm_rl_returns(*key)
    assert same_returns(theirs, VALUE_RETURNS[key]) and same_returns(megadare_returns(*key), theirs)


def value_case():
    g = torch.Generator().manual_seed(0)
    L0, L1 = 3, 5
    v = torch.randn(2, L0 + 2 * L1, generator=g, dtype=torch.float64)
    v_old = torch.randn(2, L0 + L1, generator=g, dtype=torch.float64)
    ret = torch.randn(2, L0 + L1, generator=g, dtype=torch.float64)
    p_mask = torch.rand(2, L0 + L1, generator=g) < 0.6
    p_mask[:, :L0] = False
    return v, v_old, ret, p_mask, L1


VALUE_LOSS = 1.6606790815414927  # train_trado_value.py's forward_process on value_case()


def megadare_value_loss() -> float:
    """megadare's clipped value loss on the scored positions, each row's sum / L1, mean over rows (its head
    weights on block families)."""
    v, v_old, ret, p_mask, L1 = value_case()
    L0 = p_mask.shape[1] - L1
    values = torch.cat([v[:, :L0], v[:, L0 + L1 :]], 1)  # the noisy copy's values at the response
    return float((value_loss(values, v_old, ret, 0.2) * p_mask).sum(1).div(L1).mean())


def test_value_loss_is_dllm_rls():
    assert math.isclose(megadare_value_loss(), VALUE_LOSS, rel_tol=1e-12)


def test_live_value_loss_is_dllm_rls():
    theirs = float(D.trado_value_loss(*value_case()))
    assert theirs == pytest.approx(VALUE_LOSS, rel=1e-12) and megadare_value_loss() == pytest.approx(theirs, rel=1e-12)


# ------------------------------------------------------------------ KL estimator
KL_D = [-15.0, -12.0, -10.0, -3.0, -0.5, 0.0, 0.5, 3.0, 9.5, 10.0, 12.0, 15.0]  # d = log p_old - log p_new
KL = [
    14.000045399929762,
    11.000045399929762,
    9.000045399929762,
    2.049787068367864,
    0.10653065971263342,
    0.0,
    0.1487212707001282,
    16.085536923187668,
    13349.226829661873,
    22015.465794806718,
    22013.465794806718,
    22010.465794806718,
]  # rl_trado.py's forward_process, advantage 0, beta 1: its k3 per d


def test_k3_exp10_is_dllm_rls():
    """``kl_estimator=k3_exp10`` = dLLM-RL's KL term: exp(clamp(d, +-10)) - d - 1, the estimate not capped (verl's
    k3 caps it at 10: it differs where the estimate exceeds 10, d > 2.6 or d < -11)."""
    d = torch.tensor(KL_D, dtype=torch.float64)
    ours = kl_penalty(-0.5 * torch.ones_like(d), -0.5 + d, "k3_exp10")
    assert ours.tolist() == pytest.approx(KL, rel=1e-12, abs=1e-15)
    verl = kl_penalty(-0.5 * torch.ones_like(d), -0.5 + d, "k3")
    assert [abs(a - b) > 1e-9 for a, b in zip(verl.tolist(), KL)] == [k > 10 for k in KL]


def test_live_k3_exp10_is_dllm_rls():
    theirs = D.trado_kl(torch.tensor(KL_D, dtype=torch.float64), 1.0)
    assert theirs.tolist() == pytest.approx(KL, rel=1e-12, abs=1e-15)


# ------------------------------------------------------------------ random masking: the mask distributions
RM_PROMPT, RM_RESPONSE, RM_N = list(range(10, 14)), list(range(20, 31)) + [EOS], 800


def mask_stats(masks: torch.Tensor) -> dict[str, tuple[float, float, int]]:
    """Per-fragment statistics of response masks [n, L] (fragments without a target dropped, as both trainers
    count them for nothing): (mean, std, n) of the masked fraction, of the fraction of adjacent masked pairs and
    of the fraction of fully masked blocks of 4."""
    m = masks[masks.any(1)].double()
    L = m.shape[1]
    per = {
        "rate": m.mean(1),
        "pair": (m[:, 1:] * m[:, :-1]).mean(1),
        "full_block": m[:, : L // 4 * 4].view(m.shape[0], -1, 4).prod(-1).mean(1),
    }
    return {k: (float(x.mean()), float(x.std()), x.numel()) for k, x in per.items()}


def same_distribution(a: dict, b: dict) -> bool:
    """Every statistic's means within 4.5 standard errors."""
    return all(abs(a[k][0] - b[k][0]) < 4.5 * math.sqrt(a[k][1] ** 2 / a[k][2] + b[k][1] ** 2 / b[k][2]) for k in a)


def megadare_masks(block: bool, couple: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    seq = C.CleanSequence.of(RM_PROMPT, RM_RESPONSE, MASK)
    n = RM_N // (2 if couple else 1)
    views = [v for _ in range(n) for v in C.random_mask(seq, g, 4 if block else 0, (0.1, 0.9), 1, couple)]
    return torch.stack([v.tokens[len(RM_PROMPT) :] == MASK for v in views])


def dllm_rl_masks(mode: str) -> torch.Tensor:
    """dLLM-RL's random-masking rows of 8 copies of one response: ``trado`` (rl_trado.py, per-token probability),
    ``llada`` / ``llada_coupled`` (rl_llada.py, one t per fragment; coupled adds the complement)."""
    torch.manual_seed(0)
    prompts, responses, out = [RM_PROMPT] * 8, [RM_RESPONSE] * 8, []
    steps = [list(range(len(RM_RESPONSE)))] * 8
    while sum(x.shape[0] for x in out) < RM_N:
        if mode == "trado":
            ids, start = D.lm_prompt(prompts, responses, PAD)
            cfg = dict(block_size=4, method="random_masking", shrink=1, beta=0.0, post_num=0)
            out.append(D.trado_training(cfg, ids, start, steps, [1.0] * 8, MASK, PAD)["rows"].p_mask[:, start:])
        else:
            method = "coupled" if mode == "llada_coupled" else "random_masking"
            cfg = dict(method=method, shrink=1, beta=0.0, post_num=0, batch_size_lm=1, mask_times_per_sample=4)
            r = D.llada_training(cfg, prompts, responses, steps, [1.0] * 8, MASK, PAD)["rows"]
            out.append(r.p_mask[:, r.start :])
    return torch.cat(out)


# mode -> mask_stats of dLLM-RL's rows (dllm_rl_masks, torch.manual_seed(0))
RM_STATS = {
    "trado": {
        "rate": (0.5040272614622057, 0.1437128790023843, 807),
        "pair": (0.2472682212459164, 0.16467539882450394, 807),
        "full_block": (0.05493597686906237, 0.13131251132802144, 807),
    },
    "llada": {
        "rate": (0.5119341563786007, 0.25914445368820893, 810),
        "pair": (0.3150392817059483, 0.2845425823764869, 810),
        "full_block": (0.16049382716049382, 0.26985685040755036, 810),
    },
    "llada_coupled": {
        "rate": (0.5187032418952618, 0.2612697906413093, 802),
        "pair": (0.3240761732033552, 0.2890390829466812, 802),
        "full_block": (0.1654197838736492, 0.2733070382221226, 802),
    },
}
RM_MODES = {"trado": (True, False), "llada": (False, False), "llada_coupled": (False, True)}


@pytest.mark.parametrize("mode", list(RM_MODES))
def test_random_masks_are_distributed_as_dllm_rls(mode):
    """Block families: every token masked w.p. U(0.1, 0.9) of its own (rate 1/2, pairs 1/4, full blocks 1/16);
    LLaDA: one t ~ U(0.1, 0.9) per fragment (pairs E[t^2] = 0.303); coupled: the complement too."""
    assert same_distribution(mask_stats(megadare_masks(*RM_MODES[mode])), RM_STATS[mode])
    other = "llada" if mode == "trado" else "trado"  # the statistics tell the two laws apart
    assert not same_distribution(mask_stats(megadare_masks(*RM_MODES[mode])), RM_STATS[other])


@pytest.mark.parametrize("mode", list(RM_MODES))
def test_live_random_masks_are_distributed_as_dllm_rls(mode):
    theirs = mask_stats(dllm_rl_masks(mode))
    assert same_distribution(theirs, RM_STATS[mode])  # (exact on the torch that recorded them: its CPU stream)
    assert same_distribution(mask_stats(megadare_masks(*RM_MODES[mode])), theirs)


# ------------------------------------------------------------------ random masking: the loss on given masks
def megadare_rm_loss(family: str, couple: bool, beta: float):
    """megadare's random-masking RL step on block_samples() (SDAR) / llada_samples() (LLaDA, answers as the whole
    canvas: no post_num cut) and its fragments (prompt, response, targets, advantage)."""
    bs = BS if family == "sdar" else 0
    samples = block_samples() if bs else llada_samples()
    for s in samples:
        s.extra.pop(ANSWER_LENGTH, None)
    arch = tiny_arch(family, bs)
    algo = REGISTRY["random_mask_rl"]({"kl_coef": beta, "couple": couple, "n_views": None if bs else 3})
    gen = lambda i: torch.Generator().manual_seed(50 + i)  # noqa: E731
    rows = algo.batch_rows(samples, arch, bs, gen)
    pairs = [(s, v) for s in samples for v in algo.views(s, arch, bs, gen(s.index)) if bool((v.coef != 0).any())]
    T = max(len(v.tokens) for _, v in pairs)
    new, old, probes = models()

    def table(m):
        out = []
        for s, v in pairs:
            x0 = torch.tensor(s.prompt_ids + s.response_ids)
            logits = m(v.tokens[None], position_ids=torch.arange(len(v.tokens))[None]).logits[0]
            out.append(F.pad(F.log_softmax(logits, -1).gather(-1, x0[:, None])[:, 0], (0, T - len(x0))))
        return torch.stack(out)

    loss = megadare_step(algo, arch, rows, table(new), table(old).float().double().detach())
    P = [len(s.prompt_ids) for s, _ in pairs]
    frags = [
        (s.prompt_ids, s.response_ids, {k - p for k in (v.slot >= 0).nonzero().flatten().tolist()}, s.advantage)
        for p, (s, v) in zip(P, pairs)
    ]
    return fingerprint(loss, new, probes), frags


def dllm_rl_rm_loss(family: str, frags, beta: float) -> tuple[float, float]:
    """dLLM-RL's loss loop (rl_trado.py / rl_llada.py ``forward_process``) on megadare's fragments."""
    cs, ys = [c for c, *_ in frags], [y for _, y, *_ in frags]
    steps = [list(range(len(y))) for y in ys]
    if family == "sdar":
        ids, start = D.lm_prompt(cs, ys, PAD)
        cfg = dict(block_size=BS, method="TraceRL", shrink=1, beta=beta, post_num=0)
        g = D.trado_training(cfg, ids, start, steps, [a for *_, a in frags], MASK, PAD)
        D.trado_rows_of(g, frags)
        loss = D.trado_loss
    else:
        cfg = dict(method="random_masking", shrink=1, beta=beta, post_num=None, batch_size_lm=1)
        g = D.llada_training(dict(cfg, mask_times_per_sample=1), cs, ys, steps, [a for *_, a in frags], MASK, PAD)
        D.llada_rows_of(g, frags)
        loss = D.llada_loss
    new, old, probes = models()
    return fingerprint(loss(g, new, old), new, probes)


# (family, couple, beta) -> dLLM-RL's loss loop on megadare's random masks of that case
RM_LOSS = {
    ("sdar", False, 0.0): (-0.1804744282481734, 0.07946753323338257),
    ("sdar", False, 0.01): (-0.18015970040871643, 0.0792262758497079),
    ("sdar", True, 0.0): (-0.08815072053661194, 0.053700382520512686),
    ("sdar", True, 0.01): (-0.08787048086205425, 0.052965751192769556),
    ("llada", False, 0.0): (-0.43823770372434656, 0.017670068080220938),
    ("llada", False, 0.01): (-0.42785674764092013, 0.013326609904283485),
    ("llada", True, 0.0): (-0.43723966100322953, 0.013986064655168728),
    ("llada", True, 0.01): (-0.4285754113750285, 0.01471236156554576),
}


@pytest.mark.parametrize("family,couple,beta", list(RM_LOSS))
def test_random_masking_loss_normalisation_is_dllm_rls(family, couple, beta):
    """Each mask a fragment: SDAR its sum / L1, LLaDA its mean over its targets, mean over fragments (coupled: the
    complements count as fragments): equal; LLaDA's KL differs as TraceRL's (summed per fragment there).
    The stand-in model's logits see only the token and position: this checks the targets and the aggregation,
    the masks' law is checked above."""
    got, _ = megadare_rm_loss(family, couple, beta)
    assert close(got, RM_LOSS[family, couple, beta]) == (family == "sdar" or beta == 0)


@pytest.mark.parametrize("family,couple,beta", list(RM_LOSS))
def test_live_random_masking_loss_normalisation_is_dllm_rls(family, couple, beta):
    got, frags = megadare_rm_loss(family, couple, beta)
    theirs = dllm_rl_rm_loss(family, frags, beta)
    assert close(theirs, RM_LOSS[family, couple, beta]) and close(got, theirs) == (family == "sdar" or beta == 0)


# ------------------------------------------------------------------ post_num on a full canvas
def dllm_rl_post_num_fragments(post_num: int) -> dict:
    """rl_llada.py's TraceRL fragments (shrink 2) of llada_samples() under ``post_num``."""
    samples = llada_samples()
    cfg = dict(method="TraceRL", shrink=2, beta=0.0, post_num=post_num, batch_size_lm=1)
    steps = [list(s.commit_step) for s in samples]
    r = D.llada_training(
        cfg, [s.prompt_ids for s in samples], [s.response_ids for s in samples], steps, ADVS, MASK, PAD
    )
    r, frags = r["rows"], {}
    for i in range(r.noisy.shape[0]):
        masked = {j for j, t in enumerate(r.noisy[i, r.start :].tolist()) if t == MASK}
        targets = {j for j, x in enumerate(r.p_mask[i, r.start :].tolist()) if x}
        frags.setdefault(ADVS.index(r.rewards[i]), []).append((masked, targets))
    return frags


def megadare_post_num_fragments(post_num: int) -> dict:
    algo, arch = REGISTRY["tracerl"]({"shrink": 2, "post_num": post_num}), tiny_arch("llada", 0)
    return {s.index: fragments_of(algo.views(s, arch, 0, None), len(s.prompt_ids)) for s in llada_samples()}


# post_num -> per sample, the target counts of rl_llada.py's fragments (answers 9, 16, 5 of a canvas of 16)
POST_NUM_TARGETS = {
    0: {0: [3, 2, 3, 1], 1: [2, 4, 4, 3, 2, 1], 2: [2, 1, 2]},
    2: {0: [4, 2, 3, 1, 1], 1: [2, 4, 4, 3, 2, 1], 2: [2, 1, 4]},
    5: {0: [4, 2, 3, 1, 4], 1: [2, 4, 4, 3, 2, 1], 2: [2, 2, 6]},
}


@pytest.mark.parametrize("post_num", list(POST_NUM_TARGETS))
def test_post_num_keeps_dllm_rls_targets(post_num):
    """The answer's EOS and the first ``post_num`` positions after it stay targets, the rest of the canvas not,
    rows left without a target dropped: rl_llada.py's counts (its pads are the positions after the EOS here)."""
    got = megadare_post_num_fragments(post_num)
    assert {k: [len(t) for _, t in f] for k, f in got.items()} == POST_NUM_TARGETS[post_num]


@pytest.mark.parametrize("post_num", list(POST_NUM_TARGETS))
def test_live_post_num_fragments_are_dllm_rls(post_num):
    theirs = dllm_rl_post_num_fragments(post_num)
    assert {k: [len(t) for _, t in f] for k, f in theirs.items()} == POST_NUM_TARGETS[post_num]
    assert theirs == megadare_post_num_fragments(post_num)
