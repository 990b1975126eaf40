"""DARE's math rule (``math_rm`` in ``verl/utils/reward_score/math_reward.py``, DARE @83ae8a3): what a DARE row
tagged ``extra_info.task == "math"`` (gsm8k, math, math500, aime*, openr1 ...) scores under DARE's reward manager.

* The prediction is the content of the LAST ``\\boxed{...}`` and nothing else: the last ``\\boxed`` must be
  followed at once by ``{`` and closed (brace counting from the ``\\boxed``, no escapes); ``\\boxed 5``,
  ``\\fbox{5}``, an unclosed or an empty last box, "The answer is 5", a bare number: no answer, 0.
* The gold is the row's ground truth (its last box when it holds one); 1 when the prediction equals it after the
  Hendrycks MATH normalisation (:func:`mathd_normalize`), or after the PRM800K normalisation (:func:`normalize`)
  either as strings or element by element (tuples / intervals) through ``sympy.simplify`` of the difference;
  unreduced fractions must match as written, and an integer gold wants an integer answer. Else 0.

This is megadare's own code for DARE's rules, checked against DARE's functions on a bank of responses; it is not
:func:`~megadare.rewards.math_verify.math_reward` (math-verify, lenient about unboxed answers), which ``math`` runs.
The sympy step runs in the verifier pool (:func:`~megadare.rewards.math_verify.verify_answer` with
``rule="dare"``), since ``simplify`` has no time bound of its own.
"""

from __future__ import annotations

import re
from tokenize import TokenError
from typing import List, Optional

__all__ = ["dare_boxed", "dare_gold", "mathd_normalize", "normalize", "dare_answers_equal"]

_BOXED = "\\boxed"


def dare_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` of ``text`` as DARE reads it (module docstring), else None."""
    start = (text or "").rfind(_BOXED)
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        depth += (text[i] == "{") - (text[i] == "}")
        if text[i] == "}" and depth == 0:
            box = text[start : i + 1]
            return box[len(_BOXED) + 1 : -1] if box.startswith(_BOXED + "{") else None
    return None


def dare_gold(gold: object) -> str:
    """The gold DARE compares with: the text, or its last box when it holds ``\\boxed``.

    A gold that is not a string or a number, NaN, empty, or a ``\\boxed`` that holds no readable box is a data
    error here (DARE prints the first and scores 0 for all of them: every response to the row would be wrong)."""
    if not isinstance(gold, (str, int, float)) or isinstance(gold, bool):
        raise ValueError(f"DARE math gold must be a string or a number, got {type(gold).__name__}: {gold!r:.200}")
    text = str(gold)
    boxed = dare_boxed(text) if "\\boxed" in text else text
    if (isinstance(gold, float) and gold != gold) or not (boxed or "").strip():
        what = "a boxed gold with no readable last box" if "\\boxed" in text else "empty or NaN (a missing value)"
        raise ValueError(f"DARE math gold is {what} ({text!r:.200}): no response could match it; fix or drop the row")
    return boxed


# ------------------------------------------------------------------------------- Hendrycks MATH normalisation
def _braced_fracs(s: str) -> str:
    r"""``\frac12`` -> ``\frac{1}{2}``, ``\frac1{2}`` -> ``\frac{1}{2}``; ``s`` unchanged when a bare ``\frac`` has
    fewer than two characters after it; IndexError for an empty tail (the caller's whole rule gives up)."""
    head, *tails = s.split("\\frac")
    out = [head]
    for tail in tails:
        if tail[0] == "{":
            out.append("\\frac" + tail)
        elif len(tail) < 2:
            return s
        elif tail[1] == "{":
            out.append("\\frac{" + tail[0] + "}" + tail[1:])
        else:
            out.append("\\frac{" + tail[0] + "}{" + tail[1] + "}" + tail[2:])
    return "".join(out)


def _braced_sqrt(s: str) -> str:
    head, *tails = s.split("\\sqrt")
    return head + "".join("\\sqrt" + (t if t[0] == "{" else "{" + t[0] + "}" + t[1:]) for t in tails)


def _slash_to_frac(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def _strip_math(s: str) -> str:
    """The MATH ``strip_string`` steps, in their order; raises where they give up (see :func:`mathd_normalize`)."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if "\\text{ " in s:  # units on the right
        parts = s.split("\\text{ ")
        if len(parts) != 2:
            raise ValueError("more than one unit")
        s = parts[0]
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _braced_fracs(_braced_sqrt(s).replace(" ", ""))
    return _slash_to_frac("\\frac{1}{2}" if s == "0.5" else s)


def mathd_normalize(answer: str) -> str:
    """Hendrycks' ``normalize_answer``: strip, unwrap a whole ``\\text{..}``, then the MATH ``strip_string`` rules
    (the unwrapped text when they give up)."""
    answer = answer.strip()
    m = re.search(r"^\\text\{(?P<text>.+?)\}$", answer)
    if m is not None:
        answer = m.group("text").strip()
    try:
        return _strip_math(answer)
    except (ValueError, IndexError):
        return answer


# ------------------------------------------------------------------------------------ PRM800K normalisation
_UNITS = "degree cm centimeter meter mile second minute hour day week month year foot feet inch yard".split()
_LATEX_SYMBOLS = {"√": "sqrt", "π": "pi", "∞": "inf", "∪": "U", "·": "*", "×": "*"}


def _float_or_none(s: str) -> Optional[float]:
    try:
        return float(s)
    except ValueError:
        return None


def _integral(x: Optional[float]) -> bool:
    try:
        return x is not None and abs(x - int(round(x))) <= 1e-7
    except (ValueError, OverflowError):
        return False


def _drop_thousands_commas(s: str) -> str:
    prev = None
    while prev != s:
        prev, s = s, re.sub(r"(\d)(,)(\d\d\d)($|\D)", r"\1\3\4", s)
    return s


def _is_int_text(s: str) -> bool:
    return _integral(_float_or_none(_drop_thousands_commas(s)))


def _latex_to_text(s: str) -> str:
    """DARE's ``_parse_latex`` (pylatexenc's LaTeX-to-text); ``s`` unchanged where the reader cannot read it, as
    DARE keeps it. The reader's failures on malformed text are its own LatexWalkerError and KeyError / IndexError /
    TypeError from its macro handlers (60,000 random LaTeX-like strings: 5,608 failures, of those three types
    only), and RecursionError on deep nesting (``\\sqrt{`` 300 times: DARE keeps the text, and the answer scores 0;
    raised, it was a reward error a response could stop the run with); anything else is raised (the verifier then
    reports an error, not a verdict)."""
    from pylatexenc import latex2text, latexwalker  # DARE's LaTeX reader; loaded by the verifier workers only

    t = s.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    try:
        t = latex2text.LatexNodes2Text().latex_to_text(t)
    except (latexwalker.LatexWalkerError, KeyError, IndexError, TypeError, RecursionError):
        return s
    for symbol, word in _LATEX_SYMBOLS.items():
        t = t.replace(symbol, word)
    return t.strip()


def normalize(expr: str) -> str:
    """PRM800K's ``_normalize``: units, ``$``/``%``, ``or``/``and`` lists, LaTeX read as text, lower case,
    integers in one spelling."""
    m = re.search(r"^\\text\{(?P<text>.+?)\}$", expr)
    if m is not None:
        expr = m.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit in _UNITS:
        expr = re.sub(f"{unit}(es)?(s)? *(\\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    value = _float_or_none(expr)
    if _integral(value):
        expr = str(int(round(value)))
    if "\\" in expr:
        expr = _latex_to_text(expr)
    expr = re.sub("- *", "-", expr)
    expr = re.sub("([0-9]) +([0-9])", "\\1+\\2", expr)  # a mixed number 7 3/4 -> 7+3/4
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _is_int_text(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _elements(expr: str) -> List[str]:
    """A tuple / interval's elements (thousands commas kept in their numbers), else ``[expr]``."""
    expr = _drop_thousands_commas(expr)
    if not expr:
        return []
    if len(expr) > 2 and expr[0] in "()[]" and expr[-1] in "()[]" and not any(c in "()[]" for c in expr[1:-1]):
        return [e.strip() for e in expr[1:-1].split(",")]
    return [expr]


def _sympy_allowed(expr: str) -> bool:
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2 or "^{" in expr or "^(" in expr:
        return False
    return not (re.search(r"\^[0-9]+\^", expr) or re.search(r"\^[0-9][0-9]+", expr))


# How parse_expr / simplify fail on text that is not a readable expression (20,000 random strings that pass
# _sympy_allowed: TokenError, SyntaxError, IndexError, TypeError, SympifyError), and the arithmetic failures of
# evaluating one (1/0, huge powers, deep nesting). Anything else is raised: the verifier reports an error.
_UNREADABLE = (
    SyntaxError,
    TokenError,
    TypeError,
    ValueError,
    IndexError,
    AttributeError,
    ZeroDivisionError,
    OverflowError,
    RecursionError,
    NotImplementedError,
)


def _sympy_equal(gold: str, pred: str) -> bool:
    import sympy  # heavy: loaded by the verifier workers only
    from sympy.parsing import sympy_parser

    expr = f"({gold})-({pred})"
    if not _sympy_allowed(expr):
        return False
    rules = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
    try:
        return sympy.simplify(sympy_parser.parse_expr(expr.replace("^", "**"), transformations=rules)) == 0
    except (*_UNREADABLE, sympy.SympifyError):  # not an expression sympy can read or simplify: unequal (DARE)
        return False


def _element_equal(gold: str, pred: str) -> bool:
    fraction = r"^-?[0-9]+.?/0*[1-9][0-9]*.?$"
    if re.search(fraction, gold) and re.search(fraction, pred):
        return gold == pred  # an unreduced fraction is not the reduced one
    if _is_int_text(gold) != _is_int_text(pred):
        return False
    return _sympy_equal(gold, pred)


def _sympy_grade(pred: str, gold: str) -> bool:
    gold_n, pred_n = normalize(gold), normalize(pred)
    if gold_n == pred_n:
        return True
    if not pred_n:
        return False
    gold_e, pred_e = _elements(gold_n), _elements(pred_n)
    if len(gold_e) > 1 and (gold_n[0] != pred_n[0] or gold_n[-1] != pred_n[-1]):
        return False
    return len(gold_e) == len(pred_e) and all(_element_equal(g, p) for g, p in zip(gold_e, pred_e))


def dare_answers_equal(pred: str, gold: str) -> bool:
    """DARE's verdict on a boxed prediction against a gold (both text): MATH strings equal, else the sympy grade."""
    return mathd_normalize(pred) == mathd_normalize(gold) or _sympy_grade(pred, gold)
