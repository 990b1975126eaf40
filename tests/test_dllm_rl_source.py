"""megadare's TraceRL / random-masking RL / value model / advantages against dLLM-RL's own code (Gen-Verse/dLLM-RL
@10b4fd1) on the same inputs.

Every expected value below was produced by dLLM-RL's functions themselves (loaded from a checkout by
tests/dllm_rl_source.py, nothing copied) on the inputs built here: ``train/rl_trado.py`` (step-map padding,
``collect_training_data``, ``compute_logp_old_tok_parallel``, ``forward_process`` in its loop), ``train/rl_llada.py``
(``prepare_inputs_and_labels_for_text``, its ``forward_process``), ``train/train_trado_value.py``
(``collect_training_data``, ``compute_returns_and_advantages_from_fragments``, the value ``forward_process``) and
``reward/rl_reward.py`` run as a script. The model is a stand-in scoring logits E[token] + W[position]
(``dllm_rl_source.PositionModel``), the same parameters for both sides; losses and gradients in float64 (dLLM-RL
keeps old log-probs in float32, megadare its aggregation weights: agreement to ~1e-7 relative).

Setting ``DLLM_RL_SRC`` to a dLLM-RL checkout also runs dLLM-RL's code on these inputs (the ``test_live_*`` tests)
and checks it gives the recorded values and what megadare gives (fragments included); without it they are
skipped, saying so.

Findings (the tests name them): block-family TraceRL loss and gradient equal at shrink 1 and 2, KL included;
LLaDA / Dream TraceRL policy term equal, the KL term not (rl_llada.py / rl_dream.py sum it per fragment, megadare divides by the
targets: algos/tracerl.py DllmRlLoss says why); value model GAE, returns and value loss equal; k3_exp10 equal on
|d| up to 15; advantages and the accuracy band equal (population std without eps since this change); dLLM-RL's
"length >= max_gen_length - 5 is wrong" differs from megadare's ``truncated_as_wrong`` (algos/advantages.py says
why); random masking: the same mask distributions (statistics; the streams differ).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

import dllm_rl_source as D
from megadare.algos import REGISTRY
from megadare.algos.advantages import filter_groups, group_advantages, truncated_as_wrong
from megadare.algos.base import ANSWER_LENGTH, RLSample
from megadare.algos.policy_loss import kl_penalty
from megadare.algos.value_model import step_advantages, value_loss
from megadare.diffusion import corruption as C
from megadare.config.foreign import DLLM_RL, foreign_fix
from megadare.data.tokenizer import HFTokenizer
from megadare.eval.tasks import _math_prompt as math_prompt
from megadare.rewards import score_batch
from megadare.diffusion.trace_replay import shrunk_steps

from algo_toy import one_thread  # noqa: F401  (autouse fixture)
from test_algos_dllm_rl import megadare_step
from test_dare_reward_battery import _rows as dare_battery_rows
from qwen_files import qwen_dir
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


# ------------------------------------------------------------------ advantages and the accuracy band
# (group size, correct answers): accuracies on both sides of and exactly at the band's edges 0.2 and 0.8
GROUPS = [(5, 1), (5, 4), (5, 0), (5, 5), (10, 2), (10, 8), (10, 1), (10, 9), (4, 2), (6, 3), (7, 2), (7, 1)]
MAX_GEN = 100
# rl_reward.py's training rows: (prompt, reward) in order (correctness by math_utils.is_equal of "5" / "6" to "5")
REWARD_ROWS = [
    ("p0", 1.9999999999999998),
    ("p0", -0.49999999999999994),
    ("p0", -0.49999999999999994),
    ("p0", -0.49999999999999994),
    ("p0", -0.49999999999999994),
    ("p1", 0.4999999999999999),
    ("p1", 0.4999999999999999),
    ("p1", 0.4999999999999999),
    ("p1", 0.4999999999999999),
    ("p1", -2.0),
    ("p4", 1.9999999999999998),
    ("p4", 1.9999999999999998),
    ("p4", -0.49999999999999994),
    ("p4", -0.49999999999999994),
    ("p4", -0.49999999999999994),
    ("p4", -0.49999999999999994),
    ("p4", -0.49999999999999994),
    ("p4", -0.49999999999999994),
    ("p4", -0.49999999999999994),
    ("p4", -0.49999999999999994),
    ("p5", 0.4999999999999999),
    ("p5", 0.4999999999999999),
    ("p5", 0.4999999999999999),
    ("p5", 0.4999999999999999),
    ("p5", 0.4999999999999999),
    ("p5", 0.4999999999999999),
    ("p5", 0.4999999999999999),
    ("p5", 0.4999999999999999),
    ("p5", -2.0),
    ("p5", -2.0),
    ("p8", 1.0),
    ("p8", 1.0),
    ("p8", -1.0),
    ("p8", -1.0),
    ("p9", 1.0),
    ("p9", 1.0),
    ("p9", 1.0),
    ("p9", -1.0),
    ("p9", -1.0),
    ("p9", -1.0),
    ("p10", 1.5811388300841893),
    ("p10", 1.5811388300841893),
    ("p10", -0.6324555320336757),
    ("p10", -0.6324555320336757),
    ("p10", -0.6324555320336757),
    ("p10", -0.6324555320336757),
    ("p10", -0.6324555320336757),
]


def reward_groups(lengths=None) -> list[dict]:
    return [
        dict(
            extracted_output=["5"] * c + ["6"] * (G - c),
            ground_truth_answer="5",
            response_length=(lengths or {}).get(i, [40] * G),
            step_map=[[0]] * G,
        )
        for i, (G, c) in enumerate(GROUPS)
    ]


def megadare_reward_rows() -> list[tuple[str, float]]:
    """megadare's advantage pipeline (``advantage.std=population``, ``advantage.accuracy_band=[0.2, 0.8]``) on the
    same correctness, group by group (the groups differ in size)."""
    out = []
    for i, (G, c) in enumerate(GROUPS):
        r = torch.tensor([1.0] * c + [0.0] * (G - c))
        if bool(filter_groups(r, G, accuracy_band=(0.2, 0.8)).all()):
            out += [(f"p{i}", float(a)) for a in group_advantages(r, G, "grpo", "population")]
    return out


def test_advantages_and_accuracy_band_are_dllm_rls():
    """The kept groups (accuracy in [0.2, 0.8], edges included) and their z-scores = rl_reward.py's, to float32.
    Fails before: megadare divided by the population std + 1e-6 (2.5e-6 relative at accuracy 0.2)."""
    ours = megadare_reward_rows()
    assert [p for p, _ in ours] == [p for p, _ in REWARD_ROWS]
    assert [a for _, a in ours] == pytest.approx([a for _, a in REWARD_ROWS], rel=2e-7, abs=1e-7)


def test_live_advantages_and_accuracy_band_are_dllm_rls(tmp_path):
    rows = D.rl_reward(reward_groups(), tmp_path, MAX_GEN)
    assert [r["prompt"] for r in rows] == [p for p, _ in REWARD_ROWS] == [p for p, _ in megadare_reward_rows()]
    assert [r["reward"] for r in rows] == pytest.approx([a for _, a in REWARD_ROWS], rel=1e-12)


def test_live_dllm_rl_counts_near_limit_responses_wrong(tmp_path):
    """dLLM-RL counts a correct response of length >= max_gen_length - 5 wrong (rl_reward.py:100-101), finished or
    not; megadare's ``rewards.truncated_as_wrong`` only those the engine cut (finish_reason "length"): a
    difference kept on purpose (algos/advantages.py ``truncated_as_wrong``)."""
    G = GROUPS[1][0]
    rows = D.rl_reward(reward_groups({1: [MAX_GEN - 5] + [40] * (G - 1)}), tmp_path, MAX_GEN)
    base = D.rl_reward(reward_groups(), tmp_path / "base", MAX_GEN)
    assert [r["reward"] for r in rows if r["prompt"] == "p1"] != [r["reward"] for r in base if r["prompt"] == "p1"]
    assert truncated_as_wrong(torch.tensor([1.0, 1.0]), torch.tensor([False, True])).tolist() == [1.0, 0.0]


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


# ------------------------------------------------------------------ math reward
# indices into tests/test_dare_reward_battery.py MATH of the cases dLLM-RL's math reward accepts (its string stage:
# dllm_rl_source.math_verdicts), recorded from its code
DLLM_MATH_ACCEPTS = [
    0,
    1,
    3,
    4,
    5,
    6,
    7,
    11,
    12,
    13,
    15,
    16,
    19,
    20,
    21,
    31,
    32,
    34,
    36,
    37,
    39,
    41,
    42,
    43,
    44,
    45,
    46,
    47,
    48,
    49,
    50,
    57,
    60,
    61,
    65,
    68,
    70,
    71,
    73,
    79,
    81,
    85,
    91,
    94,
    97,
    98,
    99,
    100,
    101,
    102,
    103,
    104,
    107,
    108,
    109,
    113,
    119,
    121,
    123,
    125,
    129,
    130,
    131,
    135,
    137,
    144,
    145,
    146,
]
# accepted by dLLM-RL, not by megadare's ``auto`` (DARE's math_rm): ``\boxed{1,00}`` for 100 (dLLM-RL drops every
# comma; DARE, the reference megadare's math rewards follow, reads "1,00" as no number)
DLLM_MATH_ONLY = {44}


def test_math_reward_accepts_what_dllm_rl_accepts():
    """On the DARE battery megadare's ``auto`` rule accepts every answer dLLM-RL's reward accepts but the listed
    one; it also accepts many dLLM-RL's string stage rejects (``\\boxed{5 cm}`` for 5, ``\\boxed{\\text{5}}``,
    a trailing-box-less "The answer is 5" ...), where dLLM-RL's sympy stage may or may not (not run here)."""
    responses, records, _ = _battery()
    got, stats = score_batch("auto", responses, records, workers=2, timeout_s=120)
    assert stats.failures == 0, stats.failed
    accepted = {i for i, g in enumerate(got) if g == 1.0}
    assert set(DLLM_MATH_ACCEPTS) - accepted == DLLM_MATH_ONLY


def test_live_math_reward_battery_is_dllm_rls():
    responses, records, _ = _battery()
    verdicts = D.math_verdicts([(r, rec["answer"]) for r, rec in zip(responses, records)])
    assert [i for i, v in enumerate(verdicts) if v] == DLLM_MATH_ACCEPTS


def _battery():
    return dare_battery_rows("math")


# ------------------------------------------------------------------ TraDo / SDAR prompt
PROBLEMS = ["What is 2+3?", "Let $f(x)=\\frac{x}{2}$. Find {f(4)} — in ℝ."]
# dLLM-RL's rollout prompt (sample/trado_rl_rollout.py get_prompt) for PROBLEMS: jinja2 drops the template's
# trailing newline, so it ends with "<|im_start|>assistant", not "assistant\n" as its own string literal reads
DLLM_PROMPTS = [
    "<|im_start|>user\nWhat is 2+3?\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n<|im_start|>assistant",
    "<|im_start|>user\nLet $f(x)=\\frac{x}{2}$. Find {f(4)} — in ℝ.\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n<|im_start|>assistant",
]


def test_sdar_boxed_prompt_is_dllm_rls_plus_the_templates_newline():
    """megadare's ``boxed`` math prompt through SDAR's chat template = dLLM-RL's TraDo / SDAR prompt token for
    token, plus one final "\\n" token: the chat template's (and dLLM-RL's literal's), which jinja2 strips from
    dLLM-RL's rendering (eval/tasks.py ``MATH_BOXED_INSTRUCTION`` says why megadare keeps it)."""
    tok = HFTokenizer(qwen_dir("sdar"))
    for problem, theirs in zip(PROBLEMS, DLLM_PROMPTS, strict=True):
        ours = tok.chat_prompt([{"role": "user", "content": math_prompt(problem, "boxed")}])
        assert ours == tok.encode(theirs) + tok.encode("\n")


def test_live_sdar_prompt_is_dllm_rls():
    assert [D.trado_prompt(p) for p in PROBLEMS] == DLLM_PROMPTS
    assert [D.trado_prompt(p, "sample/sdar_rl_rollout.py") for p in PROBLEMS] == DLLM_PROMPTS


# ------------------------------------------------------------------ config keys users bring
# dLLM-RL training keys megadare has a setting for (configs/rl_*.yaml), with a value and the fix it must suggest
DLLM_RL_KEYS = {
    "training.post_num": (0, "algo.params.post_num=0"),
    "training.mask_times_per_sample": (35, "algo.params.n_views=35"),
    "training.use_kl_estimator_k3": (True, "algo.params.kl_estimator=k3_exp10"),
    "training.gam": (1.0, "algo.params.gamma=1.0"),
    "training.lam": (1.0, "algo.params.lam=1.0"),
    "optimizer.params.value_learning_rate": (5e-6, "algo.params.value_lr=5e-06"),
    "rollout.max_gen_length": (512, "rollout.max_new_tokens=512"),
}
# dLLM-RL training keys without a megadare setting of that meaning (the batch is megadare's own: rl.mini_batches,
# train.micro_batch_size, packing; the model family sets the block; tf32 is not a choice)
DLLM_RL_TRAINING_UNMAPPED = {
    "training.batch_size_lm",
    "training.block_size",
    "training.enable_tf32",
    "training.gradient_accumulation_steps",
    "training.max_gen_length",
    "training.max_prompt_len",
    "training.num_train_epochs",
}


@pytest.mark.parametrize("key", list(DLLM_RL_KEYS))
def test_dllm_rl_training_keys_name_their_megadare_setting(key):
    """Fails before: the loader called these unknown keys without saying what megadare calls them."""
    value, fix = DLLM_RL_KEYS[key]
    origin, text = foreign_fix(key, value)
    assert origin == "dLLM-RL" and text.split(" (")[0] == fix


def test_live_every_dllm_rl_training_key_is_mapped_or_listed():
    keys = {k for k in D.config_keys() if k.startswith("training.")}
    assert keys - set(DLLM_RL) == DLLM_RL_TRAINING_UNMAPPED and set(DLLM_RL_KEYS) & D.config_keys() == set(DLLM_RL_KEYS)
