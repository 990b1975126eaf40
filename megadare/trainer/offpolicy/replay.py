"""Distribution-matched replay over the last K behaviour policies (D-ARL-style), with balance-heuristic MIS.

Reference: Bai, Tong, Wang, Liu, Pan, Li, Wang, Hao, Yuan, Wu, "D-ARL: A Distribution-Matched Asynchronous
Reinforcement Learning Framework for Language Reasoning", ICML 2026 (code: github.com/YinqiBai962/D-ARL, built on
verl). D-ARL has three parts: (1) a replay buffer holding the samples of the most recent K behaviour policies,
(2) a *variance-guided* metric that selects the samples whose distribution matches the current policy, and
(3) a *multi-behaviour* policy-optimisation objective that keeps the K sources apart instead of pooling them into
one behaviour policy. Its knobs are ``replay.enable``, ``replay.k``, ``replay.pmis``, ``replay.warmup`` plus verl's
(pre-November-2025) ``algorithm.rollout_is`` / ``algorithm.rollout_is_threshold``.

**Provenance, read this first.** D-ARL's own code could not be read here (no snapshot of the repository, nothing
in the code / issue indexes; only its README, the ICML abstract and the summary of a related patent application,
CN122241235A: "constructing a reference distribution, samples with small deviations are selected ... a
policy-level weighting mechanism ... optimises the policy using the weighted multi-behaviour sample data", all of
which say *what*, not the formulas). Everything below marked *(inferred)* is therefore a reconstruction from those
descriptions and standard importance-sampling theory, not a transcription of D-ARL; check it against the code
if it becomes available. What is *not* inferred is the mathematics: the balance heuristic is Veach & Guibas'
(SIGGRAPH 1995; Veach's thesis, 1997, ch. 9) and the chi-square identity is textbook.

Notation: pi = current policy (version t), mu_v = behaviour policy of version v in {t-K+1..t}, a sample y from
mu_v has the per-token log ratios l_k = log pi(y_k | .) - log mu_v(y_k | .) (for a dLLM, the same per-token
log-prob estimator evaluated under both policies) and the IS weight rho = exp(sum_k l_k); staleness = t - v.

1. ``ReplayBuffer`` keeps the samples of the last K versions (window [newest - K + 1, newest]), optionally at most
   ``capacity_per_version`` newest samples per version (FIFO inside a version), is ``ready`` once it has seen
   ``warmup`` distinct policy versions (D-ARL's ``replay.warmup``: plain async steps before replay, *(inferred)*),
   and round-trips through ``state_dict`` / ``load_state_dict`` (contents, versions, insertion ids, counters).

2. Variance-guided selection *(inferred)*. Since E_mu[rho] = 1, the variance of the IS weight is
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
   trades bias for variance; the weights of item 3 then correct for *which policy* drew a kept sample.

3. Multi-behaviour objective (``replay.pmis``, *(inferred)* to be multiple importance sampling). Draw n_j samples
   from each q_j = mu_j (n = sum_j n_j, alpha_j = n_j / n). The balance-heuristic estimator of E_p[f] is

       F = (1/n) sum_j sum_{i=1}^{n_j} w(X_ji) f(X_ji),   w(x) = p(x) / sum_j alpha_j q_j(x),

   unbiased whenever the mixture covers p (q_j itself may miss part of p's support), and its variance exceeds
   that of any other MIS weighting by at most (1/min_j n_j - 1/n) E_p[f]^2 (Veach's thesis, ch. 9). It needs each sample's log-prob under *every*
   version in the batch (K extra forwards or K stored models); ``own_behaviour_weights`` is the cheap per-source
   form p / q_{v(x)} (ordinary IS; unbiased for the alpha-mixture only if every q_j covers p). With K = 1 both reduce to ordinary IS, and
   w = 1 when every q_j = p. ``per_version_normalised_advantages`` normalises advantages within each behaviour
   version (D-ARL's "per-version optimisation": every source enters on the same scale) and
   ``per_version_loss_weights`` gives each version a share of the objective (alpha_v by default).

4. ``ReplayBuffer.metrics``: buffer size (total and per staleness), versions held, mean / max staleness of the
   buffer and of the replayed samples, replay fraction, mean score, counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch

SCORES = ("token_chi2", "seq_chi2", "token_k2", "token_k3", "log_ratio_var")
LEVELS = ("sample", "group", "version")
STATE_FORMAT = 1


@dataclass(frozen=True)
class ReplayRule:
    """How ``ReplayBuffer.select`` picks among the scored candidates (``ReplayRule.of(cfg.replay)``): pooling
    ``level`` (sample | group | version), ``temperature`` (0: lowest score first, else Gumbel top-k),
    ``max_score`` (units above it are never taken), ``max_staleness`` (older candidates are not considered),
    ``drop_degenerate_groups`` (groups whose rewards are all equal) and ``consume`` (remove what is selected)."""

    level: str = "sample"
    temperature: float = 0.0
    max_score: Optional[float] = None
    max_staleness: Optional[int] = None
    drop_degenerate_groups: bool = False
    consume: bool = False

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level={self.level!r} unknown; choose one of {LEVELS}")

    @classmethod
    def of(cls, replay) -> "ReplayRule":
        """The rule of config section ``replay`` (replay.level, replay.max_score)."""
        return cls(level=replay.level, max_score=replay.max_score)


@dataclass(frozen=True)
class ReplayMatch:
    """How well each replay candidate matches the current policy, from exactly one of: ``log_ratios`` (per
    candidate, the 1-D per-token log pi - log mu_v; scored with ``variance_guided_scores(kind, log_clamp)``),
    ``scores`` ([N], lower = better matched) or ``score_fn(samples) -> [N]``."""

    log_ratios: Optional[Sequence[torch.Tensor]] = None
    scores: Optional[torch.Tensor] = None
    score_fn: Optional[Callable[[list], torch.Tensor]] = None
    kind: str = "token_chi2"
    log_clamp: float = 20.0

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.log_ratios, self.scores, self.score_fn)) != 1:
            raise ValueError("select needs exactly one of log_ratios, scores, score_fn")

    def scores_of(self, cands: list) -> torch.Tensor:
        """[N] float64 match scores of the candidates (lower = better matched), from whichever input was given."""
        N = len(cands)
        if self.log_ratios is not None:
            if len(self.log_ratios) != N:
                raise ValueError(f"{len(self.log_ratios)} log-ratio rows for {N} candidates (see ReplayBuffer.entries)")
            s = variance_guided_scores(self.log_ratios, kind=self.kind, log_clamp=self.log_clamp)
        elif self.scores is not None:
            s = torch.as_tensor(self.scores, dtype=torch.float64).flatten()
        else:
            s = torch.as_tensor(self.score_fn([e.sample for e in cands]), dtype=torch.float64).flatten()
        if s.numel() != N:
            raise ValueError(f"{s.numel()} scores for {N} candidates")
        return s.to(torch.float64)


# ---------------------------------------------------------------------------------------------------------------
# the buffer
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class ReplayEntry:
    """One stored sample: ``uid`` is its insertion id (the buffer's deterministic order), ``uses`` how many times
    ``select`` has returned it."""

    uid: int
    version: int
    sample: Any
    uses: int = 0


@dataclass
class ReplaySelection:
    """What ``ReplayBuffer.select`` returns (all aligned, best-matched first)."""

    samples: list
    uids: list[int]
    versions: torch.Tensor  # [n] long, behaviour version of each selected sample
    staleness: torch.Tensor  # [n] long, current_version - version
    scores: torch.Tensor  # [n] float64, the pooled score each was selected with (lower = better matched)

    def __len__(self) -> int:
        return len(self.samples)

    def counts(self) -> tuple[list[int], torch.Tensor]:
        """(distinct versions ascending, number of selected samples of each), for the balance heuristic."""
        return version_counts(self.versions)


def sample_version(sample: Any) -> Optional[int]:
    """A sample's behaviour version: its ``policy_version`` (``Trajectory``, ``RLSample``); None if it has none."""
    v = getattr(sample, "policy_version", None)
    return None if v is None else int(v)


class ReplayBuffer:
    """Samples of the last ``k`` behaviour-policy versions.

    ``add(samples, version)`` stores samples under ``version`` (or each sample's own version when ``version`` is
    None), then evicts every version older than ``newest - k + 1`` (oldest first) and, with
    ``capacity_per_version``, the oldest-inserted samples of a version beyond that many. Samples of a version
    already outside the window are refused (counted in ``n_refused``). ``ready`` is True once ``warmup``
    distinct versions have been added (0: at once). Stored samples can be any picklable objects.
    """

    def __init__(self, k: int, warmup: int = 0, capacity_per_version: Optional[int] = None):
        if k < 1:
            raise ValueError(f"replay.k={k} must be >= 1")
        if warmup < 0:
            raise ValueError(f"replay.warmup={warmup} must be >= 0")
        if capacity_per_version is not None and capacity_per_version < 1:
            raise ValueError(f"capacity_per_version={capacity_per_version} must be >= 1 (or None)")
        self.k = int(k)
        self.warmup = int(warmup)
        self.capacity_per_version = capacity_per_version
        self._store: dict[int, list[ReplayEntry]] = {}
        self._next_uid = 0
        self._seen: set[int] = set()
        self.newest: Optional[int] = None
        self.n_added = 0
        self.n_evicted = 0
        self.n_refused = 0
        self.n_selected = 0
        self.n_select_calls = 0

    # ---- contents -------------------------------------------------------------------------------------------
    @property
    def versions(self) -> list[int]:
        """Versions held, ascending."""
        return sorted(v for v, es in self._store.items() if es)

    @property
    def ready(self) -> bool:
        return len(self._seen) >= self.warmup

    @property
    def versions_seen(self) -> int:
        return len(self._seen)

    def __len__(self) -> int:
        return sum(len(es) for es in self._store.values())

    def entries(self, current_version: Optional[int] = None, max_staleness: Optional[int] = None) -> list[ReplayEntry]:
        """Stored entries in deterministic order (version ascending, then insertion). With ``max_staleness`` only
        those with ``current_version - version <= max_staleness``. ``select``'s candidates are exactly these."""
        out = [e for v in self.versions for e in self._store[v]]
        if max_staleness is not None:
            if current_version is None:
                raise ValueError("max_staleness needs current_version")
            out = [e for e in out if current_version - e.version <= max_staleness]
        return out

    def samples(self, version: Optional[int] = None) -> list:
        if version is not None:
            return [e.sample for e in self._store.get(version, [])]
        return [e.sample for e in self.entries()]

    def size_per_version(self) -> dict[int, int]:
        return {v: len(self._store[v]) for v in self.versions}

    # ---- adding / evicting ----------------------------------------------------------------------------------
    def add(self, samples: Iterable[Any], version: Optional[int] = None) -> int:
        """Store ``samples`` (behaviour version ``version``, or each sample's own), evict, return how many were
        stored (refused ones excluded; capacity evictions may then drop some of them again)."""
        items = list(samples)
        groups: dict[int, list[Any]] = {}
        for s in items:
            v = version if version is not None else sample_version(s)
            if v is None:
                raise ValueError(
                    "ReplayBuffer.add: no version given and the sample has no policy_version (policy_version)"
                )
            groups.setdefault(int(v), []).append(s)
        stored = 0
        for v in sorted(groups):
            self._seen.add(v)
            self.newest = v if self.newest is None else max(self.newest, v)
        for v in sorted(groups):
            if v < self.newest - self.k + 1:
                self.n_refused += len(groups[v])
                continue
            bucket = self._store.setdefault(v, [])
            for s in groups[v]:
                bucket.append(ReplayEntry(self._next_uid, v, s))
                self._next_uid += 1
            stored += len(groups[v])
        self.n_added += stored
        self._evict()
        return stored

    def _evict(self) -> None:
        if self.newest is None:
            return
        oldest_kept = self.newest - self.k + 1
        for v in sorted(self._store):
            if v < oldest_kept:
                self.n_evicted += len(self._store.pop(v))
        if self.capacity_per_version is not None:
            for v, es in self._store.items():
                extra = len(es) - self.capacity_per_version
                if extra > 0:
                    del es[:extra]
                    self.n_evicted += extra
        for v in [v for v, es in self._store.items() if not es]:
            del self._store[v]

    def remove(self, uids: Iterable[int]) -> int:
        """Drop the entries with these uids (e.g. samples consumed); returns how many were found."""
        drop = set(uids)
        n = 0
        for v in list(self._store):
            keep = [e for e in self._store[v] if e.uid not in drop]
            n += len(self._store[v]) - len(keep)
            if keep:
                self._store[v] = keep
            else:
                del self._store[v]
        return n

    def clear(self) -> None:
        self._store.clear()

    # ---- staleness ------------------------------------------------------------------------------------------
    def staleness(self, current_version: int) -> torch.Tensor:
        """[N] long, ``current_version - version`` of every entry (``entries()`` order)."""
        st = torch.tensor([current_version - e.version for e in self.entries()], dtype=torch.long)
        if st.numel() and int(st.min()) < 0:
            raise ValueError(f"current_version={current_version} is older than a stored sample (version {self.newest})")
        return st

    def staleness_histogram(self, current_version: int) -> dict[int, int]:
        """{staleness: number of stored samples}, staleness ascending, empty staleness values left out."""
        hist: dict[int, int] = {}
        for d in self.staleness(current_version).tolist():
            hist[d] = hist.get(d, 0) + 1
        return dict(sorted(hist.items()))

    # ---- selection ------------------------------------------------------------------------------------------
    def select(
        self,
        n: int,
        current_version: int,
        match: ReplayMatch,
        rule: ReplayRule = ReplayRule(),
        generator: Optional[torch.Generator] = None,
    ) -> ReplaySelection:
        """Pick up to ``n`` replayed samples whose behaviour distribution best matches the current policy.

        The candidates are ``entries(current_version, rule.max_staleness)`` in that order; ``match`` scores them
        (``ReplayMatch``: per-candidate log-ratios, scores or a score function; lower = better matched).
        ``rule.level='group'`` pools scores by prompt group (key (version, sample.group), the group mean) and
        keeps groups whole; ``level='version'`` pools per behaviour version. Pooled units are taken lowest score
        first (``rule.temperature == 0``; ties broken by a ``generator`` permutation) or Gumbel-top-k with logits
        -score/temperature, until ``n`` samples are filled (a whole group/version that would overflow ``n`` is
        skipped in favour of later ones that fit). Units with score > ``rule.max_score`` (or a non-finite score)
        are never taken, so fewer than ``n`` may come back. ``rule.drop_degenerate_groups`` removes groups whose
        rewards are all equal. ``rule.consume`` removes the selected samples from the buffer. Deterministic given
        ``generator`` (and the buffer's contents).
        """
        if n < 0:
            raise ValueError(f"n={n} must be >= 0")
        cands = self.entries(current_version, rule.max_staleness)
        if any(current_version < e.version for e in cands):
            raise ValueError(f"current_version={current_version} is older than a stored sample")
        s = match.scores_of(cands)
        units, u_score = _scored_units(cands, s, rule.level, rule.drop_degenerate_groups, rule.max_score)
        chosen, pooled = _fill(units, u_score, _order(u_score, rule.temperature, generator), n)
        picked = [cands[i] for i in chosen]
        for e in picked:
            e.uses += 1
        self.n_selected += len(picked)
        self.n_select_calls += 1
        if rule.consume:
            self.remove(e.uid for e in picked)
        versions = torch.tensor([e.version for e in picked], dtype=torch.long)
        return ReplaySelection(
            samples=[e.sample for e in picked],
            uids=[e.uid for e in picked],
            versions=versions,
            staleness=current_version - versions,
            scores=torch.tensor(pooled, dtype=torch.float64),
        )

    # ---- health ---------------------------------------------------------------------------------------------
    def metrics(
        self,
        current_version: int,
        selection: Optional[ReplaySelection] = None,
        n_fresh: int = 0,
        prefix: str = "replay/",
    ) -> dict[str, float]:
        """Buffer health: size, versions held, per-staleness sizes, mean / max staleness; with a ``selection``
        also the replayed samples' staleness, mean score and ``replay_fraction`` = replayed / (replayed +
        ``n_fresh``) of the training batch they join."""
        st = self.staleness(current_version)
        m: dict[str, float] = {
            "size": float(len(self)),
            "versions": float(len(self.versions)),
            "ready": float(self.ready),
            "staleness_mean": float(st.double().mean()) if st.numel() else 0.0,
            "staleness_max": float(st.max()) if st.numel() else 0.0,
            "added": float(self.n_added),
            "evicted": float(self.n_evicted),
            "refused": float(self.n_refused),
            "selected_total": float(self.n_selected),
        }
        for d, c in self.staleness_histogram(current_version).items():
            m[f"size_stale{d}"] = float(c)
        if selection is not None:
            r = len(selection)
            m["replayed"] = float(r)
            m["replay_fraction"] = r / (r + n_fresh) if r + n_fresh else 0.0
            m["replayed_staleness_mean"] = float(selection.staleness.double().mean()) if r else 0.0
            m["replayed_staleness_max"] = float(selection.staleness.max()) if r else 0.0
            m["replayed_score_mean"] = float(selection.scores.mean()) if r else 0.0
        return {prefix + k: v for k, v in m.items()}

    # ---- checkpoint -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state: config, entries as (uid, version, uses, sample) tuples in ``entries()`` order,
        versions seen, counters. The samples are stored as they are (they must pickle; with ``torch.load`` use
        ``weights_only=False`` for non-tensor samples such as ``RLSample``)."""
        return {
            "format": STATE_FORMAT,
            "k": self.k,
            "warmup": self.warmup,
            "capacity_per_version": self.capacity_per_version,
            "entries": [(e.uid, e.version, e.uses, e.sample) for e in self.entries()],
            "next_uid": self._next_uid,
            "seen": sorted(self._seen),
            "newest": self.newest,
            "counters": {
                "n_added": self.n_added,
                "n_evicted": self.n_evicted,
                "n_refused": self.n_refused,
                "n_selected": self.n_selected,
                "n_select_calls": self.n_select_calls,
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore contents, versions and counters. ``k`` / ``warmup`` / ``capacity_per_version`` stay this
        buffer's own (the run's config wins); if they shrank, the restored contents are evicted down to them."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"replay buffer state format {state.get('format')!r}, expected {STATE_FORMAT}")
        self._store = {}
        for uid, v, uses, sample in state["entries"]:
            self._store.setdefault(int(v), []).append(ReplayEntry(int(uid), int(v), sample, int(uses)))
        for es in self._store.values():
            es.sort(key=lambda e: e.uid)
        self._next_uid = int(state["next_uid"])
        self._seen = set(int(v) for v in state["seen"])
        self.newest = None if state["newest"] is None else int(state["newest"])
        c = state["counters"]
        self.n_added, self.n_evicted, self.n_refused = int(c["n_added"]), int(c["n_evicted"]), int(c["n_refused"])
        self.n_selected, self.n_select_calls = int(c["n_selected"]), int(c["n_select_calls"])
        self._evict()


def _degenerate_group_mask(cands: Sequence[ReplayEntry]) -> torch.Tensor:
    """True for candidates whose prompt group (key (version, sample.group)) has all-equal rewards among the
    stored candidates (a lone response included: no group-baseline signal). Samples without ``reward`` are
    never degenerate."""
    rewards: dict[Any, list[float]] = {}
    for e in cands:
        r = getattr(e.sample, "reward", None)
        if r is not None:
            rewards.setdefault((e.version, int(getattr(e.sample, "group", 0))), []).append(float(r))
    out = torch.zeros(len(cands), dtype=torch.bool)
    for i, e in enumerate(cands):
        if getattr(e.sample, "reward", None) is None:
            continue
        rs = rewards[(e.version, int(getattr(e.sample, "group", 0)))]
        out[i] = max(rs) == min(rs)
    return out


def _order(score: torch.Tensor, temperature: float, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Unit order: ascending score with generator-random tie-breaks, or Gumbel-top-k on -score/temperature."""
    m = score.numel()
    if m == 0:
        return torch.zeros(0, dtype=torch.long)
    perm = torch.randperm(m, generator=generator)
    if temperature > 0:
        u = torch.rand(m, generator=generator, dtype=torch.float64).clamp(1e-300, 1.0 - 1e-16)
        key = -score[perm] / temperature - torch.log(-torch.log(u))  # larger = earlier
        return perm[torch.sort(-key, stable=True).indices]
    return perm[torch.sort(score[perm], stable=True).indices]


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
    "ReplayBuffer",
    "ReplayEntry",
    "ReplaySelection",
    "ReplayRule",
    "ReplayMatch",
    "SCORES",
    "LEVELS",
    "sample_version",
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


def _scored_units(
    cands: list, s: torch.Tensor, level: str, drop_degenerate_groups: bool, max_score: Optional[float]
) -> tuple[list[list[int]], torch.Tensor]:
    """Selection units (lists of candidate positions: a sample, a prompt group or a behaviour version) with
    their pooled (mean) score; units with a non-finite score or one above ``max_score`` are left out."""
    keep = torch.ones(len(cands), dtype=torch.bool)
    if drop_degenerate_groups:
        keep &= ~_degenerate_group_mask(cands)
    if level == "sample":
        units = [[i] for i in range(len(cands)) if keep[i]]
    else:
        key = (
            (lambda e: e.version) if level == "version" else (lambda e: (e.version, int(getattr(e.sample, "group", 0))))
        )
        by: dict[Any, list[int]] = {}
        for i, e in enumerate(cands):
            if keep[i]:
                by.setdefault(key(e), []).append(i)
        units = list(by.values())
    u_score = torch.tensor([float(s[u].mean()) for u in units], dtype=torch.float64)
    ok = torch.isfinite(u_score)
    if max_score is not None:
        ok &= u_score <= max_score
    return [u for u, good in zip(units, ok.tolist()) if good], u_score[ok]


def _fill(units: list[list[int]], u_score: torch.Tensor, order: torch.Tensor, n: int) -> tuple[list[int], list[float]]:
    """Take units in ``order`` until ``n`` samples are filled, skipping a unit that would overflow ``n``.
    Returns (candidate positions, the pooled score of each)."""
    chosen: list[int] = []
    pooled: list[float] = []
    for j in order.tolist():
        if len(chosen) >= n:
            break
        u = units[j]
        if len(chosen) + len(u) > n:
            continue
        chosen.extend(u)
        pooled.extend([float(u_score[j])] * len(u))
    return chosen, pooled
