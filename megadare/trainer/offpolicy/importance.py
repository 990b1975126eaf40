"""Rollout correction: importance weights, rejection and the decoupled / bypass PPO objectives for off-policy
(stale, asynchronous or mismatched-engine) rollouts.

Notation. mu = behaviour policy (the engine version that produced the sample), pi_prox = proximal policy (the
trainer's weights before this update, recomputed on the trainer), pi_theta = current policy. Every function is
elementwise over *elements*: a token, or a slot of algos/base.py (a token, or a whole sequence for
sequence-level estimators). ``group_ids`` says which sequence each element belongs to (None: every element is
its own sequence, which is what slot-per-sequence estimators such as BGPO / VRPO want).

Importance weights (verl ``verl/trainer/ppo/mismatch_helper.py::compute_rollout_importance_weights`` -- the
October-2025 API that D-ARL's ``rollout_is`` / ``rollout_is_threshold`` knobs come from -- and its successor
``verl/trainer/ppo/rollout_corr_helper.py::compute_rollout_correction_weights`` /
``compute_rollout_rejection_mask`` / ``compute_offpolicy_metrics``; maths in verl ``docs/algo/rollout_corr_math.md``):

    token      log w_k = t_k - b_k                                  (t = target log-prob, b = behaviour log-prob)
    sequence   log w_k = sum_{j in seq(k)} (t_j - b_j)              (one weight per sequence, broadcast)
    geometric  log w_k = mean_{j in seq(k)} (t_j - b_j)             (length-invariant; "Geo-RS")
    w = exp(clamp(log w, -20, 20))                                  (verl's SAFETY_BOUND, before exp)
    truncate   w <- min(w, C_high)                                  (TIS: Ionides 2008; Yao et al. "Your efficient
                                                                     RL framework secretly brings you off-policy RL
                                                                     training", fengyao.notion.site/off-policy-rl)
    mask       keep = C_low <= w <= C_high, w <- w * keep           (MIS / rejection sampling; Liu, Li et al.
                                                                     "When Speed Kills Stability", 2025)
    veto       a sequence with any token ratio t_k - b_k < log C_veto is dropped entirely (both modes)

Decoupled PPO (Hilton, Cobbe, Schulman, "Batch size-invariance for policy optimization", arXiv:2110.00641;
AReaL, Fu et al., arXiv:2505.24298, ``areal/utils/functional/functional.py::ppo_actor_loss_fn`` with
``apply_rejection_sampling``):

    L = -w_prox * min(r A, clip(r, 1 - eps_low, 1 + eps_high) A),   r = exp(logp - l_prox),
    w_prox = sg(min(exp(l_prox - l_behave), C))

Bypass mode (verl ``verl/trainer/ppo/core_algos.py::compute_policy_loss_bypass_mode``,
``rollout_corr_helper.py::apply_bypass_mode``): pi_prox := mu (no proximal forward); ``ppo_clip`` clips
r = pi_theta / mu and applies *no* extra IS weight (the ratio already is the IS ratio; rejection still masks);
``reinforce`` is L = -sg(w) log pi_theta A with w = min(pi_theta / mu, C) (``compute_policy_loss_reinforce``).

Where training applies them: ``offpolicy.loss_mode`` (``ppo`` | ``decoupled`` | ``bypass``) reaches the
algorithm's own slot loss in ``algos/base.py`` (``SlotObjective``), with the weights of :func:`rollout_is_weights`
computed before the update (trainer/offpolicy/correction.py). The token-level forms of the two objectives above
(AReaL's and verl's, ``reinforce`` included) live in tests/offpolicy_reference.py, the reference
tests/test_rollout_correction.py checks them and ``SlotObjective`` against.

Diffusion LLMs: which log-probs may go into a ratio
----------------------------------------------------
A ratio pi_target / mu means something only when both log-probs are *the same estimator evaluated on the same
trace states*; with identical weights it must then be exactly 1 (tests/test_rollout_correction.py checks the
function side of that; the caller must check its inputs, e.g. ``ratio == 1`` before the first update).

* Second estimator kind (trace replay: TraceRL, CJ-GRPO, diffusion/trace_replay.py). The engine records, per
  committed token y_k, b_k = log q_mu(y_k | x_s): the log-prob of the committed token under the *sampling
  distribution* of step s (after temperature / top-k / top-p, with the mask token excluded;
  rollout/dllm_step.py), in the state x_s before that step. The trainer's replay view of step s rebuilds x_s
  and scores t_k = log p_theta(y_k | x_s). Token ratios exp(t_k - b_k) are then per-step IS ratios and the
  sequence product is the ratio of the token choices *given the unmasking order*; which positions confidence
  remasking picked is not in b_k, so it is not corrected. Conditions: the trainer applies the same logit
  processing as the sampler (temperature, truncation, mask exclusion); one replay state per recorded step
  (``shrink = 1``, CJ-GRPO): TraceRL's ``shrink > 1`` scores tokens committed at later steps of a fragment from
  the fragment's first state, which is not the state the engine sampled them in, so engine log-probs are not
  the same estimator there; greedy decoding records 0, which is not a density; and the tokens of the last block
  after the EOS cut are replayed from states with fewer masked positions than the engine saw
  (trace_replay.py's stated deviation).
* First estimator kind (corruption sampling: d1, Coupled-GRPO, random-mask RL, VRPO, BGPO, SPG,
  diffusion/corruption.py). A slot estimate is a Monte-Carlo surrogate of log pi(y | c) over corruptions the engine
  never saw, so there is **no per-token behaviour log-prob from the engine**. IS must then use sequence-level
  estimates computed by the trainer for both sides: the same estimator, on the same stored corruptions and
  coefficients, evaluated once with the behaviour version's weights and once with the target's (``level=
  "sequence"`` over token slots with ``group_ids`` = sample, or ``group_ids=None`` when a slot already is a
  sequence). exp(l_target - l_behave) of two ELBO estimates is a surrogate, not an unbiased estimate of
  pi_target(y) / mu(y) (bound gap and Jensen), but it is exactly 1 when the weights agree.

Metrics (floats; "units" are elements at ``level="token"``, sequences at ``"sequence"`` / ``"geometric"``;
``is_*``, ``ess``, ``chi2`` use the log-clamped, not-yet-truncated weights w_u of the valid units, n of them):

    is_mean, is_std (population), is_max, is_min
    ess   = (sum_u w_u)^2 / (n sum_u w_u^2)          in (0, 1]; = 1/E[(w/E w)^2], verl's rollout_is_eff_sample_size
    chi2  = mean_u w_u^2 - 1                          estimates chi^2(pi_target || mu) = E_mu[rho^2] - 1 (verl
                                                      chi2_token / chi2_seq)
    k3_kl = mean_k [exp(t_k - b_k) - (t_k - b_k) - 1] over valid elements: Schulman's k3 with samples from mu,
            i.e. an unbiased estimate of KL(mu || pi_target) = E_mu[b - t] per element (verl ``k3_kl``,
            "KL(pi_rollout || pi_training)"). Note the direction: exp(b - t) - (b - t) - 1 would be k3 for
            KL(pi_target || mu) and needs samples from pi_target, which we do not have.
    kl    = mean_k (b_k - t_k)                        k1 estimate of the same KL(mu || pi_target)
    rejected_fraction      valid elements with keep = False (mask, veto, NaN log-ratios)
    rejected_seq_fraction  sequences with at least one rejected valid element
    truncated_fraction     valid kept elements whose weight was changed by truncation
    veto_fraction          sequences dropped by the veto
    applied_mean, applied_ess  the same statistics of the weights actually returned (after truncation/masking)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megadare.algos.policy_loss import kl_penalty

IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "mask")
SAFETY_BOUND = 20.0  # verl rollout_corr_helper.SAFETY_BOUND: log-ratios are clamped to +-20 before exp


@dataclass(frozen=True)
class RolloutIS:
    """How rollout importance weights are built (D-ARL's ``algorithm.rollout_is*``, our ``offpolicy.rollout_is*``);
    checked once when built. ``RolloutIS.of(cfg.offpolicy)`` reads the config section.

    * ``level``: token (w_k = exp(t_k - b_k)), sequence (exp of the sequence's sum, broadcast), geometric (exp of
      the sequence's mean).
    * ``mode``: ``truncate`` (TIS): w = min(w, threshold_high); no lower truncation unless ``threshold_low`` is
      given, in which case w = clamp(w, threshold_low, threshold_high) (AReaL's ``action="clamp"``). ``mask``
      (MIS / rejection sampling): units with w outside [threshold_low, threshold_high] (bounds inclusive, as
      verl) get keep = False and weight 0; ``threshold_low`` defaults to 1 / threshold_high. At sequence and
      geometric level the whole sequence is kept or dropped. ``threshold_high=None``: no upper bound (plain IS).
      Threshold tests compare log-ratios with log(threshold) in the working dtype, before the log clamp.
    * ``veto_threshold``: a sequence with any valid token ratio exp(t_k - b_k) < veto_threshold is dropped
      (keep = False, weight 0), in either mode.
    * ``log_clamp``: log-ratios are clamped to +-log_clamp before exp (verl's SAFETY_BOUND).
    """

    level: str = "token"
    mode: str = "truncate"
    threshold_high: Optional[float] = 2.0
    threshold_low: Optional[float] = None
    veto_threshold: Optional[float] = None
    log_clamp: float = SAFETY_BOUND

    def __post_init__(self) -> None:
        if self.level not in IS_LEVELS:
            raise ValueError(f"rollout_is level={self.level!r} unknown; choose one of {IS_LEVELS}")
        if self.mode not in IS_MODES:
            raise ValueError(f"rollout_is mode={self.mode!r} unknown; choose one of {IS_MODES}")
        high, low = self.threshold_high, self.threshold_low
        if high is not None and high <= 0:
            raise ValueError(f"rollout_is threshold_high={high} must be > 0 (or None)")
        if low is not None and (low < 0 or (high is not None and low > high)):
            raise ValueError(f"rollout_is threshold_low={low} must lie in [0, threshold_high]")
        if self.veto_threshold is not None and self.veto_threshold <= 0:
            raise ValueError(f"rollout_is veto_threshold={self.veto_threshold} must be > 0 (or None)")
        if self.log_clamp <= 0:
            raise ValueError(f"rollout_is log_clamp={self.log_clamp} must be > 0")

    @classmethod
    def of(cls, section, level: Optional[str] = None) -> "RolloutIS":
        """The setting of config section ``offpolicy`` (``level`` overrides its ``rollout_is``; unset: token)."""
        return cls(
            level=level or section.rollout_is or "token",
            mode=section.rollout_is_mode,
            threshold_high=section.rollout_is_threshold,
            threshold_low=section.rollout_is_threshold_low,
            veto_threshold=section.rollout_is_veto,
        )


def _log_threshold(x: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """log(x) in the working dtype (so that a log-ratio built as torch.log(tensor(x)) compares equal);
    log(0) = -inf, log(inf) = inf."""
    if x == 0.0:
        return torch.tensor(float("-inf"), dtype=dtype, device=device)
    return torch.log(torch.tensor(x, dtype=dtype, device=device))


def _group_index(group_ids: Optional[torch.Tensor], n: int, device: torch.device) -> tuple[torch.Tensor, int]:
    if group_ids is None:
        return torch.arange(n, device=device), n
    if group_ids.shape != (n,):
        raise ValueError(f"rollout correction: group_ids has shape {tuple(group_ids.shape)}, expected ({n},)")
    uniq, inv = torch.unique(group_ids.to(device), return_inverse=True)
    return inv, int(uniq.numel())


def _stats(u: torch.Tensor) -> dict[str, float]:
    """mean / std / max / min / ess / chi2 of a 1-D weight vector (NaN when empty)."""
    if u.numel() == 0:
        return {k: float("nan") for k in ("mean", "std", "max", "min", "ess", "chi2")}
    s, s2, n = u.sum(), (u * u).sum(), u.numel()
    return {
        "mean": float(u.mean()),
        "std": float(u.std(unbiased=False)),
        "max": float(u.max()),
        "min": float(u.min()),
        "ess": float(s * s / (n * s2)) if s2 > 0 else 0.0,
        "chi2": float(s2 / n - 1.0),
    }


def rollout_is_weights(
    target_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    group_ids: Optional[torch.Tensor] = None,
    setting: RolloutIS = RolloutIS(),
    valid: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Importance weights pi_target / mu for off-policy elements: (weights [N], keep [N] bool, metrics).

    Follows verl ``mismatch_helper.py::compute_rollout_importance_weights`` (levels token / sequence / geometric,
    modes truncate / mask, lower threshold defaulting to 1 / upper, per-token veto, +-20 log clamp) and
    ``rollout_corr_helper.py::compute_offpolicy_metrics`` (k3_kl, chi2) -- see the module docstring for the
    formulas, the metric definitions and the dLLM estimator conditions, and ``RolloutIS`` for ``setting``
    (level, mode, thresholds, veto, log clamp).

    * ``target_logp``, ``behaviour_logp``: [N] per-element log-probs (target: pi_theta in bypass mode,
      pi_prox in decoupled mode). Both are detached: the weights never carry a gradient (verl
      ``rollout_corr_math.md`` section 3.2.2: IS changes the measure, it is not optimised).
    * ``group_ids`` [N]: the sequence of each element (any integer labels); None = each element alone.
    * ``valid`` [N] bool: padding / unused elements (weight 0, keep False, excluded from sums and metrics).
    Kept elements carry their (possibly truncated) weight, dropped ones weight 0 -- unlike verl, which keeps
    the raw ratio in the weights and drops via the response mask only; multiply by ``weights`` and the rejected
    elements contribute nothing. A NaN log-ratio (e.g. -inf - -inf) rejects its element (its whole sequence at
    sequence / geometric level) instead of propagating.
    """
    if target_logp.shape != behaviour_logp.shape or target_logp.dim() != 1:
        raise ValueError(
            f"rollout_is: target {tuple(target_logp.shape)} and behaviour "
            f"{tuple(behaviour_logp.shape)} log-probs must both be [N]"
        )
    n = target_logp.shape[0]
    device = target_logp.device
    dtype = torch.promote_types(target_logp.dtype, torch.float32)
    with torch.no_grad():
        t = target_logp.detach().to(dtype)
        b = behaviour_logp.detach().to(dtype)
        valid_b = torch.ones(n, dtype=torch.bool, device=device) if valid is None else valid.to(device).bool()
        if valid_b.shape != (n,):
            raise ValueError(f"rollout_is: valid has shape {tuple(valid_b.shape)}, expected ({n},)")
        inv, n_groups = _group_index(group_ids, n, device)
        log_r = torch.where(valid_b, t - b, torch.zeros((), dtype=dtype, device=device))  # token log-ratios
        elem_log = _unit_log_ratios(log_r, valid_b, inv, n_groups, setting.level)
        raw = torch.exp(elem_log.clamp(-setting.log_clamp, setting.log_clamp))
        ratios = _LogRatios(t, b, valid_b, inv, n_groups, setting.level, log_r, elem_log, raw)
        keep, w, truncated = _apply_thresholds(raw, elem_log, valid_b, setting)
        vetoed_seq = torch.zeros(n_groups, dtype=torch.bool, device=device)
        if setting.veto_threshold is not None:
            bad = valid_b & (log_r < _log_threshold(setting.veto_threshold, dtype, device))
            vetoed_seq = torch.zeros(n_groups, dtype=dtype, device=device).index_add(0, inv, bad.to(dtype)) > 0
            keep = keep & ~vetoed_seq[inv]
        weights = torch.where(keep, w, torch.zeros((), dtype=dtype, device=device))
        metrics = ratios.metrics(weights, keep, truncated & keep, vetoed_seq)
    return weights, keep, metrics


def _unit_log_ratios(
    log_r: torch.Tensor, valid: torch.Tensor, inv: torch.Tensor, n_groups: int, level: str
) -> torch.Tensor:
    """Per element, the log-ratio of its unit: the token's own (token), its sequence's sum (sequence) or mean
    (geometric)."""
    if level == "token":
        return log_r
    g = torch.zeros(n_groups, dtype=log_r.dtype, device=log_r.device).index_add(0, inv, log_r)
    if level == "geometric":
        count = torch.zeros(n_groups, dtype=log_r.dtype, device=log_r.device).index_add(0, inv, valid.to(log_r.dtype))
        g = g / count.clamp_min(1.0)
    return g[inv]


def _apply_thresholds(
    raw: torch.Tensor, elem_log: torch.Tensor, valid: torch.Tensor, setting: RolloutIS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keep, weight, truncated) under truncation (TIS) or masking (MIS); bounds compared in log space."""
    dtype, device = raw.dtype, raw.device
    mode, threshold_high, low = setting.mode, setting.threshold_high, setting.threshold_low
    if low is None and mode == "mask":
        low = 1.0 / threshold_high if threshold_high is not None else 0.0
    log_hi = _log_threshold(threshold_high if threshold_high is not None else math.inf, dtype, device)
    log_lo = _log_threshold(low if low is not None else 0.0, dtype, device)
    keep = valid & ~torch.isnan(elem_log)
    truncated = torch.zeros_like(keep)
    w = raw
    if mode == "mask":
        return keep & (elem_log >= log_lo) & (elem_log <= log_hi), w, truncated
    if threshold_high is not None:
        w = w.clamp(max=threshold_high)
        truncated = truncated | (elem_log > log_hi)
    if low is not None:
        w = w.clamp(min=low)
        truncated = truncated | (elem_log < log_lo)
    return keep, w, truncated


@dataclass(frozen=True)
class _LogRatios:
    """The log importance ratios of one batch: target ``t`` and behaviour ``b`` log-probs of the ``valid``
    elements, their sequences (``inv`` into ``n_groups``) and ``level``, the token log-ratios ``log_r``, each
    element's unit log-ratio ``elem_log`` and its log-clamped, not-yet-truncated weight ``raw``."""

    t: torch.Tensor
    b: torch.Tensor
    valid: torch.Tensor
    inv: torch.Tensor
    n_groups: int
    level: str
    log_r: torch.Tensor
    elem_log: torch.Tensor
    raw: torch.Tensor

    def metrics(
        self, weights: torch.Tensor, keep: torch.Tensor, truncated: torch.Tensor, vetoed_seq: torch.Tensor
    ) -> dict[str, float]:
        """The metrics of the module docstring, over units (elements, or one representative per sequence)."""
        t, b, valid, inv, n_groups, raw = self.t, self.b, self.valid, self.inv, self.n_groups, self.raw
        n, dtype, device = t.shape[0], t.dtype, t.device
        count = torch.zeros(n_groups, dtype=dtype, device=device).index_add(0, inv, valid.to(dtype))
        has_valid = count > 0
        n_valid = int(valid.sum())
        ok = valid & ~torch.isnan(self.log_r)
        if self.level == "token":
            unit_raw, unit_applied = raw[ok], weights[valid]
        else:
            # one representative (its first valid element) per sequence that has a valid element
            rep = torch.full((n_groups,), n, dtype=torch.long, device=device).scatter_reduce(
                0, inv[valid], torch.arange(n, device=device)[valid], reduce="amin"
            )[has_valid]
            unit_raw = raw[rep][~torch.isnan(self.elem_log[rep])]
            unit_applied = weights[rep]
        raw_stats, applied_stats = _stats(unit_raw), _stats(unit_applied)
        rejected = valid & ~keep
        rej_seq = torch.zeros(n_groups, dtype=dtype, device=device).index_add(0, inv, rejected.to(dtype)) > 0
        n_seq = int(has_valid.sum())
        metrics = {f"is_{k}": raw_stats[k] for k in ("mean", "std", "max", "min")}
        any_ok = bool(ok.any())
        metrics.update(
            {
                "ess": raw_stats["ess"],
                "chi2": raw_stats["chi2"],
                "k3_kl": float(kl_penalty(b[ok], t[ok], "k3", k3_bound=None).mean()) if any_ok else float("nan"),
                "kl": float((b[ok] - t[ok]).mean()) if any_ok else float("nan"),
                "rejected_fraction": float(rejected.sum()) / max(n_valid, 1),
                "rejected_seq_fraction": float((rej_seq & has_valid).sum()) / max(n_seq, 1),
                "truncated_fraction": float(truncated.sum()) / max(n_valid, 1),
                "veto_fraction": float((vetoed_seq & has_valid).sum()) / max(n_seq, 1),
                "applied_mean": applied_stats["mean"],
                "applied_ess": applied_stats["ess"],
            }
        )
        return metrics
