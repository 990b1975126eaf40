"""megadare's ``dllm_rl_math`` reward (and ``auto`` on dLLM-RL's math rows) against dLLM-RL's own math reward
(Gen-Verse/dLLM-RL @10b4fd1): ``sample/trado_rl_rollout.py::extract_final_boxed_answer``, then
``reward/math_utils.py::is_equal`` as ``reward/rl_reward.py`` calls it (legacy mode: ``is_equiv``, then the
``repeatness`` guard and ``_is_latex_equal``), on a battery of answers by input class.

Its last stage wants sympy's ``parse_latex``, i.e. antlr4 4.11; dLLM-RL's requirements install antlr4 4.9.3
(omegaconf pins it; megadare's venv has 4.13.2), where parse_latex raises ImportError and ``_is_latex_equal``
compares Minerva's normalised strings instead. Both columns were recorded by tests/dllm_rl_source.py's
``math_is_equal`` (the stages called directly, without rl_reward.py's 1 s ``asyncio.wait_for``, which on a cold
sympy import in a fresh process times out every comparison of the step that needs the last stage: there the verdicts
depend on the machine's load):
``strings`` under antlr4 4.13.2 (megadare's venv), ``sympy`` under sympy 1.13.1 + antlr4-python3-runtime 4.11.0
(and again under sympy 1.14.0 + 4.11.1).
With ``DLLM_RL_SRC`` set the ``test_live_*`` tests rerun dLLM-RL's code; else they are skipped, saying so.

Findings: before this change ``auto`` scored a dLLM-RL row (``question``, ``ground_truth_answer``) by exact match
(``\\boxed{5}`` for 5: 0); ``math`` takes unboxed answers dLLM-RL gives 0 ("The answer is 5", ``\\fbox{5}``, an
unclosed ``\\boxed{5``) and missed ``\\boxed{5 dollars}`` for 5; ``dare_math`` missed it too. ``dllm_rl_math`` takes
what dLLM-RL takes, its string stages being dLLM-RL's (bugs kept: ``1,00`` is 100, ``1,2`` is 12), and its last
stage dLLM-RL's too (it was math-verify, which took more here: 50% for 50, sets in another order, bmatrix for pmatrix;
tests/test_dllm_rl_math_battery.py).
"""

from __future__ import annotations

import random
import re

import pytest

import dllm_rl_source as D
from megadare.rewards import dllm_rl_latex as L
from megadare.rewards import dllm_rl_math as M
from megadare.rewards import score_batch
from megadare.rewards.dllm_rl_latex import sympy_latex_runs
from megadare.rewards.dllm_rl_math import dllm_rl_boxed, dllm_rl_strings_equal
from megadare.rewards.registry import auto_rule, reward_notes


def bx(answer: str) -> str:
    return "Reasoning... so the answer is \\boxed{" + answer + "}."


# (class, response, gold, dLLM-RL's verdict without antlr4 4.11 (its requirements), under antlr4 4.11 (sympy))
BATTERY = [
    ("fraction", bx("\\frac{1}{2}"), "1/2", 1, 1),
    ("fraction", bx("1/2"), "\\frac{1}{2}", 1, 1),
    ("fraction", bx("\\dfrac12"), "\\frac{1}{2}", 1, 1),
    ("fraction", bx("\\frac{2}{4}"), "\\frac{1}{2}", 0, 1),
    ("fraction", bx("2/4"), "1/2", 0, 1),
    ("fraction", bx("-\\frac{1}{2}"), "\\frac{-1}{2}", 0, 1),
    ("fraction", bx("\\frac{-1}{2}"), "-1/2", 1, 1),
    ("fraction", bx("\\tfrac{3}{4}"), "3/4", 1, 1),
    ("decimal", bx("0.5"), "\\frac{1}{2}", 1, 1),
    ("decimal", bx("0.25"), "\\frac{1}{4}", 0, 1),
    ("decimal", bx(".5"), "0.5", 1, 1),
    ("decimal", bx("2.50"), "2.5", 1, 1),
    ("decimal", bx("3.0"), "3", 1, 1),
    ("decimal", bx("0.333"), "\\frac{1}{3}", 0, 0),
    ("decimal", bx("1e3"), "1000", 1, 1),
    ("percent", bx("50\\%"), "50", 1, 1),
    ("percent", bx("50%"), "50", 0, 0),
    ("percent", bx("50\\%"), "0.5", 0, 0),
    ("percent", bx("50"), "50\\%", 1, 1),
    ("interval", bx("(1,2]"), "(1, 2]", 1, 1),
    ("interval", bx("[1,2)"), "(1,2)", 0, 0),
    ("interval", bx("(-\\infty, 0)"), "(-\\infty,0)", 1, 1),
    ("interval", bx("x \\in (1,2)"), "(1,2)", 0, 0),
    ("interval", bx("(-\\infty,1)\\cup(2,\\infty)"), "(-\\infty, 1) \\cup (2, \\infty)", 1, 1),
    ("set", bx("\\{1,2\\}"), "\\{2,1\\}", 0, 0),
    ("set", bx("1, 2"), "2, 1", 0, 0),
    ("set", bx("(1,2)"), "(1, 2)", 1, 1),
    ("set", bx("1,2"), "(1,2)", 0, 0),
    (
        "matrix",
        bx("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}"),
        "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}",
        1,
        1,
    ),
    ("matrix", bx("\\begin{bmatrix}1&2\\\\3&4\\end{bmatrix}"), "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", 0, 0),
    ("matrix", bx("\\begin{pmatrix}1\\\\2\\end{pmatrix}"), "\\begin{pmatrix}1\\\\3\\end{pmatrix}", 0, 0),
    ("unit", bx("5\\text{ cm}"), "5", 1, 1),
    ("unit", bx("5 cm"), "5", 1, 1),
    ("unit", bx("5\\mbox{ cm}"), "5", 1, 1),
    ("unit", bx("90^\\circ"), "90", 1, 1),
    ("unit", bx("\\$5"), "5", 1, 1),
    ("unit", bx("5 dollars"), "5", 1, 1),
    ("unit", bx("5\\text{cm}^2"), "5", 1, 1),
    ("unit", bx("10\\text{ meters}"), "10", 1, 1),
    ("latex", bx("\\sqrt{2}"), "sqrt(2)", 0, 0),
    ("latex", bx("\\pi"), "pi", 0, 0),
    ("latex", bx("2\\pi"), "2 \\pi", 1, 1),
    ("latex", bx("x^2"), "x**2", 0, 0),
    ("latex", bx("\\frac{\\sqrt{3}}{2}"), "\\sqrt{3}/2", 0, 1),
    ("latex", bx("\\sqrt3"), "\\sqrt{3}", 1, 1),
    ("latex", bx("\\text{5}"), "5", 1, 1),
    ("latex", bx("\\textbf{5}"), "5", 1, 1),
    ("latex", bx("\\text{(A)}"), "A", 0, 1),
    ("latex", bx("x+1"), "1+x", 0, 1),
    ("latex", bx("2x"), "2*x", 0, 1),
    ("latex", bx("x^2+2x+1"), "(x+1)^2", 0, 0),
    ("latex", bx("\\frac{1}{\\sqrt{2}}"), "\\frac{\\sqrt{2}}{2}", 0, 1),
    ("latex", bx("ab"), "ba", 0, 1),
    ("latex", bx("2\\sqrt{3}"), "\\sqrt{12}", 0, 1),
    ("latex", bx("\\text{yes}"), "yes", 1, 1),
    ("latex", bx("x"), "y", 0, 0),
    ("boxed", "Reasoning... so the answer is \\boxed{5}. then \\boxed{3}", "3", 1, 1),
    ("boxed", "\\boxed{5} then \\boxed{3}", "5", 0, 0),
    ("boxed", "Reasoning... so the answer is \\boxed{\\boxed{5}}.", "5", 1, 1),
    ("boxed", "the answer is \\boxed 5", "5", 0, 0),
    ("boxed", "\\fbox{5}", "5", 0, 0),
    ("boxed", "The answer is 5.", "5", 0, 0),
    ("boxed", "The final answer is $5$", "5", 0, 0),
    ("boxed", "\\boxed{5", "5", 0, 0),
    ("boxed", bx("{5}"), "5", 0, 1),
    ("boxed", bx("5"), "\\boxed{5}", 1, 1),
    ("boxed", bx("x=5"), "5", 1, 1),
    ("boxed", bx("k = 5"), "5", 1, 1),
    ("signed", bx("-5"), "-5", 1, 1),
    ("signed", bx("- 5"), "-5", 1, 1),
    ("signed", bx("0"), "0.0", 1, 1),
    ("signed", bx("-0"), "0", 1, 1),
    ("signed", bx("5"), "-5", 0, 0),
    ("signed", bx("0"), "0", 1, 1),
    ("signed", bx("-\\frac{1}{2}"), "-0.5", 0, 1),
    ("nested", bx("\\frac{\\frac{1}{2}}{2}"), "\\frac{1}{4}", 0, 1),
    ("nested", bx("{{5}}"), "5", 0, 1),
    ("nested", bx("\\sqrt{\\sqrt{16}}"), "2", 0, 1),
    ("nested", bx("\\left(\\frac{1}{2}\\right)"), "\\frac{1}{2}", 0, 1),
    ("thousands", bx("1,000"), "1000", 1, 1),
    ("thousands", bx("1{,}000"), "1000", 1, 1),
    ("thousands", bx("1,00"), "100", 1, 1),
    ("thousands", bx("1000"), "1,000", 1, 1),
    ("malformed", bx(""), "5", 0, 0),
    ("malformed", bx("\\frac{1}{"), "\\frac{1}{2}", 0, 0),
    ("malformed", "", "5", 0, 0),
    ("malformed", bx("5"), "", 0, 0),
    ("malformed", "no answer here", "Can not extract the answer!", 1, 1),
    ("malformed", bx("\\frac{1}"), "\\frac{1}{2}", 0, 0),
    ("malformed", bx("((("), "(((", 1, 1),
    ("malformed", bx("5"), "5 ", 1, 1),
]
# dLLM-RL accepts a response with no box when the gold is its "no answer" text (an artefact, not a rule)
ARTEFACT = {i for i, (_, r, _, _, _) in enumerate(BATTERY) if r == "no answer here"}
# an empty gold: dLLM-RL scores every response 0, megadare fails the row naming it (no response could match it)
EMPTY_GOLD = {i for i, (_, _, g, _, _) in enumerate(BATTERY) if not g}


def _verdicts(column: int) -> list[int]:
    return [row[column] for row in BATTERY]


def test_string_stages_are_dllm_rls():
    """``dllm_rl_math``'s strings (:func:`dllm_rl_strings_equal`) are dLLM-RL's reward where its parse_latex
    cannot run (its requirements' antlr4): the same verdict on every answer of the battery but the no-answer
    artefact."""
    ours = [
        int(dllm_rl_boxed(r) is not None and dllm_rl_strings_equal(dllm_rl_boxed(r), g)) for _, r, g, _, _ in BATTERY
    ]
    assert {i for i, (a, b) in enumerate(zip(ours, _verdicts(3))) if a != b} == ARTEFACT


def test_dllm_rl_math_gives_dllm_rls_verdicts():
    """``dllm_rl_math`` gives dLLM-RL's verdict in this environment (the strings column without antlr4 4.11, the
    sympy column with it) on every answer of the battery but the no-answer artefact and the empty gold."""
    responses = [r for _, r, _, _, _ in BATTERY]
    records = [{"answer": g, "verify_timeout": 60.0} for _, _, g, _, _ in BATTERY]
    got, stats = score_batch("dllm_rl_math", responses, records, workers=1, timeout_s=600)
    assert set(stats.failed) == EMPTY_GOLD and "gold answer 'answer' is empty" in stats.failed[min(EMPTY_GOLD)]
    want = _verdicts(4 if sympy_latex_runs() else 3)
    assert {i for i, (a, b) in enumerate(zip(got, want)) if a != b} - EMPTY_GOLD == ARTEFACT


def test_auto_scores_dllm_rl_rows_by_dllm_rl_math():
    """A dLLM-RL math row (``question``, ``ground_truth_answer``; the gold under ``answer`` by
    ``rewards.answer_key=ground_truth_answer``) is scored by dLLM-RL's rule, not by exact match of the response."""
    row = {"question": "What is 2+3?", "ground_truth_answer": "5", "answer": "5"}
    assert auto_rule(row) == "dllm_rl_math"
    got, stats = score_batch("auto", [bx("5"), "The answer is 5.", bx("5 dollars")], [row] * 3, workers=1)
    assert stats.failures == 0, stats.failed
    assert got == [1.0, 0.0, 1.0]


def test_dllm_rl_boxed_reads_the_last_closed_box():
    assert dllm_rl_boxed("\\boxed{1} and \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert dllm_rl_boxed("\\boxed{1} and \\boxed{2") is None
    assert dllm_rl_boxed("\\boxed 2") is None
    assert dllm_rl_boxed("\\boxed{}") == ""


# ------------------------------------------------------------------ live: dLLM-RL's own code
def test_live_math_battery_is_dllm_rls():
    """dLLM-RL's reward gives the recorded column of this environment (parse_latex running or not)."""
    verdicts = D.math_is_equal([(r, g) for _, r, g, _, _ in BATTERY])
    assert [int(v) for v in verdicts] == _verdicts(4 if D.sympy_latex_runs() else 3)


def _random_answer(rng: random.Random) -> str:
    atoms = ["1", "2", "0.5", ".5", ",", " ", "\\frac", "\\dfrac", "{", "}", "\\sqrt", "/", "=", "x", "\\text{ cm}",
             "\\%", "$", "\\$", "dollars", "\\left(", "\\right)", "^\\circ", "\\!", "\\\\", "k", "-", "(", ")", "e3"]  # fmt: skip
    return "".join(rng.choice(atoms) for _ in range(rng.randint(0, 7)))


def _outcome(fn, a: str):
    try:
        return fn(a)
    except Exception:  # noqa: BLE001  (dLLM-RL's raises IndexError / AssertionError; is_equiv catches all)
        return "raised"


def test_live_string_stages_are_dllm_rls_on_random_answers():
    """megadare's copies of ``is_equiv`` and ``normalize_final_answer`` decide as dLLM-RL's on 3,000 random pairs
    of answer fragments, and their normalisations the same strings (or both raise) (where parse_latex cannot run: its fallback is then the Minerva strings)."""
    mu = D.math_utils()
    if D.sympy_latex_runs():
        pytest.skip("sympy's parse_latex runs here (antlr4 4.11): dLLM-RL's last stage is then not its strings")
    rng = random.Random(0)
    for i in range(3000):
        a = _random_answer(rng)
        assert L.normalize_final_answer(a) == mu.normalize_final_answer(a), a
        assert i % 10 or M._repetitive(a * 40) == bool(mu.repeatness(a * 40)), a
        assert _outcome(M._strip_string, a) == _outcome(mu._strip_string, a), a
        a, b = _random_answer(rng), _random_answer(rng)
        theirs = bool(
            mu.is_equiv(a, b)
            or (not any(len(x) > 128 and mu.repeatness(x) for x in (a, b)) and mu._is_latex_equal(a, b))
        )
        assert dllm_rl_strings_equal(a, b) == theirs, (a, b)


def test_math_on_dllm_rl_rows_says_how_it_differs_from_dllm_rl():
    """rewards.name=math (the README's TraDo example) on dLLM-RL's rows took unboxed answers dLLM-RL gives 0, without
    a word; the run's start prints one line naming rewards.name=dllm_rl_math."""
    dllm_row = {"question": "q", "ground_truth_answer": "5", "answer": "5"}
    notes = reward_notes("math", [dllm_row, {"data_source": "math500", "answer": "5"}])
    assert len(notes) == 1 and "1 of 2 rows that are dLLM-RL math rows" in notes[0], notes
    assert "rewards.name=dllm_rl_math" in notes[0]
    own = reward_notes("dllm_rl_math", [dllm_row])  # its own rule: only which last stage decides here
    assert own == reward_notes("auto", [dllm_row]) and len(own) == 1 and "dllm_rl_math decides" in own[0], own


def test_minerva_math_mode_is_linear_and_is_dllm_rls_regex():
    """dLLM-RL's ``re.sub(r"(.*?)(\\$)(.*?)(\\$)(.*)", "$\\3$", s)`` (a fixed definition, checked on random texts)
    tried every start of a line with one ``$``: a 20,000-character box took 12 s, 80,000 ~3 min, past
    score_batch's 60 s per call, a reward error any response could cause; such an answer is now a 0."""
    rng = random.Random(0)
    tokens = ["$", "a", "\n", " ", "\\$", "x$y", "\r", "$$"]
    for _ in range(20_000):
        text = "".join(rng.choice(tokens) for _ in range(rng.randint(0, 12)))
        assert L._first_math(text) == re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", text), repr(text)
    letters = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(80_000))
    scores, stats = score_batch("dllm_rl_math", [bx("$" + letters)], [{"answer": "5"}], workers=1)
    assert scores == [0.0] and stats.failures == 0, stats


def test_minerva_macros_and_repeat_guard_are_linear_and_dllm_rls():
    """dLLM-RL's ``re.sub(r"(\\\\text\\{)(.*?)(\\})", ...)`` (and ``\\textbf``, ``\\overline``; ``\\boxed`` greedy)
    scanned the rest of the line from each opening, and its ``repeatness`` doubled prefixes log2(n) times even when
    the ranks were all distinct already: a box of 5,000 ``\\text{`` + 10 letters (80,000 characters, no loop for its
    guard) took 16 s + 26 s; twice that ran past score_batch's 60 s per call. Checked against the regexes on random
    texts; dLLM-RL's repeatness is a fixed definition its live test checks."""
    rng = random.Random(0)
    tokens = ["\\text{", "\\textbf{", "\\boxed{", "}", "{", "\n", "a", " ", "\\overline{", "\\tex"]
    for _ in range(20_000):
        text = "".join(rng.choice(tokens) for _ in range(rng.randint(0, 10)))
        for macro in ("text", "textbf", "overline"):
            want = re.sub(r"(\\" + macro + r"\{)(.*?)(\})", "\\2", text)
            assert L._unwrap_first(text, "\\" + macro + "{") == want, (macro, text)
        boxed = "\n".join(L._unwrap_boxed(line) for line in text.split("\n"))
        assert boxed == re.sub(r"(\\boxed\{)(.*)(\})", "\\2", text), text
    letters = "abcdefghijklmnopqrstuvwxyz"
    box = "".join("\\text{" + "".join(rng.choice(letters) for _ in range(10)) for _ in range(10_000))
    scores, stats = score_batch("dllm_rl_math", [bx(box)], [{"answer": "5"}], workers=1)
    assert scores == [0.0] and stats.failures == 0, stats


@pytest.mark.parametrize("sympy_runs", [False, True])
def test_a_run_scored_by_dllm_rl_math_says_which_last_stage_decides_here(monkeypatch, sympy_runs):
    """dllm_rl_math's verdicts depend on the environment as dLLM-RL's do (antlr4 4.11 or not): a run that scores
    with it, by name or through ``auto`` on dLLM-RL's rows, says which stage decides; other rows say nothing."""
    from megadare.rewards import registry

    monkeypatch.setattr(registry, "sympy_latex_runs", lambda: sympy_runs)
    dllm_row = {"question": "1+1?", "ground_truth_answer": "2"}
    stage = "sympy's parse_latex" if sympy_runs else "normalised strings"
    for reward, rows in (("dllm_rl_math", []), ("auto", [{"data_source": "countdown"}, dllm_row])):
        notes = [n for n in registry.reward_notes(reward, rows) if "dllm_rl_math decides" in n]
        assert len(notes) == 1 and stage in notes[0], (reward, notes)
    assert not [n for n in registry.reward_notes("auto", [{"data_source": "countdown"}]) if "dllm_rl_math" in n]
    assert not [n for n in registry.reward_notes("math", [dllm_row]) if "dllm_rl_math decides" in n]
