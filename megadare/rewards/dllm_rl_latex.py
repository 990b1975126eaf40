"""dLLM-RL's last math stage (Gen-Verse/dLLM-RL @10b4fd1, ``reward/math_utils.py::_is_latex_equal``): sympy's
``parse_latex`` on both answers, else on Minerva's normalisations of both (``normalize_final_answer``), else those
normalised strings equal.

sympy's parse_latex runs only under antlr4-python3-runtime 4.11 (sympy's own check); elsewhere it raises ImportError
and the normalised strings decide. dLLM-RL's requirements install antlr4 4.9.3 (omegaconf pins ``==4.9.*``, and
math_verify allows it), so as they install it dLLM-RL is graded by the strings; with 4.11 installed, by sympy.
megadare decides as dLLM-RL would in the same environment (:func:`sympy_latex_runs`): the strings here, sympy in a
verifier-pool worker there (:data:`~megadare.rewards.math_verify.RULES` ``"dllm_rl"``). Kept step for step
(Apache-2.0); checked against dLLM-RL's own functions by tests/test_dllm_rl_math.py (``DLLM_RL_SRC``). This module
imports nothing of megadare, so that the pool's workers can run it.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from importlib import metadata

__all__ = ["dllm_rl_latex_equal", "normalize_final_answer", "sympy_latex_runs"]


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


def normalize_final_answer(s: str) -> str:
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


@functools.lru_cache(maxsize=None)
def sympy_latex_runs() -> bool:
    """Does sympy's ``parse_latex`` run here? sympy's own condition: antlr4 importable, its runtime version 4.11."""
    try:
        version = metadata.version("antlr4-python3-runtime")
    except metadata.PackageNotFoundError:
        return False
    return version.startswith("4.11") and importlib.util.find_spec("antlr4") is not None


def _latex_eval(latex: str) -> tuple:
    from sympy.parsing.latex import parse_latex  # sympy loads in ~1 s: only where this stage runs (a pool worker)

    sym = parse_latex(latex)
    return sym, sym.evalf()


def dllm_rl_latex_equal(pred: str, gold: str) -> bool:
    """dLLM-RL's ``_is_latex_equal``: the parsed answers (or their values) equal; else, where either does not parse
    or they differ, their Minerva normalisations parsed; where those do not parse, the normalisations equal."""
    try:
        (sym1, val1), (sym2, val2) = _latex_eval(pred), _latex_eval(gold)
        if sym1 == sym2 or val1 == val2:
            return True
    except Exception:  # noqa: BLE001  (dLLM-RL catches all: ImportError, LaTeXParsingError, sympy's own errors)
        pass
    norm1, norm2 = normalize_final_answer(pred), normalize_final_answer(gold)
    try:
        (sym1, val1), (sym2, val2) = _latex_eval(norm1), _latex_eval(norm2)
        return bool(sym1 == sym2 or val1 == val2)
    except Exception:  # noqa: BLE001  (as above: dLLM-RL then compares the normalised strings)
        return norm1 == norm2
