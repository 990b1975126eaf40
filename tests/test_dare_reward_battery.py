"""A battery of model outputs scored by megadare's ``auto`` rule on DARE rows, against what DARE's own reward code gives.

Every expected value below is the score of ``math_rm`` (``verl/utils/reward_score/math_reward.py:599-635`` of DARE
@83ae8a3: the last ``\\boxed{}`` only, ``_get_deepscaler_rule_base_reward`` 491-527; countdown 530-568; sudoku
571-596), run on that case. The cases stress extraction and grading: several boxes, nested braces, ``\\frac`` vs
``a/b``, units, ``%``, ``$``, trailing periods, "The answer is" without a box, an empty output, EOS / pad residue,
unicode minus and digits, thousands separators, tuples, countdown answers using a number twice or a wrong set or
dividing by zero, sudoku grids of the wrong size. Setting ``DARE_SRC`` to a DARE checkout also runs DARE's functions
on the battery (``test_battery_against_dare_source``); without it that test is skipped, saying so.
"""

from __future__ import annotations

import contextlib
import io
import os

import pytest

from megadare.rewards import score_batch

from dare_source import dare_file, dare_src

MATH = [
    ("The answer is \\boxed{5}.", "5", 1.0),
    ("\\boxed{3} then \\boxed{5}", "5", 1.0),
    ("\\boxed{5} then \\boxed{3}", "5", 0.0),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac12}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{2/4}", "\\frac{1}{2}", 0.0),
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 0.0),
    ("\\boxed{{5}}", "5", 1.0),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}", 1.0),
    ("\\boxed{10\\%}", "10", 1.0),
    ("\\boxed{10\\%}", "10\\%", 1.0),
    ("\\boxed{10%}", "10", 1.0),
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("\\boxed{5\\text{ cm}}", "5", 1.0),
    ("\\boxed{5 cm}", "5", 1.0),
    ("\\boxed{5 meters}", "5", 1.0),
    ("\\boxed{\\$5}", "5", 1.0),
    ("\\boxed{5.}", "5", 1.0),
    ("\\boxed{5}.", "5", 1.0),
    ("The answer is 5", "5", 0.0),
    ("The answer is 5.", "5", 0.0),
    ("Answer: 5", "5", 0.0),
    ("5", "5", 0.0),
    ("", "5", 0.0),
    ("\\boxed{}", "5", 0.0),
    ("\\boxed{5", "5", 0.0),
    ("\\boxed 5", "5", 0.0),
    ("\\fbox{5}", "5", 0.0),
    ("\\boxed{5}<|endoftext|>", "5", 1.0),
    ("\\boxed{5}<|im_end|><|endoftext|><|endoftext|>", "5", 1.0),
    ("\\boxed{5<|endoftext|>}", "5", 0.0),
    ("\\boxed{5}</s>", "5", 1.0),
    ("\\boxed{−5}", "-5", 0.0),
    ("\\boxed{-5}", "-5", 1.0),
    ("\\boxed{- 5}", "-5", 1.0),
    ("\\boxed{5}", "-5", 0.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{1,000,000}", "1000000", 1.0),
    ("\\boxed{1 000}", "1000", 1.0),
    ("\\boxed{1000}", "1,000", 1.0),
    ("\\boxed{1,00}", "100", 0.0),
    ("\\boxed{5.0}", "5", 1.0),
    ("\\boxed{5.00}", "5", 1.0),
    ("\\boxed{05}", "5", 1.0),
    ("\\boxed{x=5}", "5", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{ab=5}", "5", 1.0),
    ("\\boxed{\\text{5}}", "5", 1.0),
    ("\\boxed{\\textbf{5}}", "5", 1.0),
    ("\\boxed{\\text{(A)}}", "A", 1.0),
    ("\\boxed{A}", "\\text{(A)}", 1.0),
    ("\\boxed{(A)}", "A", 1.0),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{\\frac{\\sqrt2}{2}}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),
    ("\\boxed{(1,2)}", "(1,2)", 1.0),
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("\\boxed{[1,2)}", "(1,2)", 0.0),
    ("\\boxed{(2,1)}", "(1,2)", 0.0),
    ("\\boxed{1,2}", "(1,2)", 0.0),
    ("\\boxed{\\left(1,2\\right)}", "(1,2)", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{(x+1)^{2}}", "(x+1)^2", 1.0),
    ("\\boxed{\\pi}", "\\pi", 1.0),
    ("\\boxed{3.14}", "\\pi", 0.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{90^{\\circ}}", "90", 1.0),
    ("\\boxed{90 degrees}", "90", 1.0),
    ("\\boxed{\\infty}", "\\infty", 1.0),
    ("\\boxed{1 or 2}", "1, 2", 1.0),
    ("\\boxed{1 and 2}", "1,2", 1.0),
    ("\\boxed{2, 1}", "1,2", 0.0),
    ("\\boxed{3 million}", "3000000", 0.0),
    ("\\boxed{7 \\frac{3}{4}}", "\\frac{31}{4}", 1.0),
    ("\\boxed{7\\frac34}", "7\\frac{3}{4}", 1.0),
    ("\\boxed{\\frac{31}{4}}", "7\\frac{3}{4}", 1.0),
    ("\\boxed{1e3}", "1000", 1.0),
    ("\\boxed{10^3}", "1000", 0.0),
    ("\\boxed{9^{9^{9}}}", "5", 0.0),
    ("\\boxed{\\frac{a}{b}}", "a/b", 1.0),
    ("\\boxed{\\boxed{5}}", "5", 1.0),
    ("\\boxed{5}\\boxed{}", "5", 0.0),
    ("\\boxed{\\text{Yes}}", "yes", 1.0),
    ("\\boxed{YES}", "Yes", 1.0),
    ("\\boxed{2}", "\\boxed{2}", 1.0),
    ("\\boxed{2}", "The answer is \\boxed{2}.", 1.0),
    ("\\boxed{.5}", "\\frac12", 1.0),
    ("\\boxed{0.50}", "\\frac{1}{2}", 1.0),
    ("\\boxed{50\\%}", "\\frac{1}{2}", 0.0),
    ("\\boxed{-\\frac{1}{2}}", "-\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{-1}{2}}", "-\\frac{1}{2}", 1.0),
    ("\\boxed{-1/2}", "-\\frac{1}{2}", 1.0),
    ("\\boxed{18}", "18.0", 1.0),
    ("\\boxed{18}", 18, 1.0),
    ("\\boxed{18}", 18.0, 1.0),
    ("\\boxed{18.5}", 18.5, 1.0),
    ("\\boxed{ 18 }", "18", 1.0),
    ("\\boxed{18\n}", "18", 1.0),
    ("$\\boxed{18}$", "18", 1.0),
    ("\\boxed{\\$18.00}", "18", 1.0),
    ("\\boxed{18 dollars}", "18", 0.0),
    ("\\boxed{\\text{18 dollars}}", "18", 0.0),
    ("**Final Answer** \\[ \\boxed{42} \\]", "42", 1.0),
    ("\\boxed{4\\!,\\!000}", "4000", 1.0),
    ("\\boxed{4,\\!000}", "4000", 1.0),
    ("\\boxed{a \\le b}", "a\\leq b", 1.0),
    ("\\boxed{\\{1, 2, 3\\}}", "1,2,3", 1.0),
    ("\\boxed{x \\in [1,2]}", "[1,2]", 0.0),
    ("\\boxed{[1,2]}", "[1, 2]", 1.0),
    ("\\boxed{\\frac{1}{0}}", "5", 0.0),
    ("\\boxed{1/0}", "5", 0.0),
    ("\\boxed{\\sqrt{}}", "5", 0.0),
    ("\\boxed{\\frac}", "5", 0.0),
    ("\\boxed{\\frac1}", "5", 0.0),
    ("\\boxed{x}", "x", 1.0),
    ("\\boxed{X}", "x", 1.0),
    ("\\boxed{2x}", "2 x", 1.0),
    ("\\boxed{2*x}", "2x", 1.0),
    ("\\boxed{i}", "i", 1.0),
    ("\\boxed{\\sqrt{-1}}", "i", 0.0),
    ("\\boxed{e}", "e", 1.0),
    ("\\boxed{2.71828}", "e", 0.0),
    ("\\boxed{1/3}", "0.333", 0.0),
    ("\\boxed{0.3333333333}", "1/3", 0.0),
    ("\\boxed{ 5 }.", " 5 ", 1.0),
    ("\\boxed{5}", " 5 ", 1.0),
    ("\\boxed{5}", "5\n", 1.0),
    ("\\boxed{\\mathbf{5}}", "5", 1.0),
    ("\\boxed{\\displaystyle 5}", "5", 1.0),
    ("\\boxed{5\\,\\text{cm}^2}", "5", 0.0),
    ("\\boxed{5 \\text{ cm}^2}", "5", 1.0),
    ("\\boxed{5 \\mbox{ cm}}", "5", 1.0),
    ("\\boxed{12}\n\n<|endoftext|><|endoftext|>", "12", 1.0),
    ("\\boxed{x^2}", "x^{2}", 1.0),
    ("\\boxed{2^{10}}", "1024", 0.0),
    ("\\boxed{2^10}", "1024", 0.0),
    ("\\boxed{\\frac{3}{2}}", "1.5", 1.0),
    ("\\boxed{1.5}", "\\frac{3}{2}", 1.0),
    ("\\boxed{3/2}", "1.5", 1.0),
    ("\\boxed{１２}", "12", 1.0),
    ("\\boxed{12}", "１２", 1.0),
    ("\\boxed{٣}", "3", 1.0),
]
COUNTDOWN = [
    ("<reasoning>x</reasoning>\n<answer>\n2*4-3\n</answer>", "5", "[2, 3, 4]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n2*4-3\n</answer>", "5", "[2, 3, 4, 4]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n2*4-3-4+4\n</answer>", "5", "[2, 3, 4]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n4*4-3\n</answer>", "13", "[2, 3, 4]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n2*5-3\n</answer>", "7", "[2, 3, 4]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n(4-2)*3\n</answer>", "6", "[2, 3, 4]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n4/(3-3)+2\n</answer>", "6", "[2, 3, 3, 4]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n4/(2-2)\n</answer>", "6", "[2, 2, 4]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n2*4-3 = 5\n</answer>", "5", "[2, 3, 4]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n2×4−3\n</answer>", "5", "[2, 3, 4]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n2**4-3\n</answer>", "13", "[2, 3, 4]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n4//3+2\n</answer>", "3", "[2, 3, 4]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n4/3*3+2\n</answer>", "6", "[2, 3, 3, 4]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n(30+93)-100\n</answer>", "23", "[30, 100, 93]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n30 + 93 - 100\n</answer>", "23", "[30, 100, 93]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n030+93-100\n</answer>", "23", "[30, 100, 93]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n30.0+93-100\n</answer>", "23", "[30, 100, 93]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n-30+93-100+60\n</answer>", "23", "[30, 100, 93, 60]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n\n</answer>", "23", "[30, 100, 93]", 0.1),
    ("<answer></answer>", "23", "[30, 100, 93]", 0.1),
    ("no tags 30+93-100", "23", "[30, 100, 93]", 0.0),
    ("", "23", "[30, 100, 93]", 0.0),
    (
        "<reasoning>x</reasoning>\n<answer>\n30+93-100\n</answer><reasoning>x</reasoning>\n<answer>\n1+2\n</answer>",
        "23",
        "[30, 100, 93]",
        0.1,
    ),
    (
        "<reasoning>x</reasoning>\n<answer>\n1+2\n</answer><reasoning>x</reasoning>\n<answer>\n30+93-100\n</answer>",
        "23",
        "[30, 100, 93]",
        1.0,
    ),
    ("<reasoning>x</reasoning>\n<answer>\n30+93-100\n</answer><|endoftext|>", "23", "[30, 100, 93]", 1.0),
    ("<answer>30+93-100<|endoftext|></answer>", "23", "[30, 100, 93]", 0.1),
    ("<answer>30+93-100", "23", "[30, 100, 93]", 0.0),
    ("<ANSWER>30+93-100</ANSWER>", "23", "[30, 100, 93]", 0.0),
    ("<reasoning>x</reasoning>\n<answer>\n(30+93-100\n</answer>", "23", "[30, 100, 93]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n30+93-100)\n</answer>", "23", "[30, 100, 93]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n((30+93)-100)\n</answer>", "23", "[30, 100, 93]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n30+(93-100)\n</answer>", "23", "[30, 100, 93]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n30 93 100\n</answer>", "23", "[30, 100, 93]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n100-93+30-14\n</answer>", "23", "[30, 100, 93, 14]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n1/3+1/3+1/3\n</answer>", "1", "[1, 1, 1, 3, 3, 3]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n(1/3)*3\n</answer>", "1", "[1, 3]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n10/3*3\n</answer>", "10", "[10, 3, 3]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n7/3*3\n</answer>", "7", "[7, 3, 3]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n100/7*7\n</answer>", "100", "[100, 7, 7]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n2e3\n</answer>", "2000", "[2, 3]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n23\n</answer>", "23", "[23]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n+23\n</answer>", "23", "[23]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n1_0+13\n</answer>", "23", "[1, 0, 13]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n30+93-100\n\n</answer>", "23", "[30, 100, 93]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n30+93-100.\n</answer>", "23", "[30, 100, 93]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n30+93-100\n</answer>", " 23 ", "[30, 100, 93]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n30+93-100\n</answer>", "23", [30, 100, 93], 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n٣٠+93-100\n</answer>", "23", "[30, 100, 93]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n30 + 93 - 100 = 23\n</answer>", "23", "[30, 100, 93, 23]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n3 0+93-100\n</answer>", "23", "[3, 0, 100, 93]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n(2)(3)\n</answer>", "6", "[2, 3]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n2(3)\n</answer>", "6", "[2, 3]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n6/4*4\n</answer>", "6", "[6, 4, 4]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n0.1+0.2\n</answer>", "0", "[0, 1, 0, 2]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n2**4-3\n</answer>", "13", "[2, 4, 3]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n2**-1*4+3\n</answer>", "5", "[2, 1, 4, 3]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n0**-1+3\n</answer>", "3", "[0, 1, 3]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n4**0.5+3\n</answer>", "5", "[4, 0, 5, 3]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n(0-8)**(1/3)\n</answer>", "2", "[0, 8, 1, 3]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n-2**2+9\n</answer>", "5", "[2, 2, 9]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n(-2)**2+1\n</answer>", "5", "[2, 2, 1]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n1**100**100+4\n</answer>", "5", "[1, 100, 100, 4]", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n(99**99)**9/99**99**1\n</answer>", "1", "[99, 99, 9, 99, 99, 1]", 0.1),
    ("<reasoning>x</reasoning>\n<answer>\n2**2.0+1\n</answer>", "5", "[2, 2, 0, 1]", 1.0),
]
SUDOKU = [
    ("<reasoning>x</reasoning>\n<answer>\n3142243142131324\n</answer>", "3142243142131324", "3102200002100320", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n3142 2431 4213 1324\n</answer>", "3142243142131324", "3102200002100320", 1.0),
    (
        "<reasoning>x</reasoning>\n<answer>\n3142\n2431\n4213\n1324\n</answer>",
        "3142243142131324",
        "3102200002100320",
        1.0,
    ),
    (
        "<reasoning>x</reasoning>\n<answer>\n[[3,1,4,2],[2,4,3,1],[4,2,1,3],[1,3,2,4]]\n</answer>",
        "3142243142131324",
        "3102200002100320",
        1.0,
    ),
    ("<reasoning>x</reasoning>\n<answer>\n314224314213132\n</answer>", "3142243142131324", "3102200002100320", 0.875),
    ("<reasoning>x</reasoning>\n<answer>\n31422431421313244\n</answer>", "3142243142131324", "3102200002100320", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n0000243142131324\n</answer>", "3142243142131324", "3102200002100320", 0.875),
    ("<reasoning>x</reasoning>\n<answer>\n1111111111111111\n</answer>", "3142243142131324", "3102200002100320", 0.25),
    ("<reasoning>x</reasoning>\n<answer>\nabc\n</answer>", "3142243142131324", "3102200002100320", 0.0),
    ("<reasoning>x</reasoning>\n<answer>\n\n</answer>", "3142243142131324", "3102200002100320", 0.0),
    ("", "3142243142131324", "3102200002100320", 0.0),
    ("3142243142131324", "3142243142131324", "3102200002100320", 0.0),
    (
        "<reasoning>x</reasoning>\n<answer>\n3142243142131324\n</answer><reasoning>x</reasoning>\n<answer>\n1111\n</answer>",
        "3142243142131324",
        "3102200002100320",
        0.0,
    ),
    ("<reasoning>x</reasoning>\n<answer>\n３142243142131324\n</answer>", "3142243142131324", "3102200002100320", 1.0),
    (
        "<reasoning>x</reasoning>\n<answer>\n3142243142131324\n</answer><|endoftext|>",
        "3142243142131324",
        "3102200002100320",
        1.0,
    ),
    ("<reasoning>x</reasoning>\n<answer>\n31\n</answer>", "3142243142131324", "3102200002100320", 0.0),
    ("<reasoning>x</reasoning>\n<answer>\n3²42243142131324\n</answer>", "3142243142131324", "3102200002100320", 1.0),
    ("<reasoning>x</reasoning>\n<answer>\n3142243142131324\n</answer>", "3142243142131324", "3142243142131324", 0.0),
]


def _rows(kind: str) -> tuple[list[str], list[dict], list[float]]:
    if kind == "math":
        recs = [{"data_source": "math", "extra_info": {"task": "math"}, "answer": g} for _, g, _ in MATH]
        return [r for r, _, _ in MATH], recs, [v for _, _, v in MATH]
    if kind == "countdown":
        recs = [
            {"data_source": "countdown", "extra_info": {"task": "math", "numbers": n}, "answer": t}
            for _, t, n, _ in COUNTDOWN
        ]
        return [r for r, _, _, _ in COUNTDOWN], recs, [v for *_, v in COUNTDOWN]
    recs = [
        {"data_source": "sudoku", "extra_info": {"task": "math", "puzzle": p}, "answer": s} for _, s, p, _ in SUDOKU
    ]
    return [r for r, _, _, _ in SUDOKU], recs, [v for *_, v in SUDOKU]


@pytest.mark.parametrize("kind", ["math", "countdown", "sudoku"])
def test_auto_scores_the_battery_as_dare(kind):
    responses, records, want = _rows(kind)
    got, stats = score_batch("auto", responses, records, workers=2, timeout_s=120)
    assert stats.failures == 0, stats.failed
    wrong = [(r, rec.get("answer"), g, w) for r, rec, g, w in zip(responses, records, got, want) if abs(g - w) > 1e-9]
    assert not wrong, f"{len(wrong)} cases differ from DARE (response, gold, megadare, DARE): {wrong[:5]}"


def _dare_math_module():
    dare_src()  # skips, saying so, without DARE_SRC
    pytest.importorskip("pylatexenc", reason="DARE's math_reward.py imports pylatexenc")
    return dare_file(os.path.join("verl", "utils", "reward_score", "math_reward.py"), "dare_math_reward")


def test_battery_against_dare_source():
    dare = _dare_math_module()
    with contextlib.redirect_stdout(io.StringIO()):  # DARE prints every countdown / sudoku verdict
        got = [float(dare.math_rm("math", r, g, {"task": "math"})["score"]) for r, g, _ in MATH]
        got += [
            float(dare.math_rm("countdown", r, t, {"task": "math", "numbers": n})["score"]) for r, t, n, _ in COUNTDOWN
        ]
        got += [float(dare.math_rm("sudoku", r, s, {"task": "math", "puzzle": p})["score"]) for r, s, p, _ in SUDOKU]
    want = [c[-1] for c in MATH + COUNTDOWN + SUDOKU]
    assert got == want, "DARE's rewards changed: regenerate the expected values of this battery"
