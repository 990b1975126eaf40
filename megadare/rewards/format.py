"""Format rewards: does the response have the shape the prompt asked for? (no correctness check)

* ``boxed_format_reward``: a ``\\boxed{...}`` with a non-empty, brace-balanced body is present (the MATH /
  DARE prompt "put your final answer within \\boxed{}"); ``exactly_one=True`` demands a single one.
* ``think_answer_format_reward``: the d1 / DeepSeek-R1 ``<think>...</think>`` then ``<answer>...</answer>``
  layout, checked with one anchored regex (only whitespace around and between the two blocks).
"""

from __future__ import annotations

import re
from typing import Dict, List

from megadare.rewards.math_answer import _BOX_RE

__all__ = ["boxed_format_reward", "think_answer_format_reward", "count_boxed"]

_THINK_ANSWER_RE = re.compile(
    r"^\s*<think>(?:(?!</?think>).)+</think>\s*<answer>(?:(?!</?answer>).)+</answer>\s*$", re.DOTALL
)


def _closing_braces(text: str) -> Dict[int, int]:
    """For each ``{`` of ``text``, the index of its ``}`` (``\\{`` / ``\\}`` escapes skipped), in one pass: what
    ``_match_braces`` gives from a ``{`` no backslash precedes (a box's)."""
    closing, stack, i = {}, [], 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            closing[stack.pop()] = i
        i += 1
    return closing


def _next_non_space(text: str) -> List[int]:
    """``out[i]``: the first index >= i whose character is not whitespace (``len(text)`` if none)."""
    out = [len(text)] * (len(text) + 1)
    for i in range(len(text) - 1, -1, -1):
        out[i] = out[i + 1] if text[i].isspace() else i
    return out


def count_boxed(text: str) -> int:
    """Number of ``\\boxed{..}`` / ``\\fbox{..}`` with a closed, non-empty body in ``text``, in linear time (a
    brace scan from every box, to the end for an unclosed one: ``\\boxed{`` x 3,000 took 9 s, and a little more
    passed score_batch's 60 s per call)."""
    text = text or ""
    boxes = list(_BOX_RE.finditer(text))
    if not boxes:
        return 0
    closing, nxt = _closing_braces(text), _next_non_space(text)
    n = 0
    for m in boxes:
        open_idx = nxt[m.end()]
        close = closing.get(open_idx) if open_idx < len(text) and text[open_idx] == "{" else None
        if close is not None and nxt[open_idx + 1] < close:
            n += 1
    return n


def boxed_format_reward(response: str, exactly_one: bool = False) -> float:
    """1.0 if the response has at least one (``exactly_one``: exactly one) non-empty ``\\boxed{}``, else 0.0."""
    n = count_boxed(response)
    return 1.0 if (n == 1 if exactly_one else n >= 1) else 0.0


def think_answer_format_reward(response: str) -> float:
    """1.0 if the response is ``<think>...</think>`` followed by ``<answer>...</answer>`` (d1 format), else 0.0."""
    return 1.0 if _THINK_ANSWER_RE.match(response or "") else 0.0
