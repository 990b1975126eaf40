"""Scores and weights of distribution-matched replay (D-ARL-style): which stored samples match the current
policy, and the multi-behaviour importance weights of a batch that mixes behaviour versions.

Reference, provenance (*(inferred)* marks a reconstruction, not a transcription of D-ARL) and notation: see
replay.py, which holds the buffer these scores select from.

1. Variance-guided selection *(inferred)*. Since E_mu[rho] = 1, the variance of the IS weight is
   Var_mu(rho) = E_mu[(rho - 1)^2] = chi^2(pi || mu), the quantity that sets the variance of every IS estimate
   (verl logs it as ``chi2_token`` / ``chi2_seq``; the normalised ESS is 1/(1 + chi^2), and VCPO,
   arXiv:2602.17616, finds a falling ESS predicts collapse). A sample's own contribution to it is (rho - 1)^2, so the per-sample score

       token_chi2 (default):  s_i = (1/L_i) sum_k (exp(l_ik) - 1)^2      (per-token chi^2, length-normalised)
       seq_chi2:              s_i = (exp(sum_k l_ik) - 1)^2
       token_k2 / token_k3:   (1/L) sum_k l^2 / 2,  (1/L) sum_k (e^l - 1 - l)      (verl's RS statistics)
       log_ratio_var:         unbiased variance of {l_ik}_k  (the brief's "variance of log(pi/mu)"; note it
                              is blind to a constant shift of every token, so it is not the default)

   is its deviation from a perfectly matched sample (s = 0 <=> pi = mu on its tokens). ``select`` keeps the
   lowest-score candidates (greedy, ties broken by a generator permutation) or samples without replacement with
   probability ~ exp(-s / temperature) (Gumbel top-k); scores may be pooled per prompt group (mean over the group,
   keeping a GRPO group whole) or per version (the version's empirical chi^2: selects whole behaviour policies),
   candidates above ``max_score`` are rejected, and groups whose rewards are all equal (zero advantage under a
   group baseline) can be dropped. Selection conditions on the ratio, so like verl's rejection sampling (RS) it
   trades bias for variance; the weights of item 2 then correct for *which policy* drew a kept sample.

2. Multi-behaviour objective (``replay.pmis``, *(inferred)* to be multiple importance sampling). Draw n_j samples
   from each q_j = mu_j (n = sum_j n_j, alpha_j = n_j / n). The balance-heuristic estimator of E_p[f] is

       F = (1/n) sum_j sum_{i=1}^{n_j} w(X_ji) f(X_ji),   w(x) = p(x) / sum_j alpha_j q_j(x),

   unbiased whenever the mixture covers p (q_j itself may miss part of p's support), and its variance exceeds
   that of any other MIS weighting by at most (1/min_j n_j - 1/n) E_p[f]^2 (Veach's thesis, ch. 9). It needs each sample's log-prob under *every*
   version in the batch (K extra forwards or K stored models); with K = 1 it reduces to ordinary IS, and w = 1
   when every q_j = p. ``chi2_ess`` gives the batch's chi^2 and normalised ESS of the weights
   (``is/mixture_chi2``, ``is/mixture_ess``).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

SCORES = ("token_chi2", "seq_chi2", "token_k2", "token_k3", "log_ratio_var")


# ---------------------------------------------------------------------------------------------------------------
# scores
# ---------------------------------------------------------------------------------------------------------------


def variance_guided_scores(
    log_ratios: Union[Sequence[torch.Tensor], torch.Tensor], kind: str = "token_chi2", log_clamp: Optional[float] = 20.0
) -> torch.Tensor:
    """[N] float64 mismatch score per sample from its per-token log ratios l = log pi - log mu_v (lower = better
    matched; 0 when pi = mu_v on the sample's tokens, except ``log_ratio_var`` which is 0 for any constant shift).
    See the module docstring for the formulas. Log ratios are clamped to +-``log_clamp`` first (verl's guard);
    an empty sample scores 0."""
    if kind not in SCORES:
        raise ValueError(f"score kind={kind!r} unknown; choose one of {SCORES}")
    rows = (
        list(log_ratios.unbind(0))
        if isinstance(log_ratios, torch.Tensor) and log_ratios.dim() == 2
        else list(log_ratios)
    )
    out = torch.zeros(len(rows), dtype=torch.float64)
    for i, row in enumerate(rows):
        lr = torch.as_tensor(row, dtype=torch.float64).flatten()
        if lr.numel() == 0:
            continue
        if log_clamp is not None:
            lr = lr.clamp(-log_clamp, log_clamp)
        if kind == "token_chi2":
            out[i] = torch.expm1(lr).square().mean()
        elif kind == "seq_chi2":
            tot = lr.sum()
            if log_clamp is not None:
                tot = tot.clamp(-log_clamp, log_clamp)
            out[i] = torch.expm1(tot).square()
        elif kind == "token_k2":
            out[i] = 0.5 * lr.square().mean()
        elif kind == "token_k3":
            out[i] = (torch.expm1(lr) - lr).mean()
        else:
            out[i] = lr.var(unbiased=True) if lr.numel() > 1 else 0.0
    return out


def chi2_ess(log_w: torch.Tensor) -> dict[str, float]:
    """Batch diagnostics of IS weights w = exp(log_w): chi^2 = E[w^2]/E[w]^2 - 1 and the normalised effective
    sample size ESS/N = (sum w)^2 / (N sum w^2) = 1 / (1 + chi^2)."""
    lw = torch.as_tensor(log_w, dtype=torch.float64).flatten()
    if lw.numel() == 0:
        return {"chi2": 0.0, "ess": 1.0}
    w = torch.exp(lw - lw.max())
    ess = float(w.sum() ** 2 / (lw.numel() * w.square().sum()))
    return {"chi2": 1.0 / ess - 1.0, "ess": ess}


# ---------------------------------------------------------------------------------------------------------------
# multi-behaviour objective
# ---------------------------------------------------------------------------------------------------------------


def version_counts(versions: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """(distinct versions ascending, count of each) of a [N] version tensor."""
    uniq, counts = torch.unique(torch.as_tensor(versions, dtype=torch.long), sorted=True, return_counts=True)
    return uniq.tolist(), counts


def balance_heuristic_weights(
    target_logp: torch.Tensor,
    behaviour_logps: torch.Tensor,
    counts: torch.Tensor,
    log_clamp: Optional[float] = None,
    threshold: Optional[float] = None,
) -> torch.Tensor:
    """Balance-heuristic MIS weights (Veach & Guibas 1995): for samples drawn n_j from each of K behaviour
    policies q_j (n = sum_j n_j),

        w(x) = p(x) / sum_j (n_j / n) q_j(x),   log w = log p(x) - logsumexp_j(log n_j - log n + log q_j(x)),

    so (1/n) sum_samples w f is unbiased for E_p[f] when the mixture covers p (each q_j need not).

    ``target_logp``: [N] log p(x_i) (sequence or token level); ``behaviour_logps``: [K, N] log q_j(x_i) of every
    sample under every behaviour policy (whichever policy drew it); ``counts``: [K] n_j (a zero count drops that
    policy from the mixture). ``log_clamp`` clamps log w (verl clamps log ratios to +-20); ``threshold`` caps w
    from above (truncated IS, ``algorithm.rollout_is_threshold``); both bias the estimate. Returns [N], the dtype
    of ``target_logp`` (float32 inputs are computed in float64); trainer/offpolicy/correction.py builds the inputs from a batch's
    per-sample versions (``ReplaySelection.counts()`` gives the versions / counts of a selection)."""
    p = torch.as_tensor(target_logp)
    q = torch.as_tensor(behaviour_logps)
    if q.dim() == 1:
        q = q.unsqueeze(0)
    n = torch.as_tensor(counts, dtype=torch.float64, device=q.device).flatten()
    if q.dim() != 2 or q.shape[1] != p.numel() or q.shape[0] != n.numel():
        raise ValueError(f"behaviour_logps {tuple(q.shape)} must be [K={n.numel()}, N={p.numel()}]")
    if (n < 0).any() or float(n.sum()) <= 0:
        raise ValueError(f"counts {n.tolist()} must be >= 0 with a positive total")
    log_alpha = torch.log(n / n.sum())  # -inf for a zero count
    mix = torch.logsumexp(q.to(torch.float64) + log_alpha.unsqueeze(1), dim=0)
    log_w = p.to(torch.float64).flatten() - mix
    if log_clamp is not None:
        log_w = log_w.clamp(-log_clamp, log_clamp)
    w = torch.exp(log_w)
    if threshold is not None:
        w = w.clamp(max=threshold)
    return w.to(p.dtype if p.is_floating_point() else torch.float64)


__all__ = [
    "SCORES",
    "variance_guided_scores",
    "chi2_ess",
    "version_counts",
    "balance_heuristic_weights",
]
