"""Final-answer extraction and normalisation for math rewards (string work only, no sympy).

Conventions follow the reward functions of DARE / dLLM-RL / d1, which descend from the Hendrycks MATH
``last_boxed_only_string`` + ``strip_string`` helpers:

* the answer is the content of the LAST ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``), with real brace
  matching, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``; an unclosed last box (a truncated generation)
  gives None;
* without a box, "the answer is X" / "Answer: X", then the last number in the text (the GSM8K fallback);
* GSM8K gold solutions end with ``#### 1,234``: the gold is the text after ``####`` with commas removed.
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["extract_boxed", "extract_answer", "gsm8k_gold", "normalize_answer", "clean_latex", "last_number"]

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_IS_RE = re.compile(r"(?i)\banswer\b\W{0,4}(?:is\b|:)\s*:?\s*(?P<ans>[^\n]*)")
# fractions first, then numbers with thousands commas, then plain ints / decimals
_NUMBER_RE = re.compile(r"-?\d+/\d+|-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")


def _match_braces(text: str, open_idx: int) -> Optional[int]:
    """Index of the ``}`` closing the ``{`` at ``open_idx`` (``\\{`` / ``\\}`` escapes are skipped), or None."""
    depth = 0
    i = open_idx
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2  # an escaped character (\{, \}, \\) never opens or closes a group
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (nested braces matched), else None.

    ``\\boxed 5`` (no braces) gives the following token (up to whitespace or ``$``). An unclosed last box gives
    None, as the MATH reference does.
    """
    if not text:
        return None
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    end = matches[-1].end()
    rest = text[end:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        open_idx = end + (len(rest) - len(stripped))
        close = _match_braces(text, open_idx)
        return None if close is None else text[open_idx + 1 : close].strip()
    if rest[:1].isspace():
        token = re.match(r"[^\s$]+", stripped)
        return token.group(0) if token else None
    return None


def last_number(text: str) -> Optional[str]:
    """The last number in ``text`` (int, decimal, negative, ``1,234``, ``3/4``) with commas removed, else None."""
    found = _NUMBER_RE.findall(text or "")
    return found[-1].replace(",", "") if found else None


def _clean_stated_answer(ans: str) -> str:
    ans = ans.strip().strip("*").strip()
    ans = re.split(r"\.\s", ans, maxsplit=1)[0]  # first sentence only
    ans = ans.strip().rstrip(".").strip()
    if ans.startswith("$") or ans.endswith("$"):
        ans = ans.strip("$").strip()
    if ans.startswith("\\(") and ans.endswith("\\)"):
        ans = ans[2:-2].strip()
    return ans.rstrip(".").strip()


def extract_answer(text: str) -> Optional[str]:
    """Final answer of a response: last boxed, else "answer is X" / "Answer: X", else the last number; else None."""
    if not text:
        return None
    boxed = extract_boxed(text)
    if boxed:
        return boxed
    stated = list(_ANSWER_IS_RE.finditer(text))
    for m in reversed(stated):
        ans = _clean_stated_answer(m.group("ans"))
        if ans:
            inner = extract_boxed(ans)
            return inner if inner else ans
    return last_number(text)


def gsm8k_gold(solution: str) -> str:
    """GSM8K gold answer: the text after the last ``####`` with commas removed (whole text if there is none);
    ValueError when nothing follows it (no response could match an empty gold)."""
    gold = solution.split("####")[-1].strip().replace(",", "")
    if not gold:
        raise ValueError(f"GSM8K gold {solution[-80:]!r} has nothing after its '####': give the final number there")
    return gold


# ----------------------------------------------------------------------------------------------- normalisation
_TEXT_RE = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_UNIT_RE = re.compile(r"^(?P<num>.*?\d)\s*\\(?:text|mbox|mathrm)\s*\{\s*[A-Za-z][A-Za-z .]*\}$")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def _fix_fracs(s: str) -> str:
    r"""``\frac12`` -> ``\frac{1}{2}``, ``\frac1{2}`` -> ``\frac{1}{2}`` (the MATH ``_fix_fracs`` rule)."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        a, b, tail = part[0], part[1], part[2:]
        if b == "{":
            out += "{" + a + "}" + b + tail
        else:
            out += "{" + a + "}{" + b + "}" + tail
    return out


def _fix_sqrt(s: str) -> str:
    r"""``\sqrt3`` -> ``\sqrt{3}``."""
    return re.sub(r"\\sqrt(?![\[{])\s*([0-9A-Za-z])", r"\\sqrt{\1}", s)


def clean_latex(s: Optional[str]) -> str:
    r"""Strip presentation from an answer but keep its whitespace (so ``\pi r`` stays two tokens).

    Removes ``$``, ``\text{..}``-style wrappers, units after a number (``5 \text{ cm}``), ``\left``/``\right``,
    ``\!`` and other spacing commands, ``\displaystyle``, ``\%``/``%``, ``^\circ``, a trailing ``.`` and a short
    left-hand side (``x = 5`` -> ``5``); maps ``\dfrac``/``\tfrac`` -> ``\frac`` and ``1,000`` -> ``1000``.
    """
    if s is None:
        return ""
    s = str(s).strip().replace("\n", " ")
    s = s.replace("\\!", "").replace("\\displaystyle", "")
    for sp in ("\\,", "\\;", "\\:", "\\quad", "\\qquad", "~"):
        s = s.replace(sp, " ")
    s = s.replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = re.sub(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])", "", s)
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ", "", s)
    s = s.replace("\\$", "").replace("$", "")
    m = _UNIT_RE.match(s.strip())
    if m:
        s = m.group("num")
    prev = None
    while prev != s:  # nested \text{\textbf{..}}
        prev = s
        s = _TEXT_RE.sub(r"\1", s)
    s = s.replace("\\%", "").replace("%", "").strip()
    if s.endswith("."):
        s = s[:-1].strip()
    lhs = s.split("=")
    if len(lhs) == 2 and len(lhs[0].strip()) <= 2:
        s = lhs[1].strip()
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    return s


def normalize_answer(s: Optional[str]) -> str:
    r"""Canonical string form of an answer (MATH ``strip_string`` rules), so equal answers compare equal as text.

    :func:`clean_latex`, then ``\frac12`` -> ``\frac{1}{2}``, ``\sqrt3`` -> ``\sqrt{3}``, ``.5`` -> ``0.5``
    and all whitespace removed.
    """
    s = _fix_sqrt(clean_latex(s))
    s = re.sub(r"\s+", "", s)
    s = _fix_fracs(s)
    s = re.sub(r"(^|[^0-9}])\.(\d)", r"\g<1>0.\2", s)  # .5 -> 0.5, -.5 -> -0.5, {.5 -> {0.5
    return s
