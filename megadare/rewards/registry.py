"""Reward functions by name, weighted combinations, and the one batch scorer that RL and evaluation share.

A reward function is ``RewardFn = Callable[[str, dict], float]``: the response text and the sample record
(the dataset row: ``answer`` for math, ``tests`` for code, ...). Built-ins:

=====================  ========================================================================================
``math``               ``record["answer"]`` vs :func:`extract_answer` of the response (:func:`math_reward`)
``gsm8k``              the same with the gold taken after ``####`` (:func:`gsm8k_gold`)
``exact_match``        stripped response == stripped ``record["answer"]``
``code``               :func:`code_reward` on ``record["tests"]`` (``record["timeout_s"]``/``["memory_mb"]``)
``boxed_format``       :func:`boxed_format_reward`
``think_answer_format`` :func:`think_answer_format_reward`
=====================  ========================================================================================

``load_reward(spec)`` takes a built-in name or an import path ``"pkg.module:function"``; ``combine`` builds a
weighted sum (e.g. DiffuCoder's ``[("code", 2.0), ("boxed_format", 0.5)]``-style code + format reward).
"""
from __future__ import annotations

import importlib
import math
import queue
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from megadare.rewards.code import code_reward
from megadare.rewards.format import boxed_format_reward, think_answer_format_reward
from megadare.rewards.math_answer import gsm8k_gold
from megadare.rewards.math_verify import math_reward

__all__ = ["RewardFn", "RewardSpecError", "BUILTIN_REWARDS", "load_reward", "combine", "score_batch", "ScoreStats"]

RewardFn = Callable[[str, dict], float]
RewardSpec = Union[str, RewardFn]


class RewardSpecError(ValueError):
    """A reward spec that names no built-in and no importable callable."""


def _math(response: str, record: dict) -> float:
    return math_reward(response, str(record["answer"]), timeout=float(record.get("verify_timeout", 5.0)))


def _gsm8k(response: str, record: dict) -> float:
    return math_reward(response, gsm8k_gold(str(record["answer"])),
                       timeout=float(record.get("verify_timeout", 5.0)))


def _exact_match(response: str, record: dict) -> float:
    return 1.0 if response.strip() == str(record["answer"]).strip() else 0.0


def _code(response: str, record: dict) -> float:
    return code_reward(response, record["tests"], timeout_s=float(record.get("timeout_s", 5.0)),
                       memory_mb=int(record.get("memory_mb", 512)))


def _boxed_format(response: str, record: dict) -> float:
    return boxed_format_reward(response)


def _think_answer_format(response: str, record: dict) -> float:
    return think_answer_format_reward(response)


BUILTIN_REWARDS: Dict[str, RewardFn] = {
    "math": _math, "gsm8k": _gsm8k, "exact_match": _exact_match, "code": _code,
    "boxed_format": _boxed_format, "think_answer_format": _think_answer_format,
}


def load_reward(spec: RewardSpec) -> RewardFn:
    """A reward function from a built-in name, an import path ``"pkg.module:function"``, or a callable."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise RewardSpecError(f"reward spec must be a name, 'pkg.module:function' or a callable, got {spec!r}")
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise RewardSpecError(f"unknown reward {spec!r}: not a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) "
                              "and not an import path 'pkg.module:function'")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise RewardSpecError(f"reward {spec!r}: expected 'pkg.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise RewardSpecError(f"reward {spec!r}: module {module_name!r} not found") from e
        raise RewardSpecError(f"reward {spec!r}: importing {module_name!r} failed: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardSpecError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardSpecError(f"reward {spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
    return obj


def combine(specs_with_weights: Union[Mapping[RewardSpec, float], Sequence[Tuple[RewardSpec, float]]]) -> RewardFn:
    """Weighted sum of rewards: ``combine([("code", 2.0), ("boxed_format", 0.5)])``.

    Each spec goes through :func:`load_reward` now, so a bad spec fails here and not mid-training.
    """
    items = list(specs_with_weights.items()) if isinstance(specs_with_weights, Mapping) else list(specs_with_weights)
    if not items:
        raise RewardSpecError("combine needs at least one (spec, weight)")
    parts = [(load_reward(spec), float(w)) for spec, w in items]

    def combined(response: str, record: dict) -> float:
        return sum(w * float(fn(response, record)) for fn, w in parts)

    combined.components = parts  # type: ignore[attr-defined]
    return combined


@dataclass
class ScoreStats:
    """What happened in one :func:`score_batch` call (errors and timeouts scored 0.0)."""
    n: int = 0
    errors: int = 0
    timeouts: int = 0
    mean: float = 0.0
    wall_s: float = 0.0
    first_error: Optional[str] = None

    def to_dict(self) -> dict:
        return asdict(self)


def score_batch(fn: RewardSpec, responses: Sequence[str], records: Sequence[dict], workers: int = 8,
                timeout_s: float = 60.0) -> Tuple[List[float], ScoreStats]:
    """Score every ``(response, record)`` pair with ``fn`` on up to ``workers`` threads; returns (scores, stats).

    A call that raises, returns a non-finite / non-numeric value, or runs longer than ``timeout_s`` (measured
    from its own start) scores 0.0 and is counted in the stats. A timed-out call's thread cannot be killed: it
    is abandoned (daemon thread, its slot handed to the next call) and its late result ignored; the heavy
    rewards bound their own work (the verifier pool and the sandbox kill their processes).
    """
    fn = load_reward(fn)
    if len(responses) != len(records):
        raise ValueError(f"{len(responses)} responses but {len(records)} records")
    t0 = time.monotonic()
    n = len(responses)
    scores = [0.0] * n
    stats = ScoreStats(n=n)
    done_q: "queue.Queue[Tuple[int, bool, Any]]" = queue.Queue()

    def call(i: int) -> None:
        try:
            value = float(fn(responses[i], records[i]))
            if not math.isfinite(value):
                raise ValueError(f"reward returned {value}")
            done_q.put((i, True, value))
        except BaseException as e:  # noqa: B902 - a reward must never take the batch down
            done_q.put((i, False, f"{type(e).__name__}: {e}"))

    running: Dict[int, float] = {}   # index -> start time
    next_i = 0
    while next_i < n or running:
        while next_i < n and len(running) < max(1, workers):
            running[next_i] = time.monotonic()
            threading.Thread(target=call, args=(next_i,), daemon=True, name=f"reward-{next_i}").start()
            next_i += 1
        wait = min(s + timeout_s for s in running.values()) - time.monotonic()
        try:
            i, ok, value = done_q.get(timeout=max(0.0, wait))
            if i in running:
                del running[i]
                if ok:
                    scores[i] = value
                else:
                    stats.errors += 1
                    stats.first_error = stats.first_error or value
        except queue.Empty:
            pass
        now = time.monotonic()
        for i in [i for i, s in running.items() if now - s >= timeout_s]:
            del running[i]
            stats.timeouts += 1
    stats.wall_s = time.monotonic() - t0
    stats.mean = sum(scores) / n if n else 0.0
    return scores, stats
