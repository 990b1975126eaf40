"""Replay over the last K behaviour policies: bookkeeping, checkpoint round trip, balance-heuristic MIS, selection."""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import pickle
from dataclasses import dataclass
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from megadare.algos.base import STEP_WIDTH, RLSample
from megadare.algos.tracerl import stamp_step_width
from megadare.config import Config
from megadare.data.rows import MicroBatch
from megadare.rollout.engine import SamplingParams, Trajectory
from megadare.trainer.offpolicy import correction
from megadare.trainer.offpolicy.correction import (
    correction_weights,
    oldest_needed,
    reindex,
    store_behaviour,
    with_replayed,
)
from megadare.trainer.offpolicy.queue import WeightSnapshots
from megadare.trainer.offpolicy.replay import ReplayBuffer, ReplayMatch, ReplayRule, sample_version
from megadare.trainer.offpolicy.replay_scores import (
    balance_heuristic_weights,
    chi2_ess,
    variance_guided_scores,
)
from megadare.trainer.rl_update import Correction, scoring_copies, scoring_correction


def own_behaviour_weights(target_logp: torch.Tensor, behaviour_logp: torch.Tensor) -> torch.Tensor:
    """Per-source (ordinary) IS weights p(x_i) / q_{v(i)}(x_i) against each sample's own behaviour policy: the
    balance heuristic with K = 1 (unbiased for the alpha-mixture only when every q_j covers p)."""
    return balance_heuristic_weights(target_logp, torch.as_tensor(behaviour_logp).flatten().unsqueeze(0), torch.ones(1))


@dataclass
class Item:
    name: str
    policy_version: int
    group: int = 0
    reward: float = 0.0


def _fill(buf: ReplayBuffer, versions, per: int = 2) -> None:
    for v in versions:
        buf.add([f"v{v}s{i}" for i in range(per)], version=v)


# ---------------------------------------------------------------------------------------------------------------
# bookkeeping
# ---------------------------------------------------------------------------------------------------------------


def test_keeps_exactly_last_k_versions_oldest_evicted_first():
    buf = ReplayBuffer(k=3)
    held = []
    for v in range(6):
        _fill(buf, [v])
        held.append(buf.versions)
    assert held == [[0], [0, 1], [0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5]]
    assert buf.samples() == [f"v{v}s{i}" for v in (3, 4, 5) for i in range(2)]
    assert (buf.n_added, buf.n_evicted, len(buf)) == (12, 6, 6)
    # a version already outside the window is refused; one inside it (out of order) is accepted
    assert buf.add(["late"], version=2) == 0 and buf.n_refused == 1
    assert buf.add(["late4"], version=4) == 1
    assert buf.samples(4) == ["v4s0", "v4s1", "late4"]
    # a jump of several versions evicts everything older than newest - k + 1
    _fill(buf, [9])
    assert buf.versions == [9] and len(buf) == 2
    # the window follows the newest version added, in one call with several versions too
    buf2 = ReplayBuffer(k=2)
    buf2.add([Item("a", 0), Item("b", 1), Item("c", 2), Item("d", 1)])
    assert buf2.versions == [1, 2] and [s.name for s in buf2.samples()] == ["b", "d", "c"]
    assert buf2.n_refused == 1


def test_capacity_per_version_is_fifo_and_versions_come_from_samples():
    buf = ReplayBuffer(k=2, capacity_per_version=2)
    s = [RLSample([1], [2], reward=float(i), advantage=0.0, index=i, policy_version=7) for i in range(3)]
    assert sample_version(s[0]) == 7 and sample_version(Item("x", 3)) == 3 and sample_version("x") is None
    buf.add(s)
    assert [x.index for x in buf.samples(7)] == [1, 2] and buf.n_evicted == 1
    with pytest.raises(ValueError, match="no version"):
        buf.add(["no version"])


def test_warmup_gating_counts_distinct_versions():
    buf = ReplayBuffer(k=2, warmup=3)
    readiness = []
    for v in (0, 0, 1, 2, 3):
        _fill(buf, [v])
        readiness.append(buf.ready)
    assert readiness == [False, False, False, True, True]  # re-adding version 0 does not count
    assert buf.versions_seen == 4 and buf.versions == [2, 3]  # evicted versions still count as seen
    assert ReplayBuffer(k=1, warmup=0).ready


def test_staleness_values_and_histogram():
    buf = ReplayBuffer(k=3)
    for v, per in ((3, 1), (4, 2), (5, 3)):
        _fill(buf, [v], per)
    assert buf.staleness(6).tolist() == [3, 2, 2, 1, 1, 1]
    assert buf.staleness_histogram(6) == {1: 3, 2: 2, 3: 1}
    assert buf.staleness_histogram(5) == {0: 3, 1: 2, 2: 1}
    assert buf.size_per_version() == {3: 1, 4: 2, 5: 3}
    m = buf.metrics(6)
    assert m["replay/size"] == 6 and m["replay/staleness_max"] == 3
    assert m["replay/staleness_mean"] == pytest.approx(10 / 6)
    assert (m["replay/size_stale1"], m["replay/size_stale2"], m["replay/size_stale3"]) == (3, 2, 1)
    assert [e.version for e in buf.entries(6, max_staleness=2)] == [4, 4, 5, 5, 5]
    with pytest.raises(ValueError, match="older than"):
        buf.staleness(4)


# ---------------------------------------------------------------------------------------------------------------
# checkpoint / resume
# ---------------------------------------------------------------------------------------------------------------


def _rl_buffer(seed: int = 0) -> ReplayBuffer:
    g = torch.Generator().manual_seed(seed)
    buf = ReplayBuffer(k=3, warmup=2, capacity_per_version=6)
    for v in range(5):
        batch = []
        for i in range(8):
            L = int(torch.randint(2, 6, (1,), generator=g))
            lr = (0.05 if i % 2 else 0.8) * torch.randn(L, generator=g)
            batch.append(
                RLSample(
                    list(range(3)),
                    list(range(L)),
                    reward=float(i % 3 == 0),
                    advantage=0.1 * i,
                    index=i,
                    group=i // 4,
                    extra={"log_ratio": lr},
                )
            )
        buf.add(batch, version=v)
    return buf


def _lr(buf: ReplayBuffer, current: int, max_staleness=None):
    """Per-candidate token log ratios, aligned with ``buf.entries(current, max_staleness)`` as ``select`` wants."""
    return [e.sample.extra["log_ratio"] for e in buf.entries(current, max_staleness)]


@pytest.mark.parametrize("via", ["pickle", "torch"])
def test_state_dict_round_trip_restores_selection_and_staleness(via):
    buf = _rl_buffer()
    buf.select(3, 5, ReplayMatch(log_ratios=_lr(buf, 5)), generator=torch.Generator().manual_seed(1))  # counters move
    state = buf.state_dict()
    if via == "pickle":
        state = pickle.loads(pickle.dumps(state))
    else:
        f = io.BytesIO()
        torch.save(state, f)
        f.seek(0)
        state = torch.load(f, weights_only=False)
    new = ReplayBuffer(k=3, warmup=2, capacity_per_version=6)
    new.load_state_dict(state)

    assert new.versions == buf.versions == [2, 3, 4]
    assert new.ready and new.versions_seen == buf.versions_seen == 5
    assert torch.equal(new.staleness(6), buf.staleness(6))
    assert new.staleness_histogram(6) == buf.staleness_histogram(6)
    assert new.metrics(6) == buf.metrics(6)
    assert [e.uses for e in new.entries()] == [e.uses for e in buf.entries()]
    for temperature, level in ((0.0, "sample"), (0.5, "sample"), (0.0, "group")):
        a = buf.select(
            5,
            6,
            ReplayMatch(log_ratios=_lr(buf, 6, 3)),
            ReplayRule(temperature=temperature, level=level, max_staleness=3),
            generator=torch.Generator().manual_seed(7),
        )
        b = new.select(
            5,
            6,
            ReplayMatch(log_ratios=_lr(new, 6, 3)),
            ReplayRule(temperature=temperature, level=level, max_staleness=3),
            generator=torch.Generator().manual_seed(7),
        )
        assert a.uids == b.uids and len(a) > 0
        assert [s.index for s in a.samples] == [s.index for s in b.samples]
        assert torch.equal(a.versions, b.versions) and torch.equal(a.staleness, b.staleness)
        assert torch.equal(a.scores, b.scores)
    # the restored buffer keeps going identically (insertion ids, eviction)
    for x in (buf, new):
        x.add(["fresh"], version=5)
    assert [e.uid for e in buf.entries()] == [e.uid for e in new.entries()]
    assert new.versions == [3, 4, 5] and new.n_evicted == buf.n_evicted
    # a smaller k on resume evicts down to it
    small = ReplayBuffer(k=1)
    small.load_state_dict(buf.state_dict())
    assert small.versions == [5]


# ---------------------------------------------------------------------------------------------------------------
# balance heuristic, exact enumeration
# ---------------------------------------------------------------------------------------------------------------


def _log(x: float) -> float:
    return math.log(x) if x > 0 else float("-inf")


def _exact_mixture_expectation(p, qs, counts, f, weight_fn):
    """E over the joint draw of counts[j] i.i.d. samples from each qs[j] of (1/n) sum_samples w f, enumerating
    every joint outcome (no Monte Carlo). ``weight_fn(xs, sources) -> w [n]``."""
    plan = [j for j, c in enumerate(counts) for _ in range(c)]  # the source of each sample slot
    n, M = len(plan), len(p)
    total, mass = 0.0, 0.0
    for xs in itertools.product(range(M), repeat=n):
        prob = math.prod(qs[j][x] for j, x in zip(plan, xs))
        if prob == 0:
            continue
        w = weight_fn(list(xs), plan)
        total += prob * sum(float(w[i]) * f[x] for i, x in enumerate(xs)) / n
        mass += prob
    assert mass == pytest.approx(1.0, abs=1e-12)
    return total


def _bh(p, qs, counts):
    def weight_fn(xs, plan):
        target = torch.tensor([_log(p[x]) for x in xs], dtype=torch.float64)
        beh = torch.tensor([[_log(q[x]) for x in xs] for q in qs], dtype=torch.float64)
        return balance_heuristic_weights(target, beh, torch.tensor(counts))

    return weight_fn


def _own(p, qs):
    def weight_fn(xs, plan):
        target = torch.tensor([_log(p[x]) for x in xs], dtype=torch.float64)
        beh = torch.tensor([_log(qs[j][x]) for j, x in zip(plan, xs)], dtype=torch.float64)
        return own_behaviour_weights(target, beh)

    return weight_fn


CASES = [
    # p, behaviour q_j, counts n_j, f
    (
        [Fraction(1, 2), Fraction(3, 10), Fraction(1, 5)],
        [[Fraction(7, 10), Fraction(3, 10), Fraction(0)], [Fraction(1, 10), Fraction(1, 5), Fraction(7, 10)]],
        [2, 1],
        [Fraction(1), Fraction(-2), Fraction(5)],
    ),
    (
        [Fraction(1, 4), Fraction(1, 4), Fraction(1, 4), Fraction(1, 4)],
        [
            [Fraction(1, 2), Fraction(1, 2), Fraction(0), Fraction(0)],
            [Fraction(0), Fraction(1, 3), Fraction(1, 3), Fraction(1, 3)],
            [Fraction(1, 10), Fraction(2, 10), Fraction(3, 10), Fraction(4, 10)],
        ],
        [1, 2, 1],
        [Fraction(3), Fraction(0), Fraction(-1), Fraction(7, 2)],
    ),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_balance_heuristic_is_unbiased_by_enumeration(case):
    p, qs, counts, f = CASES[case]
    exact = sum(pi * fi for pi, fi in zip(p, f))  # E_p[f] as an exact fraction
    pf, qf, ff = [float(x) for x in p], [[float(x) for x in q] for q in qs], [float(x) for x in f]
    got = _exact_mixture_expectation(pf, qf, counts, ff, _bh(pf, qf, counts))
    assert got == pytest.approx(float(exact), abs=1e-12)
    # the mixture covers p although single q_j do not: per-source IS against the own policy is then biased
    own = _exact_mixture_expectation(pf, qf, counts, ff, _own(pf, qf))
    assert abs(own - float(exact)) > 1e-2
    # the weights are exactly p / sum_j (n_j/n) q_j (checked in fractions)
    n = sum(counts)
    for x in range(len(p)):
        mix = sum(Fraction(c, n) * q[x] for c, q in zip(counts, qs))
        w = balance_heuristic_weights(
            torch.tensor([_log(pf[x])], dtype=torch.float64),
            torch.tensor([[_log(q[x])] for q in qf], dtype=torch.float64),
            torch.tensor(counts),
        )
        assert float(w) == pytest.approx(float(p[x] / mix), rel=1e-12)


def test_balance_heuristic_is_unbiased_on_the_exact_toy_dllm():
    """Three versions of the toy dLLM (algo_toy.Toy seeds 0, 1 = behaviour policies, 2 = the current policy) over
    the 27 responses of length 3: every probability is the toy's exact any-order generative likelihood
    (enumerated orders, sums to 1), every joint draw of one sample per behaviour policy is enumerated, and the
    balance-heuristic estimate (1/n) sum w f with w = p / sum_j (n_j/n) q_j equals E_p[f] exactly; the naive
    estimate without weights does not."""
    from algo_toy import Exact, Toy

    c = [1, 2]
    ys = list(itertools.product(range(3), repeat=3))

    def dist(seed):
        return [math.exp(Exact(Toy(seed), c, list(y)).loglik()) for y in ys]

    q0, q1, p = dist(0), dist(1), dist(2)
    for d in (q0, q1, p):
        assert sum(d) == pytest.approx(1.0, abs=1e-12)
    f = [float(sum(y)) - 2.0 * y[0] * y[2] for y in ys]  # any function of the response (a reward)
    exact = sum(pi * fi for pi, fi in zip(p, f))
    got = _exact_mixture_expectation(p, [q0, q1], [1, 1], f, _bh(p, [q0, q1], [1, 1]))
    assert got == pytest.approx(exact, abs=1e-12)
    naive = _exact_mixture_expectation(p, [q0, q1], [1, 1], f, lambda xs, plan: torch.ones(len(xs)))
    assert abs(naive - exact) > 1e-3


def test_per_source_is_unbiased_too_when_every_behaviour_covers_p():
    p = [0.2, 0.5, 0.3]
    qs = [[0.6, 0.2, 0.2], [0.1, 0.1, 0.8]]
    f = [2.0, -1.0, 4.0]
    exact = sum(a * b for a, b in zip(p, f))
    assert _exact_mixture_expectation(p, qs, [1, 2], f, _own(p, qs)) == pytest.approx(exact, abs=1e-12)
    assert _exact_mixture_expectation(p, qs, [1, 2], f, _bh(p, qs, [1, 2])) == pytest.approx(exact, abs=1e-12)


def test_balance_heuristic_special_cases():
    g = torch.Generator().manual_seed(0)
    target = torch.randn(16, generator=g, dtype=torch.float64)
    beh = torch.randn(16, generator=g, dtype=torch.float64)
    # one behaviour policy: ordinary IS, whatever its count
    for c in (1, 5):
        w = balance_heuristic_weights(target, beh.unsqueeze(0), torch.tensor([c]))
        assert torch.allclose(w, torch.exp(target - beh), rtol=1e-12)
    assert torch.allclose(own_behaviour_weights(target, beh), torch.exp(target - beh), rtol=1e-12)
    # every q_j == p: w == 1
    w = balance_heuristic_weights(target, target.expand(3, 16), torch.tensor([1, 4, 2]))
    assert torch.allclose(w, torch.ones(16, dtype=torch.float64), atol=1e-12)
    # a zero count removes that policy from the mixture; scaling all counts changes nothing
    other = torch.randn(16, generator=g, dtype=torch.float64)
    both = torch.stack([beh, other])
    assert torch.allclose(
        balance_heuristic_weights(target, both, torch.tensor([3, 0])), torch.exp(target - beh), rtol=1e-12
    )
    assert torch.allclose(
        balance_heuristic_weights(target, both, torch.tensor([1, 2])),
        balance_heuristic_weights(target, both, torch.tensor([10, 20])),
        rtol=1e-12,
    )
    # truncation caps, float32 in -> float32 out
    w = balance_heuristic_weights(target.float(), both.float(), torch.tensor([1, 1]), threshold=1.5)
    assert w.dtype == torch.float32 and float(w.max()) <= 1.5
    with pytest.raises(ValueError, match="must be"):
        balance_heuristic_weights(target, both, torch.tensor([1, 1, 1]))


# ---------------------------------------------------------------------------------------------------------------
# selection
# ---------------------------------------------------------------------------------------------------------------


def _matched_buffer():
    """4 versions x 8 samples; odd samples' behaviour matches the current policy (tiny log ratios), even ones
    do not (log ratios of spread 0.7 and shift 0.3)."""
    g = torch.Generator().manual_seed(3)
    buf = ReplayBuffer(k=4)
    lrs = {}
    for v in range(4):
        items = []
        for i in range(8):
            matched = i % 2 == 1
            lr = (0.01 * torch.randn(6, generator=g)) if matched else (0.3 + 0.7 * torch.randn(6, generator=g))
            it = Item(f"v{v}i{i}{'m' if matched else 'x'}", v, group=i // 2, reward=float(i % 4 == 1))
            lrs[it.name] = lr
            items.append(it)
        buf.add(items)
    return buf, lrs


def test_selection_prefers_matched_samples_and_is_deterministic():
    buf, lrs = _matched_buffer()
    lr = [lrs[e.sample.name] for e in buf.entries()]
    for kind in ("token_chi2", "token_k2", "token_k3", "log_ratio_var"):
        sel = buf.select(16, 4, ReplayMatch(log_ratios=lr, kind=kind), generator=torch.Generator().manual_seed(0))
        assert len(sel) == 16 and all(s.name.endswith("m") for s in sel.samples), kind
        assert bool((sel.scores[1:] >= sel.scores[:-1]).all())  # best matched first
        assert sel.staleness.tolist() == (4 - sel.versions).tolist()
    # the sequence-level weight only sees sum_k l_k, so a mismatched sample whose token ratios cancel looks
    # matched to it (its sequence weight is ~1): most, not all, of its picks are the matched samples
    seq = buf.select(16, 4, ReplayMatch(log_ratios=lr, kind="seq_chi2"), generator=torch.Generator().manual_seed(0))
    assert sum(s.name.endswith("m") for s in seq.samples) >= 14
    # deterministic with a seed, for greedy and stochastic (Gumbel top-k) selection
    for temperature in (0.0, 0.05):
        a = buf.select(
            10,
            4,
            ReplayMatch(log_ratios=lr),
            ReplayRule(temperature=temperature),
            generator=torch.Generator().manual_seed(5),
        )
        b = buf.select(
            10,
            4,
            ReplayMatch(log_ratios=lr),
            ReplayRule(temperature=temperature),
            generator=torch.Generator().manual_seed(5),
        )
        assert a.uids == b.uids
    soft = buf.select(
        16, 4, ReplayMatch(log_ratios=lr), ReplayRule(temperature=0.05), generator=torch.Generator().manual_seed(5)
    )
    assert sum(s.name.endswith("m") for s in soft.samples) >= 14
    # ties are broken by the generator: same seed same order, some other seed another order
    flat = torch.zeros(len(buf), dtype=torch.float64)
    orders = {
        tuple(buf.select(5, 4, ReplayMatch(scores=flat), generator=torch.Generator().manual_seed(s)).uids)
        for s in range(4)
    }
    assert len(orders) > 1
    assert (
        buf.select(5, 4, ReplayMatch(scores=flat), generator=torch.Generator().manual_seed(2)).uids
        == buf.select(5, 4, ReplayMatch(scores=flat), generator=torch.Generator().manual_seed(2)).uids
    )
    # metrics of the batch the selection joins
    m = buf.metrics(4, selection=sel, n_fresh=48)
    assert m["replay/replay_fraction"] == pytest.approx(0.25) and m["replay/replayed"] == 16
    assert m["replay/replayed_staleness_max"] == float(sel.staleness.max())


def test_selection_levels_thresholds_and_filters():
    buf, lrs = _matched_buffer()
    lr = [lrs[e.sample.name] for e in buf.entries()]
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    # group level keeps (version, group) pairs whole; every group mixes one matched and one mismatched sample
    sel = buf.select(6, 4, ReplayMatch(log_ratios=lr), ReplayRule(level="group"), generator=gen())
    keys = [(int(v), s.group) for v, s in zip(sel.versions, sel.samples)]
    assert len(sel) == 6 and all(keys.count(k) == 2 for k in keys)
    # version level: the one behaviour policy that matches everywhere wins as a whole
    lr_v = [torch.zeros(4) if e.version == 2 else lrs[e.sample.name] for e in buf.entries()]
    sel = buf.select(8, 4, ReplayMatch(log_ratios=lr_v), ReplayRule(level="version"), generator=gen())
    assert sel.versions.tolist() == [2] * 8
    # max_score rejects the mismatched ones even when n asks for more
    sel = buf.select(32, 4, ReplayMatch(log_ratios=lr), ReplayRule(max_score=0.01), generator=gen())
    assert len(sel) == 16 and all(s.name.endswith("m") for s in sel.samples)
    # groups with all-equal rewards (no signal) are dropped: rewards are 1 only at i % 4 == 1
    sel = buf.select(32, 4, ReplayMatch(log_ratios=lr), ReplayRule(drop_degenerate_groups=True), generator=gen())
    assert sorted({s.group for s in sel.samples}) == [0, 2]
    # staleness cap, score_fn, consume
    sel = buf.select(
        32,
        4,
        ReplayMatch(score_fn=lambda ss: torch.tensor([float(s.name.endswith("x")) for s in ss])),
        ReplayRule(max_staleness=2, consume=True),
        generator=gen(),
    )
    assert sorted(set(sel.versions.tolist())) == [2, 3] and len(sel) == 16 and len(buf) == 16
    assert buf.versions == [0, 1]
    with pytest.raises(ValueError, match="exactly one"):
        buf.select(2, 4, ReplayMatch(), generator=gen())
    with pytest.raises(ValueError, match="candidates"):
        buf.select(2, 4, ReplayMatch(log_ratios=lr), generator=gen())


def _step_samples(version: int, prompts: int = 3, n: int = 2) -> list[RLSample]:
    """One RL step's fresh samples: ``prompts`` groups of ``n``, prompt p's ids [version, p]."""
    return [
        RLSample([version, p], [1], 0.0, 0.0, index=p * n + i, group=p, policy_version=version)
        for p in range(prompts)
        for i in range(n)
    ]


@pytest.mark.parametrize("ahead,flat", [(0, {2}), (1, {2, 3})])
def test_every_version_the_buffer_holds_keeps_its_weight_snapshot(ahead, flat):
    """rl.generate's order: prune the weight snapshots to ``oldest_needed``, snapshot this step's weights, replay
    from the buffer (a behaviour pass under each candidate's version), add the step's samples (rollouts ``ahead``
    versions old). A step that collected nothing (``flat``: every group filtered) adds no version, so the buffer
    (k=2, its window counted from its newest version) still held version 0 after the bound step - ahead - k had
    dropped its snapshot: the replay's behaviour pass raised 'no weight snapshot of policy version 0'."""
    cfg = SimpleNamespace(replay=SimpleNamespace(k=2, enable=True))
    buf, snaps = ReplayBuffer(k=2), WeightSnapshots([torch.nn.Linear(2, 2)])
    for step in range(6):
        snaps.keep_from(oldest_needed(cfg, step, ahead, buf.versions))
        snaps.take(step)
        for v in buf.versions:
            with snaps.swapped_in(v):
                pass
        if step not in flat:
            buf.add([RLSample([1], [2], 0.0, 0.0, policy_version=max(step - ahead, 0))])
    assert sorted(snaps.store) == list(range(3 - ahead, 6))  # the bound again once the buffer moved on


def test_replayed_groups_stay_their_prompts_across_steps():
    """The loop's order (rl.add_replay): select from the buffer, add the fresh samples, renumber the selected after
    them. With replay.k=3 a version is a candidate at three steps; each step replays one whole group (the lowest
    score: prompt 0, then prompt 1). Renumbered in place, prompts 0 and 1 of version 0 both became group 3 (the
    first after the fresh ones) and step 3 pooled them as one group: a 2-sample selection took nothing, or four."""
    buf = ReplayBuffer(k=3)
    buf.add(_step_samples(0))
    for step in (1, 2, 3):
        cands = buf.entries(step)
        favour = step - 1  # this step's best-matched prompt of version 0
        scores = torch.tensor([0.0 if (e.version, e.sample.prompt_ids[1]) == (0, favour) else 1.0 for e in cands])
        sel = buf.select(2, step, ReplayMatch(scores=scores), ReplayRule(level="group"))
        assert [s.prompt_ids for s in sel.samples] == [[0, favour]] * 2, f"step {step}"
        fresh = _step_samples(step)
        buf.add(fresh)
        replayed = reindex(list(sel.samples), fresh)
        assert [(s.index, s.group) for s in replayed] == [(6, 3), (7, 3)]
        # the buffer's own samples keep their prompt's group: one (version, group) key per prompt
        keys = {(e.version, e.sample.group): tuple(e.sample.prompt_ids) for e in buf.entries()}
        assert len(keys) == len({tuple(e.sample.prompt_ids) for e in buf.entries()})


def test_a_replayed_sample_is_read_as_its_own_step_left_it():
    """rl.add_replay's order (``with_replayed``): the fresh samples join the buffer, then the step trains on them
    beside the replayed ones. TraceRL's ``batch_rows`` writes each mini-batch's longest response into the samples
    it trains (``extra[STEP_WIDTH]``, the fragment_width denominator). When the buffer kept the very objects the
    update trained on, a step-1 sample trained beside a long replayed step-0 one left the buffer with width 6,
    and step 2 replayed it with that width, the longest response neither of its own step (2) nor of step 2 (3)."""

    def collected(version: int, length: int) -> list[RLSample]:  # a step's samples after collect's prepare
        out = [RLSample([9], [1] * length, 0.0, 0.0, index=i, group=0, policy_version=version) for i in range(2)]
        stamp_step_width(out)
        return out

    buf = ReplayBuffer(k=2)
    with_replayed(buf, collected(0, length=6), [])
    stamp_step_width(with_replayed(buf, collected(1, length=2), buf.samples(0)))  # step 1 trains one mini-batch
    assert [s.extra[STEP_WIDTH] for s in buf.samples(1)] == [2, 2]
    step2 = with_replayed(buf, collected(2, length=3), buf.samples(1))
    stamp_step_width(step2)
    assert [s.extra[STEP_WIDTH] for s in step2] == [3, 3, 3, 3]


def test_replay_candidates_are_scored_in_their_own_prompt_groups():
    """replay_select scores copies of the candidates; a step's prompt groups are numbered from 0, so versions
    share group numbers and each (version, group) gets its own. The former base + group + 1000 * version gave
    group 1000 of version 0 and group 0 of version 1 one number: rows that pair a group's responses (VRPO)
    paired two prompts."""
    buf = ReplayBuffer(k=2)
    buf.add([RLSample([1000], [1], 1.0, 0.0, index=j, group=1000, policy_version=0) for j in range(2)])
    buf.add([RLSample([0], [1], 0.0, 0.0, index=j, group=0, policy_version=1) for j in range(2)])
    cands = buf.entries(2)
    scored = scoring_copies(cands, base=100)
    assert [(s.index, s.group) for s in scored] == [(100, 100), (101, 100), (102, 101), (103, 101)]
    assert [e.sample.group for e in cands] == [1000, 1000, 0, 0]  # the buffer's own samples untouched


def test_replay_scores_a_partial_rollout_against_each_token_version(monkeypatch):
    """The behaviour pass of replay_select (``scoring_correction`` -> store_behaviour) takes each token's version
    of a partial rollout, as the training batch's correction does: token 0 decoded on version 0, token 1 on
    version 1 after a weight update. It took the response's oldest version for every token (the candidate's
    version, no token_versions), so the match score compared token 1 with weights that never decoded it."""

    class Snapshots:
        held: int | None = None

        @contextlib.contextmanager
        def swapped_in(self, v):
            self.held = v
            yield
            self.held = None

    snaps = Snapshots()
    monkeypatch.setattr(correction, "outputs_of", lambda model, mbs, fmt: [torch.full((1, 2), -1.0 - snaps.held)])
    buf = ReplayBuffer(k=2)
    buf.add([RLSample([1], [2, 3], 1.0, 0.5, policy_version=0, token_versions=[0, 1])])
    cands = buf.entries(2)
    scored = scoring_copies(cands, base=100)
    ctx, versions = scoring_correction(scored, cands, Correction({}, 2, snaps))
    z = torch.zeros(1, 2, dtype=torch.long)
    mb = MicroBatch(
        tokens=z, labels=z, weight=torch.ones(1, 2), position_ids=z, segment_ids=z, slot=torch.tensor([[0, 1]]),
        tok=torch.tensor([[0, 1]]), sample=torch.full((1, 2), 100), old=torch.zeros(1, 2),
    )  # fmt: skip
    store_behaviour(
        SimpleNamespace(model=None, kind=None, block=1, arch=SimpleNamespace(vocab_size=8)), ctx, [mb], versions
    )
    assert versions == {0, 1} and mb.behave.tolist() == [[-1.0, -2.0]]


def test_scores_and_diagnostics():
    zero, shift = torch.zeros(5), torch.full((5,), 0.4)
    s = variance_guided_scores([zero, shift, torch.tensor([])], kind="token_chi2")
    assert s[0] == 0 and s[1] == pytest.approx(math.expm1(0.4) ** 2) and s[2] == 0
    assert variance_guided_scores([shift], kind="seq_chi2")[0] == pytest.approx(math.expm1(2.0) ** 2)
    assert variance_guided_scores([shift], kind="log_ratio_var")[0] == pytest.approx(0.0, abs=1e-15)
    assert variance_guided_scores(torch.stack([zero, shift]), kind="token_k2")[1] == pytest.approx(0.08)
    assert float(variance_guided_scores([torch.tensor([100.0])], kind="token_k2")[0]) == 200.0  # clamped at 20
    assert chi2_ess(torch.zeros(4)) == {"chi2": 0.0, "ess": 1.0}
    d = chi2_ess(torch.log(torch.tensor([1.0, 3.0])))
    assert d["ess"] == pytest.approx(16 / 20) and d["chi2"] == pytest.approx(0.25)


def test_mixture_metrics_are_the_chi2_and_ess_of_the_pmis_weights():
    """replay.pmis: correction_weights logs is/mixture_ess = (sum w)^2 / (n sum w^2) and is/mixture_chi2 =
    1/ess - 1 of the balance-heuristic weights it stores (one token slot per sample, two behaviour versions)."""
    g = torch.Generator().manual_seed(7)
    n = 6
    target, lp0, lp1 = (-torch.rand(n, generator=g, dtype=torch.float64) * 2 for _ in range(3))
    z = torch.zeros(1, n, dtype=torch.long)
    mb = MicroBatch(
        tokens=z, labels=z, weight=torch.ones(1, n), position_ids=z, segment_ids=z, row_ids=z.clone(),
        slot=z.clone(), sample=torch.arange(n).view(1, n), old=target.view(1, n), behave=target.view(1, n),
        version_logp={0: lp0.view(1, n), 1: lp1.view(1, n)},
    )  # fmt: skip
    cfg = Config()
    cfg.replay.enable, cfg.offpolicy.loss_mode, cfg.offpolicy.rollout_is = True, "decoupled", "token"
    m = correction_weights(cfg, [mb], {s: int(s >= 3) for s in range(n)}, {0, 1})
    w = balance_heuristic_weights(target, torch.stack([lp0, lp1]), torch.tensor([3, 3]), log_clamp=20.0, threshold=2.0)
    assert torch.allclose(mb.is_weight.view(-1).double(), w, atol=1e-6)
    ess = float(w.sum() ** 2 / (n * w.square().sum()))
    assert m["is/mixture_ess"] == pytest.approx(ess, rel=1e-9) and ess < 1
    assert m["is/mixture_chi2"] == pytest.approx(1 / ess - 1, rel=1e-9)


def _pickled_before_fields(obj, moved: dict) -> bytes:
    """``obj`` pickled as megadare did before ``moved``'s keys were fields: no such attribute, the values in
    ``extra`` (d537e12 made them fields)."""
    for k in moved:
        del obj.__dict__[k]
    obj.extra = {**obj.extra, **moved}
    return pickle.dumps(obj)


def test_samples_pickled_before_the_version_fields_keep_their_versions():
    """A replay buffer / rollout queue checkpointed by an older megadare restores the behaviour versions its
    samples carried in ``extra`` (not None, which staleness would read as version 0)."""
    s = RLSample([1, 2], [3, 4], 1.0, 0.5, extra={"steps": [1]})
    old = {"policy_version": 7, "token_versions": [6, 7], "engine_logprobs": [-0.5, -0.25]}
    buf = ReplayBuffer(k=2)
    buf.add([pickle.loads(_pickled_before_fields(s, old))], version=7)
    data = io.BytesIO()
    torch.save(buf.state_dict(), data)
    data.seek(0)
    restored = ReplayBuffer(k=2)
    restored.load_state_dict(torch.load(data, weights_only=False))
    (back,) = restored.samples()
    assert (back.policy_version, back.token_versions, back.engine_logprobs) == (7, [6, 7], [-0.5, -0.25])
    assert back.extra == {"steps": [1]} and sample_version(back) == 7
    t = Trajectory([1], [2, 3], [0, 1], [0, 0], [-0.1, -0.2], "length", 2, SamplingParams(), policy_version=3)
    t_back = pickle.loads(_pickled_before_fields(t, {"token_versions": [2, 3], "engine_s": 1.5}))
    assert (t_back.token_versions, t_back.engine_s, t_back.policy_version, t_back.extra) == ([2, 3], 1.5, 3, {})
    fresh = pickle.loads(pickle.dumps(RLSample([1], [2], 0.0, 0.0, policy_version=4, extra={"policy_version": 9})))
    assert fresh.policy_version == 4 and fresh.extra == {"policy_version": 9}  # a field written stays
