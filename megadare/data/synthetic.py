"""Deterministic generated tasks for tests and the demo: no network, no global RNG."""
from __future__ import annotations

import json
import os
import random
from typing import Iterable

__all__ = ["addition_task", "write_jsonl", "exact_match"]


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


def write_jsonl(records: Iterable[dict], path: str) -> None:
    """Write one JSON object per line, atomically (``path + '.tmp'`` then ``os.replace``)."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def exact_match(response_text: str, answer: str) -> bool:
    """True when the response equals the answer, ignoring surrounding whitespace."""
    return response_text.strip() == str(answer).strip()
