"""DARE's planning rewards: countdown and 4x4 sudoku (``verl/utils/reward_score/math_reward.py``, DARE @83ae8a3).

Both read the LAST ``<answer>...</answer>`` of the response (DOTALL), as DARE's prompts ask.

* countdown (``countdown_reward_func``, lines 530-568): the expression must use exactly the given numbers (the
  multiset of ``\\d+`` runs in it equals ``numbers``) and only ``[\\d+\\-*/().\\s]``; 1.0 when it evaluates to within
  1e-5 of the target, ``format_score`` (0.1) when an answer is there but invalid, wrong or not computable
  (division by zero), 0.0 without an answer. DARE evaluates with ``eval``; here the expression is parsed with
  :mod:`ast` and computed exactly with :class:`fractions.Fraction`, accepting what DARE's character set lets
  through (``+ - * / // **``, unary signs, parentheses, numeric literals). A power is computed as DARE computes it
  (``2**4-3`` hits 13: 1.0) while its result stays under :data:`MAX_POWER_BITS` bits; a larger one
  (``30**100**93``) is scored as a wrong answer at once, where DARE's ``eval`` would run for hours and stall the
  training step (a bug of DARE's kept out; such a number is nowhere near a countdown target).
* sudoku (``sudoku_reward_func``, lines 571-596): the digits of the answer, zero-padded or truncated to 16; the
  reward is the fraction of the puzzle's empty cells (``'0'``) holding the solution's digit (0.0 for a puzzle
  without empty cells or an answer without digits).
"""

from __future__ import annotations

import ast
import json
import re
from fractions import Fraction
from typing import Optional, Sequence, Union

__all__ = ["last_answer_tag", "countdown_reward", "sudoku_reward", "countdown_numbers", "check_sudoku_grid"]

_ALLOWED_RE = re.compile(r"^[\d+\-*/().\s]+$")
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Pow)
MAX_POWER_BITS = 1 << 20  # the largest power computed exactly (a million bits: milliseconds)


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    """``base ** exponent`` as Python's ``eval`` gives it (DARE's rule), exact for an integer exponent; ValueError
    for 0 to a negative power, a complex or non-finite result, or one over :data:`MAX_POWER_BITS` bits."""
    if exponent.denominator != 1:  # a root: Python's float power, as eval computes it
        try:
            value = float(base) ** float(exponent)
        except (OverflowError, ZeroDivisionError) as e:
            raise ValueError(f"power: {e}") from None
        if isinstance(value, complex) or value != value or value in (float("inf"), float("-inf")):
            raise ValueError("power: no real finite value")
        return Fraction(value)
    if base == 0 and exponent < 0:
        raise ValueError("division by zero")
    bits = max(base.numerator.bit_length(), base.denominator.bit_length())
    if abs(base) != 1 and base != 0 and abs(exponent) * bits > MAX_POWER_BITS:
        raise ValueError(f"power over {MAX_POWER_BITS} bits")
    return base ** int(exponent)


def last_answer_tag(response: str) -> Optional[str]:
    """The content of the last ``<answer>...</answer>`` (stripped), else None."""
    text, found = response or "", None
    at = text.find("<answer>")
    while at >= 0:  # findall's last match in linear time (the regex scanned to the end from every unclosed tag)
        close = text.find("</answer>", at + 8)
        if close < 0:
            break
        found, at = text[at + 8 : close], text.find("<answer>", close + 9)
    return found.strip() if found is not None else None


def countdown_numbers(numbers: Union[str, Sequence[int]]) -> list[int]:
    """The given numbers, from a list or DARE's JSON string ``"[30, 100, 93]"``; ValueError when neither."""
    if isinstance(numbers, str):
        try:
            numbers = json.loads(numbers)
        except json.JSONDecodeError as e:
            raise ValueError(f"countdown numbers must be a JSON list of integers, got {numbers!r} ({e})") from e
    if (
        not isinstance(numbers, (list, tuple))
        or not numbers
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers)
    ):
        raise ValueError(f"countdown numbers must be a non-empty list of integers, got {numbers!r}")
    return list(numbers)


def _value(node: ast.AST) -> Fraction:
    """Exact value of an arithmetic expression tree; ValueError for anything else (calls, names)."""
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and isinstance(node.op, _BINOPS):
        a, b = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        if isinstance(node.op, ast.Pow):
            return _power(a, b)
        if b == 0:
            raise ValueError("division by zero")
        return a / b if isinstance(node.op, ast.Div) else Fraction(a // b)
    raise ValueError(f"not allowed in a countdown expression: {type(node).__name__}")


def _evaluate(expression: str) -> Optional[Fraction]:
    """Exact value of ``expression``, or None when it is not a computable arithmetic expression."""
    if not _ALLOWED_RE.match(expression):
        return None
    try:
        return _value(ast.parse(expression, mode="eval"))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def countdown_reward(
    response: str, target: Union[int, str], numbers: Union[str, Sequence[int]], format_score: float = 0.1
) -> float:
    """DARE's countdown score of ``response`` for reaching ``target`` with ``numbers`` (module docstring)."""
    goal = int(str(target).strip())
    given = countdown_numbers(numbers)
    expression = last_answer_tag(response)
    if expression is None:
        return 0.0
    try:
        used = sorted(int(n) for n in re.findall(r"\d+", expression))
    except ValueError:  # a number past int's 4,300 digits: none of the given ones (DARE catches it: format score)
        return format_score
    if used != sorted(given):
        return format_score
    value = _evaluate(expression)
    if value is None:
        return format_score
    return 1.0 if abs(value - goal) < Fraction(1, 100_000) else format_score


def check_sudoku_grid(grid: str, what: str) -> str:
    """``grid`` as a 16-digit string; ValueError naming ``what`` otherwise."""
    grid = str(grid).strip()
    if len(grid) != 16 or not grid.isdigit():
        raise ValueError(f"sudoku {what} must be 16 digits (a 4x4 grid read row by row), got {grid!r}")
    return grid


def sudoku_reward(response: str, solution: str, puzzle: str) -> float:
    """DARE's sudoku score: the fraction of the puzzle's empty cells the answer fills with the solution's digit."""
    solution, puzzle = check_sudoku_grid(solution, "solution"), check_sudoku_grid(puzzle, "puzzle")
    answer = last_answer_tag(response)
    if answer is None:
        return 0.0
    digits = "".join(c for c in answer if c.isdigit())
    if not digits:
        return 0.0
    digits = (digits + "0" * 16)[:16]
    empty = [i for i in range(16) if puzzle[i] == "0"]
    if not empty:
        return 0.0
    return sum(digits[i] == solution[i] for i in empty) / len(empty)
