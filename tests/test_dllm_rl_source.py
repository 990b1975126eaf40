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
LLaDA TraceRL policy term equal, the KL term not (rl_llada.py sums it per fragment, megadare divides by the
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
from megadare.algos.advantages import filter_groups, group_advantages
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


def dllm_rl_llada(samples, shrink: int, beta: float) -> tuple[dict, tuple[float, float]]:
    """rl_llada.py's TraceRL (``batch_size_lm`` 1: one fragment a micro-batch) on ``samples``."""
    cfg = dict(method="TraceRL", shrink=shrink, beta=beta, post_num=0, batch_size_lm=1)
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    g = D.llada_training(cfg, prompts, responses, [list(s.commit_step) for s in samples], ADVS, MASK, PAD)
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
# (shrink, beta) -> the same of rl_llada.py on llada_samples()
LLADA = {
    (1, 0.0): (-0.21263429689352967, 0.0355941258761411),
    (1, 0.01): (-0.21168590218926003, 0.03605335700419032),
    (3, 0.0): (-0.24016935529090938, 0.09051891222728795),
    (3, 0.01): (-0.2377456799355537, 0.09169250288785816),
}


@pytest.mark.parametrize("shrink,beta", list(TRADO))
def test_block_tracerl_loss_and_gradient_are_dllm_rls(shrink, beta):
    """SDAR / TraDo TraceRL: megadare's step on its rows = dLLM-RL's rl_trado.py loop (rows, old log-probs, PPO clip
    with the +-10 log-ratio clamp, k3_exp10, each fragment / L1, mean over fragments), loss and gradient."""
    assert close(megadare_loss("sdar", block_samples(), shrink, beta, BS), TRADO[shrink, beta])


@pytest.mark.parametrize("shrink,beta", list(LLADA))
def test_llada_tracerl_policy_term_is_dllm_rls_and_kl_is_normalised(shrink, beta):
    """LLaDA TraceRL: the policy term equals rl_llada.py's; with beta > 0 it differs by its KL sum per fragment
    (megadare divides it by the fragment's targets as rl_trado.py and train_lladav_policy.py do: DllmRlLoss)."""
    got = megadare_loss("llada", llada_samples(), shrink, beta, 0)
    assert close(got, LLADA[shrink, beta]) == (beta == 0), (got, LLADA[shrink, beta])


@pytest.mark.parametrize("shrink,beta", list(TRADO))
def test_live_block_tracerl_is_dllm_rls(shrink, beta):
    samples = block_samples()
    frags, theirs = dllm_rl_trado(samples, shrink, beta)
    assert frags == megadare_fragments("sdar", samples, shrink, BS)
    assert close(theirs, TRADO[shrink, beta]), theirs
    assert close(megadare_loss("sdar", samples, shrink, beta, BS), theirs)


@pytest.mark.parametrize("shrink,beta", list(LLADA))
def test_live_llada_tracerl_is_dllm_rls(shrink, beta):
    samples = llada_samples()
    frags, theirs = dllm_rl_llada(samples, shrink, beta)
    assert frags == megadare_fragments("llada", samples, shrink, 0)
    assert close(theirs, LLADA[shrink, beta]), theirs
    assert close(megadare_loss("llada", samples, shrink, beta, 0), theirs) == (beta == 0)
