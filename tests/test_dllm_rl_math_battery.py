"""``dllm_rl_math`` against dLLM-RL's whole math grading (Gen-Verse/dLLM-RL @10b4fd1) on a broad battery: FAMILIES
(each answer of a family against each of its golds, in ``\\boxed{}``) and RESPONSES, 958 pairs by input class.

dLLM-RL's verdict is ``sample/trado_rl_rollout.py::extract_final_boxed_answer``, then ``reward/math_utils.py::
is_equal`` in its legacy mode (``is_equiv``, the ``repeatness`` guard, ``_is_latex_equal``), as
tests/dllm_rl_source.py's ``math_is_equal`` calls them. Its last stage depends on the environment: sympy's
``parse_latex`` runs only under antlr4-python3-runtime 4.11 (dLLM-RL's requirements install 4.9.3: omegaconf pins
it); elsewhere the Minerva strings decide. RECORDED holds, from those functions, every pair where the two
environments' verdicts differ or where megadare's rule before this change (math-verify after the strings) differed
from them: ``strings`` under antlr4 4.13.2 (megadare's venv, parse_latex raising ImportError), ``sympy`` under
sympy 1.14.0 + antlr4-python3-runtime 4.11.1. With ``DLLM_RL_SRC`` set, the ``test_live_*`` tests rerun dLLM-RL's
code on RECORDED and on the whole battery (where the live run found 0 of 958 pairs differing, in each environment).

Findings: math-verify in the place of dLLM-RL's last stage disagreed with dLLM-RL as installed (strings) on 189 of
the 958 pairs, and with dLLM-RL under antlr4 4.11 on 72: it took ``25%``, ``2\\frac{1}{2}`` for 5/2, ``Yes`` for
yes, ``(1;2)`` for (1,2), ``\\mathrm{A}`` for A, ``−3`` (U+2212) for -3, which sympy refuses, and refused ``A)`` and
``A. 5`` for A, ``1\\,2`` for 12, ``x=3,y=4`` for x=3, ``1+1i`` for 1+i, which sympy takes. ``dllm_rl_math`` now runs
dLLM-RL's own last stage (megadare.rewards.dllm_rl_latex) as the environment allows it.
"""

from __future__ import annotations

import itertools

import dllm_rl_source as D
from megadare.rewards import score_batch
from megadare.rewards.dllm_rl_latex import sympy_latex_runs


def bx(answer: str) -> str:
    return "So the answer is \\boxed{" + answer + "}."


FAMILIES = [
    ("fraction", [
        "\\frac{3}{4}", "3/4", "\\dfrac{3}{4}", "\\tfrac34", "\\frac34", "0.75", "6/8", "\\frac{6}{8}", ".75",
        "75\\%", "\\frac{3}{4}\\text{ cm}", "\\left(\\frac{3}{4}\\right)", "-\\frac{3}{4}", "\\frac{-3}{-4}",
        "3\\div4", "\\frac{3.0}{4}",
    ], [
        "\\frac{3}{4}", "3/4", "0.75",
    ]),
    ("mixed", [
        "2\\frac{1}{2}", "2 \\frac{1}{2}", "\\frac{5}{2}", "2.5", "5/2",
    ], [
        "\\frac{5}{2}", "2\\frac{1}{2}", "2.5",
    ]),
    ("decimal", [
        "0.1", "0.10", "1/10", "\\frac{1}{10}", "1.0e-1", "10^{-1}", "0.1000001", "0.09999", "1e-1",
    ], [
        "0.1", "\\frac{1}{10}",
    ]),
    ("integer", [
        "12", "12.0", "012", "+12", "12.", "\\{12\\}", "(12)", "[12]", "12\\,", "1\\,2", "1 2", "\\mathbf{12}",
        "\\mathrm{12}", "\\textbf{12}", "12^{\\circ}", "12^\\circ\\text{C}", "\\$12.00", "12 \\text{dollars}",
        "12\\text{ units}", "twelve", "12 apples", "12 \\mathrm{cm}", "12\\ \\text{cm}", "1.2\\times10^{1}",
        "1.2 \\cdot 10", "2\\cdot6", "3\\times 4", "144^{1/2}", "\\sqrt{144}",
    ], [
        "12", "12.0",
    ]),
    ("percent", [
        "25\\%", "25%", "25", "0.25", "\\frac{1}{4}", "25 \\%", "25\\text{ percent}", "25 percent",
    ], [
        "25\\%", "25", "0.25",
    ]),
    ("units", [
        "5\\text{ m}", "5\\,\\text{m}", "5 \\text{ meters}", "5\\text{m}", "5 m", "5\\text{ km}", "5\\mbox{ inches}",
        "5 \\text{ sq units}", "5\\text{ square units}", "5 \\text{ hours}", "5\\text{ minutes}",
        "5 \\text{degrees}", "5^\\circ", "5^{\\circ}", "5\\text{ cm}^2", "5\\text{ cm}^3", "5\\text{ ft}",
    ], [
        "5",
    ]),
    ("tuple", [
        "(1,2)", "(1, 2)", "\\left(1,2\\right)", "(2,1)", "1,2", "(1;2)", "[1,2]", "(1,2,3)", "\\{1,2\\}",
        "(1.0,2.0)", "\\left( 1, 2 \\right)", "(\\frac{1}{2},2)", "(0.5,2)",
    ], [
        "(1,2)", "(0.5,2)", "(\\frac{1}{2}, 2)",
    ]),
    ("interval", [
        "[0,1]", "[0, 1]", "(0,1]", "[0,1)", "\\left[0,1\\right]", "0\\le x\\le1", "[0,\\infty)", "[0, \\infty)",
        "(-\\infty,\\infty)", "\\mathbb{R}", "(-\\infty, 2) \\cup (3, \\infty)", "(-\\infty,2)\\cup(3,\\infty)",
        "x<2 \\text{ or } x>3",
    ], [
        "[0,1]", "[0,\\infty)", "(-\\infty,2)\\cup(3,\\infty)",
    ]),
    ("equation", [
        "x=3", "x = 3", "y=3", "3", "x=3,y=4", "y=2x+1", "y = 2x + 1", "2x+1", "y=1+2x", "x^2-1=0", "a=3", "abc=3",
        "f(x)=3", "3=x",
    ], [
        "3", "x=3", "y=2x+1", "2x+1",
    ]),
    ("latex", [
        "\\sqrt{2}", "\\sqrt2", "2^{1/2}", "\\sqrt{8}/2", "\\frac{\\sqrt{8}}{2}", "1.41421356",
        "\\frac{2}{\\sqrt{2}}", "\\pi", "3.14159", "\\frac{\\pi}{2}", "\\pi/2", "90^\\circ", "\\frac12\\pi", "e",
        "e^{1}", "\\exp(1)", "\\ln 2", "\\log 2", "\\sin\\frac{\\pi}{6}", "\\cos 0", "2\\sqrt{2}", "\\sqrt{8}", "i",
        "\\sqrt{-1}", "\\infty", "\\binom{5}{2}", "10", "5!", "120", "|{-3}|", "3", "\\lfloor 3.5\\rfloor",
        "\\lceil 2.5\\rceil",
    ], [
        "\\sqrt{2}", "\\frac{\\pi}{2}", "e", "10", "120", "3", "\\sqrt{8}",
    ]),
    ("algebra", [
        "x^2+2x+1", "(x+1)^2", "x^{2}+2x+1", "x**2+2*x+1", "1+2x+x^2", "(x+1)(x+1)", "x(x+2)+1", "2x+x^2+1", "a+b",
        "b+a", "ab", "a\\cdot b", "a*b", "\\frac{a}{b}", "a/b", "\\frac{x}{2}", "x/2", "0.5x", "\\frac{1}{2}x",
    ], [
        "x^2+2x+1", "a+b", "ab", "\\frac{x}{2}",
    ]),
    ("choice", [
        "A", "(A)", "\\text{A}", "\\text{(A)}", "\\textbf{(A)}", "A)", "a", "B", "\\mathrm{A}", "\\text{(A) } 5",
        "A. 5",
    ], [
        "A", "(A)", "\\text{(A)}",
    ]),
    ("text", [
        "\\text{yes}", "yes", "Yes", "YES", "\\text{Yes}", "no", "\\text{even}", "even", "\\text{odd}",
        "\\text{Monday}", "Monday", "\\text{monday}",
    ], [
        "\\text{yes}", "yes", "\\text{even}", "\\text{Monday}",
    ]),
    ("big", [
        "1000000", "1,000,000", "10^6", "1e6", "1\\,000\\,000", "1{,}000{,}000", "1 000 000", "1000000.0", "999999",
        "1.0\\times10^6",
    ], [
        "1000000", "1,000,000", "10^6",
    ]),
    ("negative", [
        "-3", "- 3", "−3", "(-3)", "-(3)", "\\left(-3\\right)", "-3.0", "3", "+-3", "--3", "-\\frac{6}{2}",
        "\\frac{-6}{2}", "-6/2",
    ], [
        "-3", "-\\frac{6}{2}",
    ]),
    ("matrix", [
        "\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}",
        "\\begin{bmatrix}1\\\\2\\end{bmatrix}", "(1,2)", "\\begin{pmatrix}1&2\\end{pmatrix}",
        "\\begin{pmatrix}1\\\\3\\end{pmatrix}", "\\begin{pmatrix}2/2\\\\4/2\\end{pmatrix}",
    ], [
        "\\begin{pmatrix}1\\\\2\\end{pmatrix}",
    ]),
    ("complex", [
        "1+i", "i+1", "1+1i", "1 + i", "\\sqrt{2}e^{i\\pi/4}", "1-i", "(1+i)",
    ], [
        "1+i",
    ]),
    ("malformed", [
        "", " ", "{", "}", "\\frac", "\\frac{", "\\sqrt", "\\sqrt{", "\\frac{1}", "((", "))", "$", "$$", "\\",
        "\\\\", "\\text{", "^", "_", "=", "==", "x==3", "1/0", "\\frac{1}{0}", "0/0", "\\infty-\\infty", "nan",
        "None", "\\left(", "\\right)", "&", "#", "%", "3 3 3", "3,", ",3", "3=", "=3", "\\boxed{3}", "\\fbox{3}",
        "3\\\\", "\\text{ } 3", "3\\text{ }\\text{ }", "\\frac{3}{1}",
    ], [
        "3", "\\frac{1}{0}", "",
    ]),
    ("comma", [
        "1,2", "12", "1,234", "1234", "1, 234", "1{,}234", "1.234", "1,234.5", "1234.5",
    ], [
        "1234", "1,234", "12", "1,234.5",
    ]),
]  # fmt: skip

RESPONSES = [
    ("boxed", "\\boxed{1} and then \\boxed{2}", "2"),
    ("boxed", "\\boxed{1} and then \\boxed{2}", "1"),
    ("boxed", "\\boxed{\\frac{1}{2}}", "1/2"),
    ("boxed", "\\boxed {3}", "3"),
    ("boxed", "\\boxed{{3}}", "3"),
    ("boxed", "$\\boxed{3}$", "3"),
    ("boxed", "\\[\\boxed{3}\\]", "3"),
    ("boxed", "\\boxed{3} \\boxed{", "3"),
    ("boxed", "\\boxed{3}}", "3"),
    ("boxed", "\\boxed{\\text{3}}", "3"),
    ("boxed", "\\boxed{3 \\text{ (final)}}", "3"),
    ("boxed", "\\boxed{x = \\boxed{3}}", "3"),
    ("boxed", "\\boxed{\\{3\\}}", "3"),
    ("boxed", "The answer is \\(\\boxed{3}\\).", "3"),
    ("boxed", "\\boxed{3.}", "3"),
    ("boxed", "\\boxed{3}\n\n\\boxed{3}", "3"),
    ("boxed", "\\boxed{\n3\n}", "3"),
    ("boxed", "\\fbox{3}", "3"),
    ("boxed", "\\boxed3", "3"),
    ("boxed", "", "3"),
    ("boxed", "3", "3"),
]
BATTERY = [(c, bx(p), g) for c, preds, golds in FAMILIES for p, g in itertools.product(preds, golds)] + RESPONSES

# (class, boxed answer, gold, dLLM-RL's is_equal: strings (antlr4 not 4.11, as its requirements install it), sympy
# (antlr4 4.11)): recorded from dllm_rl_source.math_is_equal on bx(answer)
RECORDED = [
    ("fraction", "\\frac{3}{4}", "0.75", 0, 1),
    ("fraction", "3/4", "0.75", 0, 1),
    ("fraction", "\\dfrac{3}{4}", "0.75", 0, 1),
    ("fraction", "\\tfrac34", "0.75", 0, 1),
    ("fraction", "\\frac34", "0.75", 0, 1),
    ("fraction", "0.75", "\\frac{3}{4}", 0, 1),
    ("fraction", "0.75", "3/4", 0, 1),
    ("fraction", "6/8", "\\frac{3}{4}", 0, 1),
    ("fraction", "6/8", "3/4", 0, 1),
    ("fraction", "6/8", "0.75", 0, 1),
    ("fraction", "\\frac{6}{8}", "\\frac{3}{4}", 0, 1),
    ("fraction", "\\frac{6}{8}", "3/4", 0, 1),
    ("fraction", "\\frac{6}{8}", "0.75", 0, 1),
    ("fraction", ".75", "\\frac{3}{4}", 0, 0),
    ("fraction", ".75", "3/4", 0, 0),
    ("fraction", "75\\%", "\\frac{3}{4}", 0, 0),
    ("fraction", "75\\%", "3/4", 0, 0),
    ("fraction", "75\\%", "0.75", 0, 0),
    ("fraction", "\\frac{3}{4}\\text{ cm}", "0.75", 0, 1),
    ("fraction", "\\left(\\frac{3}{4}\\right)", "\\frac{3}{4}", 0, 1),
    ("fraction", "\\left(\\frac{3}{4}\\right)", "3/4", 0, 1),
    ("fraction", "\\left(\\frac{3}{4}\\right)", "0.75", 0, 1),
    ("fraction", "\\frac{-3}{-4}", "\\frac{3}{4}", 0, 1),
    ("fraction", "\\frac{-3}{-4}", "3/4", 0, 1),
    ("fraction", "\\frac{-3}{-4}", "0.75", 0, 1),
    ("fraction", "3\\div4", "\\frac{3}{4}", 0, 1),
    ("fraction", "3\\div4", "3/4", 0, 1),
    ("fraction", "3\\div4", "0.75", 0, 1),
    ("fraction", "\\frac{3.0}{4}", "\\frac{3}{4}", 0, 1),
    ("fraction", "\\frac{3.0}{4}", "3/4", 0, 1),
    ("fraction", "\\frac{3.0}{4}", "0.75", 0, 1),
    ("mixed", "2\\frac{1}{2}", "\\frac{5}{2}", 0, 0),
    ("mixed", "2\\frac{1}{2}", "2.5", 0, 0),
    ("mixed", "2 \\frac{1}{2}", "\\frac{5}{2}", 0, 0),
    ("mixed", "2 \\frac{1}{2}", "2.5", 0, 0),
    ("mixed", "\\frac{5}{2}", "2\\frac{1}{2}", 0, 0),
    ("mixed", "\\frac{5}{2}", "2.5", 0, 1),
    ("mixed", "2.5", "\\frac{5}{2}", 0, 1),
    ("mixed", "2.5", "2\\frac{1}{2}", 0, 0),
    ("mixed", "5/2", "2\\frac{1}{2}", 0, 0),
    ("mixed", "5/2", "2.5", 0, 1),
    ("decimal", "0.1", "\\frac{1}{10}", 0, 1),
    ("decimal", "0.10", "\\frac{1}{10}", 0, 1),
    ("decimal", "1/10", "0.1", 0, 1),
    ("decimal", "\\frac{1}{10}", "0.1", 0, 1),
    ("decimal", "10^{-1}", "0.1", 0, 1),
    ("decimal", "10^{-1}", "\\frac{1}{10}", 0, 1),
    ("decimal", "0.1000001", "0.1", 0, 0),
    ("decimal", "0.1000001", "\\frac{1}{10}", 0, 0),
    ("integer", "\\{12\\}", "12", 0, 1),
    ("integer", "\\{12\\}", "12.0", 0, 1),
    ("integer", "(12)", "12", 0, 1),
    ("integer", "(12)", "12.0", 0, 1),
    ("integer", "[12]", "12", 0, 1),
    ("integer", "[12]", "12.0", 0, 1),
    ("integer", "12\\,", "12", 0, 1),
    ("integer", "12\\,", "12.0", 0, 1),
    ("integer", "1\\,2", "12", 0, 1),
    ("integer", "1\\,2", "12.0", 0, 1),
    ("integer", "\\mathbf{12}", "12", 0, 0),
    ("integer", "\\mathrm{12}", "12", 0, 0),
    ("integer", "\\textbf{12}", "12.0", 0, 1),
    ("integer", "12^\\circ\\text{C}", "12", 0, 0),
    ("integer", "12^\\circ\\text{C}", "12.0", 0, 0),
    ("integer", "12 \\text{dollars}", "12.0", 0, 1),
    ("integer", "12 apples", "12", 0, 0),
    ("integer", "12 apples", "12.0", 0, 0),
    ("integer", "12 \\mathrm{cm}", "12", 0, 0),
    ("integer", "12 \\mathrm{cm}", "12.0", 0, 0),
    ("integer", "12\\ \\text{cm}", "12.0", 0, 1),
    ("integer", "1.2\\times10^{1}", "12", 0, 1),
    ("integer", "1.2\\times10^{1}", "12.0", 0, 1),
    ("integer", "1.2 \\cdot 10", "12", 0, 1),
    ("integer", "1.2 \\cdot 10", "12.0", 0, 1),
    ("integer", "2\\cdot6", "12", 0, 1),
    ("integer", "2\\cdot6", "12.0", 0, 1),
    ("integer", "3\\times 4", "12", 0, 1),
    ("integer", "3\\times 4", "12.0", 0, 1),
    ("integer", "144^{1/2}", "12", 0, 1),
    ("integer", "144^{1/2}", "12.0", 0, 1),
    ("integer", "\\sqrt{144}", "12", 0, 1),
    ("integer", "\\sqrt{144}", "12.0", 0, 1),
    ("percent", "25\\%", "0.25", 0, 0),
    ("percent", "25%", "25\\%", 0, 0),
    ("percent", "25%", "25", 0, 0),
    ("percent", "25%", "0.25", 0, 0),
    ("percent", "0.25", "25\\%", 0, 0),
    ("percent", "\\frac{1}{4}", "25\\%", 0, 0),
    ("percent", "\\frac{1}{4}", "0.25", 0, 1),
    ("percent", "25 \\%", "0.25", 0, 0),
    ("percent", "25 percent", "25\\%", 0, 0),
    ("percent", "25 percent", "25", 0, 0),
    ("percent", "25 percent", "0.25", 0, 0),
    ("units", "5\\,\\text{m}", "5", 0, 1),
    ("units", "5 m", "5", 0, 0),
    ("tuple", "1,2", "(1,2)", 0, 0),
    ("tuple", "(1;2)", "(1,2)", 0, 0),
    ("tuple", "\\{1,2\\}", "(1,2)", 0, 0),
    ("tuple", "(1.0,2.0)", "(1,2)", 0, 0),
    ("tuple", "(\\frac{1}{2},2)", "(0.5,2)", 0, 0),
    ("tuple", "(0.5,2)", "(\\frac{1}{2}, 2)", 0, 0),
    ("equation", "x=3,y=4", "x=3", 0, 1),
    ("equation", "y=1+2x", "y=2x+1", 0, 1),
    ("equation", "y=1+2x", "2x+1", 0, 0),
    ("equation", "abc=3", "3", 0, 0),
    ("equation", "f(x)=3", "3", 0, 0),
    ("equation", "3=x", "x=3", 0, 0),
    ("latex", "2^{1/2}", "\\sqrt{2}", 0, 1),
    ("latex", "\\sqrt{8}/2", "\\sqrt{2}", 0, 1),
    ("latex", "\\frac{\\sqrt{8}}{2}", "\\sqrt{2}", 0, 1),
    ("latex", "1.41421356", "\\sqrt{2}", 0, 0),
    ("latex", "\\frac{2}{\\sqrt{2}}", "\\sqrt{2}", 0, 1),
    ("latex", "\\pi/2", "\\frac{\\pi}{2}", 0, 1),
    ("latex", "\\frac12\\pi", "\\frac{\\pi}{2}", 0, 1),
    ("latex", "e^{1}", "e", 0, 1),
    ("latex", "\\exp(1)", "e", 0, 0),
    ("latex", "2\\sqrt{2}", "\\sqrt{8}", 0, 1),
    ("latex", "\\binom{5}{2}", "10", 0, 1),
    ("latex", "5!", "120", 0, 1),
    ("latex", "|{-3}|", "3", 0, 1),
    ("latex", "\\lfloor 3.5\\rfloor", "3", 0, 1),
    ("latex", "\\lceil 2.5\\rceil", "3", 0, 1),
    ("algebra", "(x+1)^2", "x^2+2x+1", 0, 0),
    ("algebra", "x^{2}+2x+1", "x^2+2x+1", 0, 1),
    ("algebra", "1+2x+x^2", "x^2+2x+1", 0, 1),
    ("algebra", "(x+1)(x+1)", "x^2+2x+1", 0, 0),
    ("algebra", "x(x+2)+1", "x^2+2x+1", 0, 0),
    ("algebra", "2x+x^2+1", "x^2+2x+1", 0, 1),
    ("algebra", "b+a", "a+b", 0, 1),
    ("algebra", "a\\cdot b", "ab", 0, 1),
    ("algebra", "a*b", "ab", 0, 1),
    ("algebra", "x/2", "\\frac{x}{2}", 0, 1),
    ("algebra", "0.5x", "\\frac{x}{2}", 0, 1),
    ("algebra", "\\frac{1}{2}x", "\\frac{x}{2}", 0, 1),
    ("choice", "A", "(A)", 0, 1),
    ("choice", "A", "\\text{(A)}", 0, 1),
    ("choice", "(A)", "A", 0, 1),
    ("choice", "\\text{A}", "(A)", 0, 1),
    ("choice", "\\text{A}", "\\text{(A)}", 0, 1),
    ("choice", "\\text{(A)}", "A", 0, 1),
    ("choice", "\\textbf{(A)}", "A", 0, 1),
    ("choice", "A)", "A", 0, 1),
    ("choice", "A)", "(A)", 0, 1),
    ("choice", "A)", "\\text{(A)}", 0, 1),
    ("choice", "a", "A", 0, 0),
    ("choice", "a", "(A)", 0, 0),
    ("choice", "a", "\\text{(A)}", 0, 0),
    ("choice", "\\mathrm{A}", "A", 0, 0),
    ("choice", "\\mathrm{A}", "(A)", 0, 0),
    ("choice", "\\mathrm{A}", "\\text{(A)}", 0, 0),
    ("choice", "A. 5", "A", 0, 1),
    ("choice", "A. 5", "(A)", 0, 1),
    ("choice", "A. 5", "\\text{(A)}", 0, 1),
    ("text", "Yes", "\\text{yes}", 0, 0),
    ("text", "Yes", "yes", 0, 0),
    ("text", "YES", "\\text{yes}", 0, 0),
    ("text", "\\text{Yes}", "\\text{yes}", 0, 0),
    ("text", "\\text{Yes}", "yes", 0, 0),
    ("text", "\\text{monday}", "\\text{Monday}", 0, 0),
    ("big", "1000000", "10^6", 0, 1),
    ("big", "1,000,000", "10^6", 0, 1),
    ("big", "10^6", "1000000", 0, 1),
    ("big", "10^6", "1,000,000", 0, 1),
    ("big", "1\\,000\\,000", "1000000", 0, 1),
    ("big", "1\\,000\\,000", "1,000,000", 0, 1),
    ("big", "1\\,000\\,000", "10^6", 0, 1),
    ("big", "1{,}000{,}000", "10^6", 0, 1),
    ("big", "1 000 000", "10^6", 0, 1),
    ("big", "1000000.0", "10^6", 0, 1),
    ("big", "1.0\\times10^6", "1000000", 0, 1),
    ("big", "1.0\\times10^6", "1,000,000", 0, 1),
    ("big", "1.0\\times10^6", "10^6", 0, 1),
    ("negative", "-3", "-\\frac{6}{2}", 0, 1),
    ("negative", "- 3", "-\\frac{6}{2}", 0, 1),
    ("negative", "−3", "-3", 0, 0),
    ("negative", "−3", "-\\frac{6}{2}", 0, 0),
    ("negative", "(-3)", "-3", 0, 1),
    ("negative", "(-3)", "-\\frac{6}{2}", 0, 1),
    ("negative", "-(3)", "-3", 0, 1),
    ("negative", "-(3)", "-\\frac{6}{2}", 0, 1),
    ("negative", "\\left(-3\\right)", "-3", 0, 1),
    ("negative", "\\left(-3\\right)", "-\\frac{6}{2}", 0, 1),
    ("negative", "-3.0", "-\\frac{6}{2}", 0, 1),
    ("negative", "+-3", "-3", 0, 1),
    ("negative", "+-3", "-\\frac{6}{2}", 0, 1),
    ("negative", "-\\frac{6}{2}", "-3", 0, 1),
    ("negative", "\\frac{-6}{2}", "-3", 0, 1),
    ("negative", "\\frac{-6}{2}", "-\\frac{6}{2}", 0, 1),
    ("negative", "-6/2", "-3", 0, 1),
    ("negative", "-6/2", "-\\frac{6}{2}", 0, 1),
    ("matrix", "\\begin{bmatrix}1\\\\2\\end{bmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", 0, 0),
    ("matrix", "\\begin{pmatrix}2/2\\\\4/2\\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", 0, 0),
    ("complex", "i+1", "1+i", 0, 1),
    ("complex", "1+1i", "1+i", 0, 1),
    ("complex", "(1+i)", "1+i", 0, 1),
    ("malformed", "x==3", "3", 0, 0),
    ("malformed", "\\fbox{3}", "3", 0, 0),
    ("malformed", "3\\\\", "3", 0, 0),
    ("malformed", "\\frac{3}{1}", "3", 0, 1),
    ("boxed", "{3}", "3", 0, 1),
    ("boxed", "\\{3\\}", "3", 0, 1),
]


def _column() -> int:
    return 4 if sympy_latex_runs() else 3


def test_dllm_rl_math_gives_dllm_rls_verdict_where_checkers_differ():
    """On every recorded pair where dLLM-RL's two environments, or megadare's old math-verify stage, disagree,
    ``dllm_rl_math`` gives dLLM-RL's verdict in this environment (the strings without antlr4 4.11, else sympy)."""
    responses = [bx(a) for _, a, _, _, _ in RECORDED]
    records = [{"answer": g, "verify_timeout": 60.0} for _, _, g, _, _ in RECORDED]
    got, stats = score_batch("dllm_rl_math", responses, records, workers=1, timeout_s=600)
    assert stats.failures == 0, stats.failed
    want = [row[_column()] for row in RECORDED]
    assert [(i, RECORDED[i][1], RECORDED[i][2]) for i, (a, b) in enumerate(zip(got, want)) if a != b] == []


# ------------------------------------------------------------------ live: dLLM-RL's own code
def test_live_recorded_verdicts_are_dllm_rls():
    verdicts = D.math_is_equal([(bx(a), g) for _, a, g, _, _ in RECORDED])
    assert [int(v) for v in verdicts] == [row[_column()] for row in RECORDED]


def test_live_battery_is_dllm_rls():
    """dLLM-RL's reward and ``dllm_rl_math`` give the same verdict on each of the 958 pairs, in this environment,
    but where the gold is empty: megadare fails such a row naming it (a row without a gold is broken; dLLM-RL
    scores ``\\boxed{}``, ``\\boxed{$}``, ``\\boxed{=}`` 1 there, as the strings of both are empty)."""
    theirs = D.math_is_equal([(r, g) for _, r, g in BATTERY])
    got, stats = score_batch(
        "dllm_rl_math", [r for _, r, _ in BATTERY], [{"answer": g} for *_, g in BATTERY], workers=1
    )
    empty = {i for i, (*_, g) in enumerate(BATTERY) if not g}
    assert set(stats.failed) == empty
    differ = [(c, r, g, int(t)) for i, ((c, r, g), t, o) in enumerate(zip(BATTERY, theirs, got)) if int(t) != o]
    assert [row for row in differ if row[2]] == []
