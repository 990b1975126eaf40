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

import torch

from megadare.algos import REGISTRY
from megadare.algos.base import Slots
from megadare.diffusion import corruption as C


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
