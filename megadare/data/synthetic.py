"""Deterministic generated tasks for tests and the demo: no network, no global RNG."""

from __future__ import annotations

import random
from typing import Iterable

__all__ = ["addition_task", "reverse_task", "exact_match"]


def addition_task(n: int, seed: int, max_operand: int = 99) -> list[dict]:
    """``n`` records ``{"prompt": "12+7=", "response": "19", "answer": "19"}`` drawn from ``Random(seed)``."""
    if n < 0:
        raise ValueError(f"addition_task: n={n} must be >= 0")
    if max_operand < 0:
        raise ValueError(f"addition_task: max_operand={max_operand} must be >= 0")
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        answer = str(a + b)
        records.append({"prompt": f"{a}+{b}=", "response": answer, "answer": answer})
    return records


def reverse_task(
    n: int,
    seed: int,
    length: int = 3,
    alphabet: str = "abcdefgh",
    correct_fraction: float = 1.0,
    exclude: Iterable[str] = (),
) -> list[dict]:
    """``n`` records ``{"prompt": "abc>", "response": "cba", "answer": "cba"}``: reverse a string.

    ``correct_fraction`` < 1 makes noisy demonstrations: the other responses copy the string unchanged (a
    plausible wrong rule), while ``answer`` stays the true reversal -- SFT on them imitates the mistake at that
    rate, a verifiable reward can remove it (the RL demo). ``exclude``: strings never drawn (held-out splits).
    """
    if n < 0 or not 0.0 <= correct_fraction <= 1.0:
        raise ValueError(f"reverse_task: need n >= 0 and 0 <= correct_fraction <= 1 (got {n}, {correct_fraction})")
    rng = random.Random(seed)
    banned = set(exclude)
    if len(alphabet) ** length <= len(banned):
        raise ValueError("reverse_task: every string is excluded")
    records = []
    while len(records) < n:
        s = "".join(rng.choice(alphabet) for _ in range(length))
        if s in banned:
            continue
        answer = s[::-1]
        response = answer if rng.random() < correct_fraction else s
        records.append({"prompt": f"{s}>", "response": response, "answer": answer})
    return records


def exact_match(response_text: str, answer: str) -> bool:
    """True when the response equals the answer, ignoring surrounding whitespace."""
    return response_text.strip() == str(answer).strip()
