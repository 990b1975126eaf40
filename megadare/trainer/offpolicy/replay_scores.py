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
   version in the batch (K extra forwards or K stored models); ``own_behaviour_weights`` is the cheap per-source
   form p / q_{v(x)} (ordinary IS; unbiased for the alpha-mixture only if every q_j covers p). With K = 1 both reduce to ordinary IS, and
   w = 1 when every q_j = p. ``per_version_normalised_advantages`` normalises advantages within each behaviour
   version (D-ARL's "per-version optimisation": every source enters on the same scale) and
   ``per_version_loss_weights`` gives each version a share of the objective (alpha_v by default).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence, Union

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
    of ``target_logp`` (float32 inputs are computed in float64). ``mis_weights`` builds the inputs from a batch's
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


def mis_weights(
    target_logp: torch.Tensor,
    logp_by_version: Mapping[int, torch.Tensor],
    versions: torch.Tensor,
    log_clamp: Optional[float] = None,
    threshold: Optional[float] = None,
) -> torch.Tensor:
    """Balance-heuristic weights for a batch that mixes behaviour versions: ``versions`` [N] is the version that
    drew each sample (fresh and replayed alike), ``logp_by_version[v]`` [N] the log-prob of *every* sample under
    version v's policy (needed for each v in ``versions``); the counts n_v come from ``versions``."""
    uniq, counts = version_counts(versions)
    missing = [v for v in uniq if v not in logp_by_version]
    if missing:
        raise ValueError(f"no log-probs under behaviour versions {missing}")
    beh = torch.stack([torch.as_tensor(logp_by_version[v]).flatten() for v in uniq])
    return balance_heuristic_weights(target_logp, beh, counts, log_clamp, threshold)


def own_behaviour_weights(
    target_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    log_clamp: Optional[float] = None,
    threshold: Optional[float] = None,
) -> torch.Tensor:
    """Per-source (ordinary) IS weights w_i = p(x_i) / q_{v(i)}(x_i) against each sample's own behaviour policy:
    the cheap multi-behaviour form when log-probs under the other versions are not available (also unbiased for
    the alpha-mixture, but q_{v(i)} must cover p on its own). ``balance_heuristic_weights`` with K = 1."""
    b = torch.as_tensor(behaviour_logp).flatten()
    return balance_heuristic_weights(target_logp, b.unsqueeze(0), torch.ones(1), log_clamp, threshold)


def per_version_normalised_advantages(
    advantages: torch.Tensor, versions: torch.Tensor, center: bool = True, scale: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Advantages normalised within each behaviour version v *(inferred D-ARL per-version optimisation)*:

        A'_i = (A_i - mean_{j: v_j = v_i} A_j) / (std_{j: v_j = v_i} A_j + eps)   (population std)

    so samples of every source enter the objective on the same scale and a stale version's reward level does
    not leak into the others' baseline. ``center`` / ``scale`` switch the two parts; a version whose advantages
    are all equal (a single sample, say) is only centred, never divided by eps. [N] -> [N] float32. Per-token
    advantages: pass them flattened, with the version of each token."""
    a = torch.as_tensor(advantages, dtype=torch.float64).flatten()
    v = torch.as_tensor(versions, dtype=torch.long).flatten()
    if a.numel() != v.numel():
        raise ValueError(f"{a.numel()} advantages for {v.numel()} versions")
    out = a.clone()
    for ver in torch.unique(v).tolist():
        m = v == ver
        x = a[m]
        if center:
            x = x - x.mean()
        sd = float(a[m].std(unbiased=False))
        if scale and sd > 0:
            x = x / (sd + eps)
        out[m] = x
    return out.float()


def per_version_loss_weights(versions: torch.Tensor, scheme: Union[str, Mapping[int, float]] = "count") -> torch.Tensor:
    """[N] per-sample loss weights summing to 1 that give each behaviour version v a share beta_v of the
    objective *(inferred "policy-level weighting")*: w_i = beta_{v_i} / n_{v_i}.

    ``'count'``: beta_v = n_v / n (w_i = 1/n, the balance-heuristic estimator's own 1/n); ``'uniform'``:
    beta_v = 1 / #versions (every source counts equally however many samples it gave); a mapping
    {version: beta_v} gives explicit shares (renormalised over the versions present)."""
    v = torch.as_tensor(versions, dtype=torch.long).flatten()
    uniq, counts = version_counts(v)
    if not uniq:
        return torch.zeros(0, dtype=torch.float64)
    if scheme == "count":
        beta = {u: int(c) / v.numel() for u, c in zip(uniq, counts.tolist())}
    elif scheme == "uniform":
        beta = {u: 1.0 / len(uniq) for u in uniq}
    elif isinstance(scheme, Mapping):
        tot = sum(float(scheme.get(u, 0.0)) for u in uniq)
        if tot <= 0 or any(float(scheme.get(u, 0.0)) < 0 for u in uniq):
            raise ValueError(f"version shares {dict(scheme)} must be >= 0 with a positive total over {uniq}")
        beta = {u: float(scheme.get(u, 0.0)) / tot for u in uniq}
    else:
        raise ValueError(f"scheme={scheme!r} unknown; 'count', 'uniform' or a {{version: share}} mapping")
    n_of = dict(zip(uniq, counts.tolist()))
    return torch.tensor([beta[x] / n_of[x] for x in v.tolist()], dtype=torch.float64)


def mixture_estimate(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(1/n) sum_i w_i f_i, the multi-behaviour IS estimate of E_pi[f] (or of the surrogate objective)."""
    f = torch.as_tensor(values, dtype=torch.float64).flatten()
    w = torch.as_tensor(weights, dtype=torch.float64).flatten()
    if f.numel() != w.numel():
        raise ValueError(f"{f.numel()} values for {w.numel()} weights")
    return (w * f).sum() / max(f.numel(), 1)


__all__ = [
    "SCORES",
    "variance_guided_scores",
    "chi2_ess",
    "version_counts",
    "balance_heuristic_weights",
    "mis_weights",
    "own_behaviour_weights",
    "per_version_normalised_advantages",
    "per_version_loss_weights",
    "mixture_estimate",
]
