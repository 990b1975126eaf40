"""dLLM-RL's math rule (Gen-Verse/dLLM-RL @10b4fd1): what its ``reward/rl_reward.py`` scores a response by.

* The prediction is the content of the LAST ``\\boxed{`` and its matching ``}`` (``extract_final_boxed_answer`` of
  ``sample/*_rl_rollout.py``): ``\\boxed 5``, ``\\fbox{5}``, an unclosed last box, "The answer is 5": no answer, 0.
* It equals the gold (``math_utils.is_equal``) when the Hendrycks MATH normalisations of both are equal, as floats
  or as text (``is_equiv``: note that it drops EVERY comma, so ``1,00`` is 100 and ``1,2`` is 12), else when
  Minerva's normalisations of both (``normalize_final_answer``: unit words, ``\\text{}``, ``$``) are equal, else when
  an equivalence checker says so. dLLM-RL's checker is sympy's ``parse_latex``, which wants antlr4 4.11 while its
  requirements (``math_verify``) install 4.13.2: there it raises, and the Minerva strings decide. Where it runs, it
  has 1 s per comparison counted from when all of a step's comparisons were queued, on a cold sympy import (a fresh
  process each step), so its verdicts depend on the machine's load. megadare's checker is math-verify in the
  verifier pool (:func:`~megadare.rewards.math_verify.verify_answer`), as ``math`` uses it: it accepts every
  equivalence parse_latex proved on tests/test_dllm_rl_math.py's battery, and a few more (sets in another order,
  ``bmatrix`` for ``pmatrix``, ``x^2+2x+1`` for ``(x+1)^2``).

The normalisations below are dLLM-RL's (``reward/math_utils.py``, Apache-2.0), kept step for step; the tests check
them against its own functions (``DLLM_RL_SRC``).
"""

from __future__ import annotations

import re
from itertools import islice, zip_longest
from typing import Optional

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


# ------------------------------------------------------------------ normalize_final_answer: the Minerva stage
_SUBSTITUTIONS = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
]  # fmt: skip
_REMOVED = [
    "square", "ways", "integers", "dollars", "mph", "inches", "ft", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges",
    "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2",
    "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"',
    "\\dots",
]  # fmt: skip


def _first_math(s: str) -> str:
    """``re.sub(r"(.*?)(\\$)(.*?)(\\$)(.*)", "$\\\\3$", s)`` in linear time: each line holding two ``$`` becomes its
    first ``$...$``. The regex tried every start of a line with one ``$``: 20,000 characters took 12 s, 80,000
    ~3 min, past score_batch's 60 s per call (a reward error any response could cause)."""
    lines = s.split("\n")
    for k, line in enumerate(lines):
        first = line.find("$")
        second = line.find("$", first + 1) if first >= 0 else -1
        if second >= 0:
            lines[k] = line[first : second + 1]
    return "\n".join(lines)


def _unwrap_first(s: str, opening: str) -> str:
    """``re.sub(r"(OPENING)(.*?)(\\})", "\\\\2", s)`` in linear time: each ``opening`` with a ``}`` after it on its
    line loses the opening and that ``}``. The regex scanned the rest of the line from each opening without one."""
    out, at, close, newline = [], 0, -1, -1
    while True:
        start = s.find(opening, at)
        if start < 0:
            break
        body = start + len(opening)
        if close < body:
            close = s.find("}", body)
        if newline < body:
            newline = s.find("\n", body) % (len(s) + 1)  # none: the end
        if close < 0:
            break
        if newline < close:
            out.append(s[at:newline])
            at = newline
            continue
        out.append(s[at:start] + s[body:close])
        at = close + 1
    return "".join(out) + s[at:]


def _unwrap_boxed(line: str) -> str:
    """``re.sub(r"(\\\\boxed\\{)(.*)(\\})", "\\\\2", line)`` on one line: its first ``\\boxed{`` and its last ``}``
    after it dropped."""
    start = line.find("\\boxed{")
    end = line.rfind("}") if start >= 0 else -1
    if end < start + len("\\boxed{"):
        return line
    return line[:start] + line[start + len("\\boxed{") : end] + line[end + 1 :]


def _minerva(s: str) -> str:
    """dLLM-RL's ``normalize_final_answer`` (Minerva's, arXiv 2206.14858 p. 18)."""
    for before, after in _SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in _REMOVED:
        s = s.replace(expr, "")
    s = _first_math(s)
    for macro in ("\\text{", "\\textbf{", "\\overline{"):
        s = _unwrap_first(s, macro)
    s = "\n".join(_unwrap_boxed(line) for line in s.split("\n"))
    s = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", s)
    s = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", s).replace("$", "")
    return s.replace(",", "") if s.replace(",", "").isdigit() else s


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


def dllm_rl_strings_equal(pred: str, gold: str) -> bool:
    """dLLM-RL's ``is_equal`` without its equivalence checker: ``is_equiv`` (Hendrycks), else the Minerva strings
    (not for an answer over 128 characters that repeats itself, as its sympy stage)."""
    if _is_equiv(pred, gold):
        return True
    if any(len(x) > 128 and _repetitive(x) for x in (pred, gold)):
        return False
    return _minerva(pred) == _minerva(gold)


def dllm_rl_math_reward(
    response: str, gold: object, pool: Optional[VerifierPool] = None, timeout: float = 5.0
) -> float:
    """1.0 when the last ``\\boxed{}`` of ``response`` equals ``gold`` by dLLM-RL's rule (module docstring), its
    equivalence checker being math-verify in the verifier pool; no closed box: 0.0."""
    pred = dllm_rl_boxed(response)
    if pred is None:
        return 0.0
    gold = str(gold)
    if dllm_rl_strings_equal(pred, gold):
        return 1.0
    return 1.0 if verify_answer(pred, gold, pool=pool, timeout=timeout) else 0.0
