"""Format rewards: does the response have the shape the prompt asked for? (no correctness check)

* ``boxed_format_reward``: a ``\\boxed{...}`` with a non-empty, brace-balanced body is present (the MATH /
  DARE prompt "put your final answer within \\boxed{}"); ``exactly_one=True`` demands a single one.
* ``think_answer_format_reward``: the d1 / DeepSeek-R1 ``<think>...</think>`` then ``<answer>...</answer>``
  layout, checked with one anchored regex (only whitespace around and between the two blocks).
"""

from __future__ import annotations

import re

from megadare.rewards.math_answer import _BOX_RE, _match_braces

__all__ = ["boxed_format_reward", "think_answer_format_reward", "count_boxed"]

_THINK_ANSWER_RE = re.compile(
    r"^\s*<think>(?:(?!</?think>).)+</think>\s*<answer>(?:(?!</?answer>).)+</answer>\s*$", re.DOTALL
)


def count_boxed(text: str) -> int:
    """Number of ``\\boxed{..}`` / ``\\fbox{..}`` with a closed, non-empty body in ``text``."""
    n = 0
    for m in _BOX_RE.finditer(text or ""):
        rest = text[m.end() :]
        stripped = rest.lstrip()
        if not stripped.startswith("{"):
            continue
        open_idx = m.end() + len(rest) - len(stripped)
        close = _match_braces(text, open_idx)
        if close is not None and text[open_idx + 1 : close].strip():
            n += 1
    return n


def boxed_format_reward(response: str, exactly_one: bool = False) -> float:
    """1.0 if the response has at least one (``exactly_one``: exactly one) non-empty ``\\boxed{}``, else 0.0."""
    n = count_boxed(response)
    return 1.0 if (n == 1 if exactly_one else n >= 1) else 0.0


def think_answer_format_reward(response: str) -> float:
    """1.0 if the response is ``<think>...</think>`` followed by ``<answer>...</answer>`` (d1 format), else 0.0."""
    return 1.0 if _THINK_ANSWER_RE.match(response or "") else 0.0
