"""dLLM-RL's math rule (Gen-Verse/dLLM-RL @10b4fd1): what its ``reward/rl_reward.py`` scores a response by.

* The prediction is the content of the LAST ``\\boxed{`` and its matching ``}`` (``extract_final_boxed_answer`` of
  ``sample/*_rl_rollout.py``): ``\\boxed 5``, ``\\fbox{5}``, an unclosed last box, "The answer is 5": no answer, 0.
* It equals the gold (``math_utils.is_equal``) when the Hendrycks MATH normalisations of both are equal, as floats
  or as text (``is_equiv``: note that it drops EVERY comma, so ``1,00`` is 100 and ``1,2`` is 12), else (but not
  for an answer over 128 characters that repeats itself) by dLLM-RL's ``_is_latex_equal``
  (:mod:`megadare.rewards.dllm_rl_latex`): sympy's ``parse_latex`` where antlr4 4.11 is installed, else Minerva's
  normalisations of both (``normalize_final_answer``: unit words, ``\\text{}``, ``$``) equal. dLLM-RL's requirements
  install antlr4 4.9.3, so as installed dLLM-RL decides by the strings; megadare decides as dLLM-RL does in the same
  environment (a pool worker runs sympy, with the pool's timeout: dLLM-RL gives each comparison 1 s counted from when
  all of a step's comparisons were queued, on a cold sympy import, and scores one that runs past it 0, a verdict of
  the machine's load; megadare's timeout raises AnswerTimeout, a reward error, not a 0). Any other checker would
  decide otherwise: math-verify, which this rule used before, took 60 of 958 pairs dLLM-RL refuses with sympy
  (``25%`` for 25, ``2\\frac{1}{2}`` for 5/2, ``Yes`` for yes) and refused 12 it takes (``A)`` for A, ``1\\,2``
  for 12); tests/test_dllm_rl_math.py.

The normalisations below are dLLM-RL's (``reward/math_utils.py``, Apache-2.0), kept step for step; the tests check
them against its own functions (``DLLM_RL_SRC``).
"""

from __future__ import annotations

from itertools import islice, zip_longest
from typing import Optional

from megadare.rewards.dllm_rl_latex import normalize_final_answer, sympy_latex_runs
from megadare.rewards.math_verify import VerifierPool, verify_answer

__all__ = ["dllm_rl_boxed", "dllm_rl_strings_equal", "dllm_rl_math_reward"]

_TAG = "\\boxed{"


def dllm_rl_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` of ``text`` (braces counted), None when there is none or it is not
    closed (dLLM-RL's "Can not extract the answer!")."""
    start = (text or "").rfind(_TAG)
    if start < 0:
        return None
    depth = 1
    for i in range(start + len(_TAG), len(text)):
        depth += (text[i] == "{") - (text[i] == "}")
        if depth == 0:
            return text[start + len(_TAG) : i]
    return None


# ------------------------------------------------------------------ is_equiv: the Hendrycks MATH string stage
def _fix_fracs(s: str) -> str:
    parts = s.split("\\frac")
    out = parts[0]
    for sub in parts[1:]:
        out += "\\frac"
        if not sub:
            raise IndexError("a bare \\frac")  # dLLM-RL's _fix_fracs indexes past its end there
        if sub[0] == "{":
            out += sub
        elif len(sub) < 2:
            return s
        elif sub[1] != "{":
            out += "{" + sub[0] + "}{" + sub[1] + "}" + sub[2:]
        else:
            out += "{" + sub[0] + "}" + sub[1:]
    return out


def _fix_a_slash_b(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return "\\frac{" + str(a) + "}{" + str(b) + "}" if s == f"{a}/{b}" else s


def _fix_sqrt(s: str) -> str:
    parts = s.split("\\sqrt")
    if "" in parts[1:]:
        raise IndexError("a bare \\sqrt")  # dLLM-RL's _fix_sqrt indexes past its end there
    return parts[0] + "".join("\\sqrt" + (p if p[0] == "{" else "{" + p[0] + "}" + p[1:]) for p in parts[1:])


def _strip_string(s: str) -> str:
    """dLLM-RL's ``_strip_string``; raises where it does (``is_equiv`` then compares the raw texts): a unit text
    ``\\text{ `` met twice, a ``\\sqrt`` or ``\\frac`` with nothing after it."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\").replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "").replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "").replace(",", "")
    if "\\text{ " in s:
        parts = s.split("\\text{ ")
        if len(parts) != 2:
            raise ValueError("two unit texts")
        s = parts[0]
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    if len(s.split("=")) == 2 and len(s.split("=")[0]) <= 2:
        s = s.split("=")[1]
    s = _fix_fracs(_fix_sqrt(s).replace(" ", ""))
    return _fix_a_slash_b("\\frac{1}{2}" if s == "0.5" else s)


def _is_equiv(pred: str, gold: str) -> bool:
    try:
        a, b = _strip_string(pred), _strip_string(gold)
    except (ValueError, IndexError):
        return pred == gold
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def _ranks(xs: list) -> list:
    index = {v: i for i, v in enumerate(sorted(set(xs)))}
    return [index[v] for v in xs]


def _repetitive(s: str) -> bool:
    """dLLM-RL's ``repeatness``: the summed longest common prefixes of neighbours in the suffix array (prefix
    doubling, then Kasai), over n(n+1)/2, above 0.2 (a looping answer); its sympy stage says no to such an answer
    over 128 characters."""
    n = len(s)
    if n <= 1:
        return False
    rank, k = _ranks([ord(c) for c in s]), 1
    while k < n - 1 and max(rank) < n - 1:  # ranks all distinct: more doubling changes nothing (dLLM-RL goes on)
        rank, k = _ranks(list(zip_longest(rank, islice(rank, k, None), fillvalue=-1))), k << 1
    sa = [0] * n
    for i, r in enumerate(rank):
        sa[r] = i
    total, h = 0, 0
    for i in range(n):
        if rank[i] == n - 1:
            h = 0
            continue
        j = sa[rank[i] + 1]
        while i + h < n and j + h < n and s[i + h] == s[j + h]:
            h += 1
        total += h
        h = max(h - 1, 0)
    return total * 2 / (n * (n + 1)) > 0.2


def _loops(pred: str, gold: str) -> bool:
    """dLLM-RL's guard before its last stage: an answer over 128 characters that repeats itself is not compared."""
    return any(len(x) > 128 and _repetitive(x) for x in (pred, gold))


def dllm_rl_strings_equal(pred: str, gold: str) -> bool:
    """dLLM-RL's ``is_equal`` where sympy's parse_latex does not run (its requirements' antlr4): ``is_equiv``
    (Hendrycks), else the Minerva strings (not for an answer that loops, as its last stage)."""
    if _is_equiv(pred, gold):
        return True
    return not _loops(pred, gold) and normalize_final_answer(pred) == normalize_final_answer(gold)


def dllm_rl_math_reward(
    response: str, gold: object, pool: Optional[VerifierPool] = None, timeout: float = 5.0
) -> float:
    """1.0 when the last ``\\boxed{}`` of ``response`` equals ``gold`` by dLLM-RL's rule (module docstring): its
    strings, and where parse_latex runs here, its sympy stage in the verifier pool; no closed box: 0.0."""
    pred = dllm_rl_boxed(response)
    if pred is None:
        return 0.0
    gold = str(gold)
    if not sympy_latex_runs():
        return 1.0 if dllm_rl_strings_equal(pred, gold) else 0.0
    if _is_equiv(pred, gold):
        return 1.0
    if _loops(pred, gold):
        return 0.0
    return 1.0 if verify_answer(pred, gold, pool=pool, timeout=timeout, rule="dllm_rl") else 0.0
