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

2. ``ReplayBuffer.select`` keeps the candidates whose variance-guided score (replay_scores.py: the formulas,
   *(inferred)*) is lowest; the multi-behaviour weights that correct for which policy drew a kept sample live
   there too.

3. ``ReplayBuffer.metrics``: buffer size (total and per staleness), versions held, mean / max staleness of the
   buffer and of the replayed samples, replay fraction, mean score, counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from megadare.trainer.offpolicy.replay_scores import variance_guided_scores, version_counts

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


__all__ = [
    "ReplayBuffer",
    "ReplayEntry",
    "ReplaySelection",
    "ReplayRule",
    "ReplayMatch",
    "LEVELS",
    "sample_version",
]
