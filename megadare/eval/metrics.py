"""Benchmark metrics over n sampled responses per problem.

For a problem with n samples of which c are correct:

* mean@n = c / n, averaged over problems (= the mean of every sample's 0/1 verdict: all problems have n samples);
* pass@k, the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code",
  arXiv:2107.03374, eq. 1): the probability that at least one of k samples drawn without replacement from the n
  is correct,

      pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)      (1 when n - c < k),

  computed as the product (no huge binomials, no cancellation);
* maj@k (self-consistency, Wang et al. 2023, arXiv:2203.11171): a majority vote over the extracted answers of the
  first k samples; the problem counts as solved when the winning answer is correct. Samples without an answer
  do not vote; ties go to the answer that appeared first among the k (deterministic); no votes is a miss.
  Defined only where answers can be compared (math), not for code;
* response length: mean generated tokens per sample; forwards per token: total model forwards (denoising steps)
  over total generated tokens, the dLLM decoding-efficiency figure (1 = one token per forward, as AR decoding).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Callable, Optional, Sequence

__all__ = ["pass_at_k", "majority_winner", "maj_at_k", "task_metrics"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct out of ``n`` samples (Chen et al. 2021):
    ``1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority_winner(keys: Sequence[Optional[str]]) -> Optional[int]:
    """Index of the sample whose answer wins the vote over ``keys`` (None keys do not vote): most votes, ties to
    the answer seen first. None when nobody voted."""
    votes = Counter(k for k in keys if k is not None)
    if not votes:
        return None
    top = max(votes.values())
    return next(i for i, k in enumerate(keys) if k is not None and votes[k] == top)


def maj_at_k(keys: Sequence[Optional[str]], correct: Sequence[bool], k: int) -> float:
    """1.0 when the majority answer of the first ``k`` samples is correct, else 0.0 (see :func:`majority_winner`)."""
    if not 1 <= k <= len(keys) or len(keys) != len(correct):
        raise ValueError(
            f"maj@k needs 1 <= k <= n and one verdict per answer, got k={k}, {len(keys)} answers, "
            f"{len(correct)} verdicts"
        )
    winner = majority_winner(keys[:k])
    return 0.0 if winner is None else float(bool(correct[winner]))


def task_metrics(
    rows: Sequence[dict], ks: Sequence[int], vote_key: Optional[Callable[[Optional[str]], Optional[str]]]
) -> dict[str, float]:
    """Summary of one task's per-sample rows (fields ``index``, ``sample``, ``correct``, ``extracted``,
    ``length``, ``forwards``); every problem must have the same number n of samples. Keys: ``mean@n``,
    ``pass@k`` and (with ``vote_key``) ``maj@k`` for each k, ``response_length``, ``forwards_per_token``."""
    if not rows:
        raise ValueError("no samples to summarise")
    by_problem: dict[int, list[dict]] = {}
    for r in rows:
        by_problem.setdefault(r["index"], []).append(r)
    groups = [sorted(g, key=lambda r: r["sample"]) for _, g in sorted(by_problem.items())]
    n = len(groups[0])
    if any(len(g) != n for g in groups):
        raise ValueError("every problem needs the same number of samples")
    out: dict[str, float] = {f"mean@{n}": sum(bool(r["correct"]) for r in rows) / len(rows)}
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(bool(r["correct"]) for r in g), k) for g in groups) / len(groups)
    if vote_key is not None:
        for k in ks:
            out[f"maj@{k}"] = sum(
                maj_at_k([vote_key(r["extracted"]) for r in g], [r["correct"] for r in g], k) for g in groups
            ) / len(groups)
    tokens = sum(r["length"] for r in rows)
    out["response_length"] = tokens / len(rows)
    out["forwards_per_token"] = sum(r["forwards"] for r in rows) / max(tokens, 1)
    return out
