"""DARE's rewards in megadare: countdown and sudoku by DARE's rules, code tests in DARE's forms (the trap of a wrong
program scoring 1.0 closed), programs that fake a pass, the per-row ``auto`` rule, and the stop when a reward
cannot be computed. Records are written here in DARE's schema (verl/utils/preprocess/preprocess.py), not copied."""

from __future__ import annotations

import json

import pytest

from megadare.rewards import (
    RewardError,
    auto_rule,
    check_reward_errors,
    code_reward,
    countdown_reward,
    extract_code_mbpp,
    gold_response,
    load_reward,
    program_extractor,
    score_batch,
    sudoku_reward,
)
from megadare.rewards.code import lcb_output_equal
from megadare.rewards.code_forms import dare_test_cases, entry_point, extract_code_dare
from megadare.rewards.sandbox import run_program

AUTO = load_reward("auto")


def dare_row(source: str, gold, prompt="q", task="math", **extra) -> dict:
    """A record as the prompt builder hands it to the reward: the DARE row plus its gold under 'answer'."""
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": prompt}],
        "reward_model": {"ground_truth": gold, "style": "rule"},
        "extra_info": {"index": 0, "split": "test", "task": task, **extra},
        "answer": gold,
    }


# --------------------------------------------------------------------------------------------------- countdown
COUNTDOWN = dare_row("countdown", "23", numbers="[30, 100, 93]")


@pytest.mark.parametrize(
    "response, want",
    [
        ("<reasoning>..</reasoning>\n<answer>\n30-(100-93)\n</answer>", 1.0),  # right
        ("<answer>30 - (100 - 93)</answer>", 1.0),
        ("<answer>100-93+30/2</answer>", 0.1),  # well formed, wrong value
        ("<answer>30+100-93</answer>", 0.1),  # wrong value
        ("<answer>30-(100-93)-0</answer>", 0.1),  # a number that was not given
        ("<answer>30-(93-93)</answer>", 0.1),  # a number used twice, one missing
        ("<answer>30-(100-93) = 23</answer>", 0.1),  # '=' and the target: invalid characters, extra number
        ("<answer>abs(30-(100-93))</answer>", 0.1),  # a function call (letters)
        ("<answer>(30)(100-93)</answer>", 0.1),  # a call on a number
        ("<answer>30**100**93</answer>", 0.1),  # a huge exponent: refused at once, not computed
        ("30-(100-93)", 0.0),  # no answer tag
        ("<answer>1</answer> then <answer>30-(100-93)</answer>", 1.0),  # the last tag counts
    ],
)
def test_countdown_rules(response, want):
    assert AUTO(response, COUNTDOWN) == pytest.approx(want)


# Powers: DARE's character set ``[\d+\-*/().\s]`` lets ``**`` through and ``eval`` computes it
# (verl/utils/reward_score/math_reward.py:539-545 of DARE @83ae8a3), so a power that hits the target scores 1.0.
# Expected values: DARE's countdown_reward_func run on each case.
@pytest.mark.parametrize(
    "expression, target, numbers, want",
    [
        ("2**4-3", 13, [2, 4, 3], 1.0),
        ("2**-1*4+3", 5, [2, 1, 4, 3], 1.0),  # a negative power: eval's float 0.5
        ("4**0.5+3", 5, [4, 0, 5, 3], 1.0),  # a root: eval's float power
        ("2**2.0+1", 5, [2, 2, 0, 1], 1.0),
        ("-2**2+9", 5, [2, 2, 9], 1.0),  # -(2**2), Python's precedence
        ("(-2)**2+1", 5, [2, 2, 1], 1.0),
        ("1**100**100+4", 5, [1, 100, 100, 4], 1.0),  # a huge exponent of 1 is still 1
        ("0**-1+3", 3, [0, 1, 3], 0.1),  # ZeroDivisionError in eval
        ("(0-8)**(1/3)", 2, [0, 8, 1, 3], 0.1),  # complex in eval: not the target
    ],
)
def test_countdown_powers_score_as_dare_evaluates_them(expression, target, numbers, want):
    assert countdown_reward(f"<answer>{expression}</answer>", target, numbers) == pytest.approx(want)


def test_countdown_huge_power_is_wrong_at_once():
    # DARE's eval would run for hours on these (a stalled training step); here they are wrong answers, in no time
    for expression, numbers in (("30**100**93", [30, 100, 93]), ("9**9**9**9", [9, 9, 9, 9])):
        assert countdown_reward(f"<answer>{expression}</answer>", 23, numbers) == pytest.approx(0.1)


def test_countdown_exact_arithmetic_and_bad_records():
    assert countdown_reward("<answer>(1+2)/3*7</answer>", 7, [1, 2, 3, 7]) == 1.0  # Fraction, not float
    assert countdown_reward("<answer>7//2+1</answer>", 4, [7, 2, 1]) == 1.0  # DARE's eval accepts //
    assert countdown_reward("<answer>5/(2-2)</answer>", 5, [2, 2, 5]) == 0.1  # division by zero
    with pytest.raises(ValueError, match="countdown numbers"):
        countdown_reward("<answer>1</answer>", 1, "[1, 'two']")
    with pytest.raises(ValueError):
        countdown_reward("<answer>1</answer>", "twenty", [1])


# ------------------------------------------------------------------------------------------------------ sudoku
SOLUTION, PUZZLE = "1234341221434321", "1030041020004301"  # 8 empty cells


@pytest.mark.parametrize(
    "response, want",
    [
        (f"<answer>\n{SOLUTION}\n</answer>", 1.0),
        ("<answer>1234 3412 2143 4321</answer>", 1.0),  # digits only are read
        ("<answer>1234341221434312</answer>", 7 / 8),  # one empty cell wrong (a given cell too)
        ("<answer>12343412</answer>", 4 / 8),  # short: padded with zeros
        (f"<answer>{SOLUTION}9999</answer>", 1.0),  # long: truncated to 16
        ("<answer>no digits</answer>", 0.0),
        (SOLUTION, 0.0),  # no answer tag
    ],
)
def test_sudoku_rules(response, want):
    assert AUTO(response, dare_row("sudoku", SOLUTION, puzzle=PUZZLE)) == pytest.approx(want)


def test_sudoku_bad_record_is_an_error_not_a_score():
    with pytest.raises(ValueError, match="sudoku puzzle must be 16 digits"):
        sudoku_reward("<answer>1</answer>", SOLUTION, "123")
    with pytest.raises(KeyError, match="puzzle"):
        AUTO("<answer>1</answer>", dare_row("sudoku", SOLUTION))


# -------------------------------------------------------------------------------------------- DARE's math rule
@pytest.mark.parametrize(
    "response, gold, want",
    [
        ("so \\boxed{36}.", "36", 1.0),
        ("The answer is 36.", "36", 0.0),  # DARE reads the last box only: no box, no answer
        ("\\boxed{36} and \\boxed{}", "36", 0.0),  # the last box is empty
        ("\\fbox{36}", "36", 0.0),
        ("\\boxed 36", "36", 0.0),
        ("so \\boxed{36", "36", 0.0),  # truncated
        ("\\boxed{\\frac{72}{2}}", "36", 0.0),  # an integer gold wants an integer answer
        ("\\boxed{36/1}", "36", 0.0),
        ("\\boxed{36, 36}", "36", 0.0),
        ("\\boxed{\\text{36 hours}}", "36", 1.0),  # units dropped
        ("\\boxed{36.000}", "36", 1.0),
        ("\\boxed{\\dfrac{4}{8}}", "\\frac{1}{2}", 0.0),  # an unreduced fraction is not the reduced one
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{(3,4)}", "(3, 4)", 1.0),
        ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),  # sympy
        ("<think>\\boxed{35}</think> \\boxed{36}", "\\boxed{36}", 1.0),  # a boxed gold: its box
    ],
)
def test_dare_math_rule(response, gold, want):
    """DARE's math_rm (checked against DARE's own function on ~38k responses; see the i29w note)."""
    assert AUTO(response, dare_row("gsm8k", gold)) == want


def test_dare_math_unreadable_answers_are_unequal_and_other_errors_are_raised(monkeypatch):
    """Text DARE's readers cannot read is a verdict (kept as written, or unequal), as in DARE; any other failure
    of the LaTeX reader or sympy is raised (the verifier pool reports it as an error, not as a score)."""
    import sympy
    from pylatexenc import latex2text

    from megadare.rewards import dare_math

    assert dare_math.normalize("\\sqrt") == "\\sqrt"  # pylatexenc: KeyError on a bare \sqrt, text kept
    assert dare_math.normalize("\\input") == "\\input"  # IndexError
    assert dare_math._sympy_equal("1+", "2") is False  # a TokenError: not equal
    assert dare_math._sympy_equal("(1", "2") is False

    def broken(*a, **kw):
        raise MemoryError("out of memory")

    monkeypatch.setattr(latex2text.LatexNodes2Text, "latex_to_text", broken)
    with pytest.raises(MemoryError):
        dare_math.normalize("\\frac{1}{2}")
    monkeypatch.setattr(sympy, "simplify", broken)
    with pytest.raises(MemoryError):
        dare_math._sympy_equal("a+1", "1+a")


def test_dare_math_gold_must_be_text():
    with pytest.raises(ValueError, match="DARE math gold must be a string or a number"):
        AUTO("\\boxed{1}", dare_row("math", ["1"]))


# ------------------------------------------------------------------------------------------- DARE code blocks
def test_dare_code_extraction():
    two = "```python\nprint(1)\n```\n```python\ndef f(x):\n    return x\n```"
    assert extract_code_dare(two) == "def f(x):\n    return x"  # the first block defining a function
    assert extract_code_dare("```\nprint(1)\n```\n```py\nprint(2)\n```") == "print(2)"  # else the last
    assert extract_code_dare("def f(x):\n    return x\n") is None  # no fenced block: no program
    assert extract_code_dare("```python\ndef f(x):\n    return x\n") is None  # unclosed
    assert program_extractor("kodcode") is extract_code_dare and program_extractor("mbpp") is extract_code_mbpp
    assert AUTO(RIGHT, HUMANEVAL) == 0.0  # DARE scores a response without a code block 0


# -------------------------------------------------------------------------------------------- auto and gold
def test_auto_rule_per_row():
    assert auto_rule(dare_row("gsm8k", "18")) == "dare_math" == auto_rule(dare_row("aime2024", "1"))
    assert auto_rule({"data_source": "openai/gsm8k", "answer": "#### 18"}) == "gsm8k"  # no task: not DARE's row
    assert auto_rule({"data_source": "math500", "answer": "1"}) == "math"
    assert auto_rule(dare_row("countdown", "1", numbers="[1]")) == "countdown"
    assert auto_rule(dare_row("sudoku", SOLUTION, puzzle=PUZZLE)) == "sudoku"
    assert auto_rule(dare_row("humaneval", "x", task="code")) == "code_all_or_nothing"
    assert auto_rule(dare_row("my_code_set", "x", task="code")) == "code_all_or_nothing"
    assert auto_rule({"prompt": "p", "answer": "a"}) == "exact_match"  # megadare's own rows
    assert auto_rule({"prompt": "p", "tests": ["assert 1"]}) == "code_all_or_nothing"
    with pytest.raises(ValueError, match="no rule for data_source='poetry'"):
        auto_rule(dare_row("poetry", "x", task="writing"))
    scores, stats = score_batch(
        "auto",
        ["The answer is \\boxed{18}.", "<answer>30-(100-93)</answer>", "17"],
        [dare_row("gsm8k", "18"), COUNTDOWN, dare_row("math", "\\frac{1}{2}")],
    )
    assert scores == [1.0, 1.0, 0.0] and stats.failures == 0


def test_gold_responses_score_one():
    rows = [
        dare_row("gsm8k", "1,072"),
        dare_row("math500", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        dare_row("sudoku", SOLUTION, puzzle=PUZZLE),
        {"prompt": "ab>", "answer": "ba"},
    ]
    texts = [gold_response("auto", r) for r in rows]
    assert texts[2] == f"<answer>\n{SOLUTION}\n</answer>"
    assert score_batch("auto", texts, rows)[0] == [1.0] * 4
    assert gold_response("auto", COUNTDOWN) is None  # a target is not an answer
    assert gold_response("code", dare_row("mbpp", "[]", task="code")) is None


# ------------------------------------------------------------------------------------------- DARE code forms
HUMANEVAL_TEST = (
    "\n\nMETADATA = {'author': 'jt'}\n\n\ndef check(candidate):\n    assert candidate(2, 3) == 5\n"
    "    assert candidate(-1, 1) == 0\n\n"
)
HUMANEVAL = dare_row(
    "humaneval",
    HUMANEVAL_TEST,
    task="code",
    prompt="Complete the following python code:\ndef helper(x):\n    return x\n\n\n"
    'def add(a: int, b: int) -> int:\n    """Add."""\n',
)
MBPP = dare_row("mbpp", json.dumps(["assert add(1, 2) == 3", "assert add(0, 0) == 0"]), task="code")
RIGHT, WRONG = "def add(a, b):\n    return a + b\n", "def add(a, b):\n    return a * b\n"


def test_trap_closed_wrong_programs_score_zero():
    """DARE's ground truth mapped straight into megadare's tests gave wrong programs 1.0 (check never called;
    a JSON string of asserts evaluated as one no-op expression)."""
    assert entry_point(HUMANEVAL) == "add"  # the last def of the prompt, not the helper
    assert AUTO(f"```python\n{WRONG}```", HUMANEVAL) == 0.0
    assert AUTO(f"```python\n{RIGHT}```", HUMANEVAL) == 1.0
    assert AUTO(f" '{WRONG}' \n[DONE]", MBPP) == 0.0  # no [BEGIN]: DARE's quoted-program pattern
    assert AUTO(f"[BEGIN]\n '{RIGHT}' \n[DONE] \n\n", MBPP) == 1.0
    assert len(dare_test_cases(MBPP)) == 2
    with pytest.raises(ValueError, match="define check"):
        AUTO(RIGHT, dare_row("humaneval", "assert True", task="code"))


def test_humaneval_checks_the_prompts_function_not_the_first_def_of_the_response():
    """Kept apart from DARE on purpose. DARE's humaneval_check_correctness is called without an entry point
    (verl/utils/reward_score/code_reward.py:479 of DARE @83ae8a3) and appends check(<first def of the response>)
    (:277-290), so a right answer with a helper defined first scores 0 there and a function under another name
    than the prompt's can score 1 (both seen running DARE's rllm_reward_fn_code on HumanEval/0). megadare checks
    the prompt's function, as HumanEval's own harness (check(entry_point)) does."""
    helper_first = "def twice(x):\n    return 2 * x\n\n\ndef add(a, b):\n    return a + b\n"
    assert AUTO(f"```python\n{helper_first}```", HUMANEVAL) == 1.0  # DARE: 0.0 (checks twice)
    assert AUTO("```python\ndef plus(a, b):\n    return a + b\n```", HUMANEVAL) == 0.0  # DARE: 1.0 (checks plus)


def test_a_global_named_like_a_builtin_does_not_change_the_tests():
    """A program that defines ``abs`` (or ``len``, ``sorted``) at top level used to change what the tests' calls
    meant: the tests ran in a copy of its namespace. The tests now call the true builtins; the program's own
    functions still see its global."""
    tests = dare_row(
        "humaneval",
        "\n\ndef check(candidate):\n    assert abs(candidate(2, 3) - 5) < 1e-9\n",
        task="code",
        prompt="def add(a, b):\n",
    )
    cheat = "def add(a, b):\n    return 0\n\ndef abs(x):\n    return 0\n"
    assert AUTO(f"```python\n{cheat}```", tests) == 0.0
    own = "def abs(x):\n    return -x if x < 0 else x\n\ndef add(a, b):\n    return abs(a) + b if a > 0 else a + b\n"
    assert AUTO(f"```python\n{own}```", tests) == 1.0


def test_mbpp_extraction_follows_dare_patterns():
    assert extract_code_mbpp("[BEGIN]\n 'def f(x):\r\n    return x' \n[DONE]") == "def f(x):\r\n    return x"
    assert extract_code_mbpp("[BEGIN]\ndef f(x):\n    return x\n[DONE]\nmore") == "def f(x):\n    return x"
    assert extract_code_mbpp("```python\ndef f(x):\n    return x\n```") == "def f(x):\n    return x"
    assert extract_code_mbpp("[BEGIN]\n'x'\n[DONE]") is None  # under 10 characters: no code


def test_call_based_and_lcb_forms():
    taco = dare_row(
        "taco", json.dumps({"fn_name": "add", "inputs": [[1, 2], [0, 5]], "outputs": [[3], [5]]}), task="code"
    )
    assert AUTO(f"```python\n{RIGHT}```", taco) == 1.0 and AUTO(f"```python\n{WRONG}```", taco) == 0.0
    leet = "class Solution:\n    def add(self, a, b):\n        return a + b\n"
    lcb = dare_row(
        "lcbv5",
        json.dumps(
            [
                {"input": "1\n2", "output": "3", "testtype": "functional"},
                {"input": "4\n4", "output": "8", "testtype": "functional"},
            ]
        ),
        task="code",
        metadata=json.dumps({"func_name": "add"}),
    )
    assert AUTO(f"```python\n{leet}```", lcb) == 1.0
    stdin = dare_row("codeforces", [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}], task="code")
    assert AUTO("```python\na, b = map(int, input().split())\nprint(a + b)\n```", stdin) == 1.0
    assert AUTO("```python\nprint(4)\n```", stdin) == 0.0


# LiveCodeBench's stdout rule, which DARE runs on lcbv5 / taco / primeintellect rows (code_utils/livecodebench.py:
# 184-189, 340-377 of DARE @83ae8a3); each expected value is DARE's verdict on the same output (grade_stdio).
@pytest.mark.parametrize(
    "output, expected, want",
    [
        ("3\n", "3\n", True),
        ("3.0\n", "3\n", True),  # words read as decimals
        ("3e0", "3", True),
        ("   3  \n\n\n", "3", True),  # lines stripped at both ends, blank edges dropped
        ("3  0", "3 0", True),  # words split on any run of spaces
        ("3\r\n", "3", True),
        ("3\t", "3", True),
        ("3\n\n4", "3\n4", False),  # an inner blank line is a line
        ("3 0", "3", False),
        ("three", "3", False),
        ("0.3333", "0.33333", False),  # decimals compare exactly, no tolerance
        ("nan", "nan", True),  # equal as text
        ("NaN", "nan", False),
    ],
)
def test_lcb_stdout_rule(output, expected, want):
    assert lcb_output_equal(output, expected) is want


def test_taco_cases_as_dare_makes_them():
    """taco_to_lcb_format (code_reward.py:351-388 of DARE @83ae8a3): an empty input or output leaves the case out, a
    list output is its first element; stdout by LiveCodeBench's rule. DARE scored these 1.0; megadare gave 0.0
    (it ran the empty-input case, and compared "3.0" with "3" as text)."""
    stdio = json.dumps({"inputs": ["1 2\n", "2 2\n", ""], "outputs": ["3\n", ["4\n"], "7\n"]})
    prog = "```python\na, b = map(int, input().split())\nprint(float(a + b))\n```"
    assert AUTO(prog, dare_row("taco", stdio, task="code")) == 1.0
    calls = dare_row("taco", json.dumps({"fn_name": "add", "inputs": [[1, 2], []], "outputs": [[3], [0]]}), task="code")
    assert AUTO(f"```python\n{RIGHT}```", calls) == 1.0
    with pytest.raises(ValueError, match="no test case with both"):
        AUTO(f"```python\n{RIGHT}```", dare_row("taco", json.dumps({"inputs": [""], "outputs": ["1"]}), task="code"))


def test_no_test_is_an_error_not_a_pass():
    for tests in ([], {"inputs": [], "outputs": []}, "x = 1  # nothing is checked", "def check(c):\n    pass"):
        with pytest.raises(ValueError):
            code_reward(f"```python\n{RIGHT}```", tests)
    with pytest.raises(ValueError, match="does not compile"):
        code_reward(f"```python\n{RIGHT}```", "assert add(1,")


# ------------------------------------------------------------------------------------- programs faking a pass
FAKES = {  # each of these passed (exit status 0, or the test's own helper rebound) before test mode
    "exit(0) before the tests": WRONG + "import sys\nsys.exit(0)\n",
    "os._exit(0) when called": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "SystemExit inside check": "def add(a, b):\n    raise SystemExit(0)\n",
    "rebinds the test's helpers": WRONG + "import builtins\nbuiltins.abs = lambda x: 0\ncheck = lambda c: None\n",
    "writes to every fd": WRONG + "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'f' * 32)\n"
    "    except OSError:\n        pass\n",
    "raises the proof event": WRONG + "import sys\nsys.audit('megadare.tests_passed', None)\n",
}


@pytest.mark.parametrize("name", list(FAKES))
def test_programs_that_fake_a_pass_score_zero(name):
    tests = "def check(candidate):\n    assert abs(candidate(2, 3) - 5) == 0\n\ncheck(add)\n"
    assert code_reward(f"```python\n{RIGHT}```", tests) == 1.0
    assert code_reward(f"```python\n{FAKES[name]}```", tests) == 0.0
    if name != "rebinds the test's helpers":  # the same program outside test mode: exit status 0, "ok"
        assert run_program(FAKES[name] + "\nadd(2, 3)\n").status == "ok"


@pytest.mark.parametrize(
    "attack, refusal",
    [
        ("import sys\nsys._getframe(0)", "frame access is refused"),
        ("try:\n    1 / 0\nexcept ZeroDivisionError as e:\n    e.__traceback__.tb_frame", "frame access is refused"),
        ("import sys\nsys.settrace(lambda *a: None)", "frame access is refused"),
        ("import signal\nsignal.signal(signal.SIGALRM, lambda s, f: None)", "signal handlers is refused"),
        ("open('/proc/self/mem', 'rb')", "reading process memory"),
        ("(lambda: 0).__code__.replace(co_consts=())", "code.__new__ refused"),
    ],
)
def test_test_mode_closes_the_ways_to_the_token(attack, refusal):
    """The token proving a pass lives in the audit hook's closure: no frame, tracer, signal handler, memory read or
    hand-made code object can reach it while the program or its tests run."""
    r = run_program(attack + "\n", tests="assert True\n")
    assert not r.tests_passed and refusal in r.stderr, r.stderr
    assert run_program(attack + "\n").status in ("ok", "refused")  # outside test mode only the usual limits


def test_test_mode_passes_ordinary_programs():
    prog = (
        "from collections import namedtuple\nfrom dataclasses import dataclass\nfrom typing import List\n"
        "import logging\nP = namedtuple('P', 'x')\n@dataclass\nclass A:\n    v: int\n"
        "def add(a: int, b: int) -> int:\n    logging.getLogger().debug('x')\n    return A(P(a).x).v + b\n"
        "if __name__ == '__main__':\n    input()\n"
    )
    r = run_program(prog, tests="assert add(2, 3) == 5\n")
    assert r.status == "ok" and r.tests_passed, r
    assert run_program(WRONG, tests="assert add(2, 3) == 5\n").tests_passed is False
    assert run_program("print(1)").tests_passed is None


# ----------------------------------------------------------------------------------------- errors stop a run
def test_reward_errors_name_reward_record_and_exception():
    rows = [dare_row("gsm8k", "18"), dare_row("sudoku", SOLUTION), dare_row("gsm8k", "18")]  # no puzzle
    sources = ["train/gsm8k.parquet:row 1", "train/sudoku.parquet:row 7", "train/gsm8k.parquet:row 2"]
    scores, stats = score_batch("auto", ["\\boxed{18}", "<answer>1</answer>", "\\boxed{18}"], rows)
    assert scores == [1.0, 0.0, 1.0] and stats.errors == 1 and stats.first_error_index == 1
    with pytest.raises(
        RewardError,
        match=r"RL step 3: reward 'auto' could not be computed for 1 of 3 samples.*"
        r"first failure: train/sudoku.parquet:row 7: KeyError:.*puzzle",
    ):
        check_reward_errors(stats, "auto", sources, 0.0, "RL step 3")
    check_reward_errors(stats, "auto", sources, 0.5)  # tolerated when asked for


def test_math_on_dare_rows_says_how_it_differs_from_dare():
    """rewards.name=math on DARE's math rows used megadare's looser rule (an unboxed answer counts) without a word;
    the run's start prints one line naming the difference and rewards.name=dare_math, which scores them as DARE."""
    from megadare.rewards import math_reward, reward_notes, load_reward

    dare_row = {"data_source": "math500", "extra_info": {"task": "math"}, "answer": "5"}
    own_row = {"data_source": "math500", "answer": "5"}
    notes = reward_notes("math", [dare_row, own_row])
    assert len(notes) == 1 and "1 of 2 rows" in notes[0] and "rewards.name=dare_math" in notes[0], notes
    assert reward_notes("dare_math", [dare_row]) == reward_notes("auto", [dare_row]) == []
    assert reward_notes("math", [own_row]) == []
    # the difference the line names: an unboxed answer scores under math, not under DARE's rule
    assert math_reward("The answer is 5.", "5") == 1.0 and load_reward("dare_math")("The answer is 5.", dare_row) == 0.0


def test_adversarial_answers_score_as_dare_not_as_reward_errors():
    """A response is the policy's: one that made a reward raise was a reward error, which stops the run
    (rewards.max_error_fraction=0). `\\sqrt{` nested 300 deep: pylatexenc's RecursionError reached the verifier as a
    failed worker (DARE @83ae8a3 keeps the text in a bare except: 0); a countdown answer holding a 5,000-digit
    number: int()'s digit limit raised ValueError (DARE's validate_equation catches it: the format score 0.1)."""
    from megadare.rewards import score_batch

    deep = "\\boxed{" + "\\sqrt{" * 300 + "2" + "}" * 300 + "}"
    math_row = {"data_source": "math500", "extra_info": {"task": "math"}, "answer": "5"}
    countdown_row = {"data_source": "countdown", "answer": "24", "extra_info": {"numbers": [1, 2, 3, 4]}}
    scores, stats = score_batch("auto", [deep, f"<answer>{'9' * 5000}</answer>"], [math_row, countdown_row])
    assert scores == [0.0, 0.1] and stats.failures == 0, stats


# the MBPP patterns as DARE runs them (regexes), the oracle of the linear matcher that replaced them
_MBPP_REGEXES = [
    r"\[BEGIN\]\s*'(.*)'\s*\[DONE\]",
    r"BEGIN\s*'(.*)'\s*\[DONE\]",
    r"\[BEGIN\]\s*'(.*)'\s*DONE",
    r"BEGIN\s*'(.*)'\s*DONE",
    r"\[BEGIN\]\s*'(.*)\s*\[DONE\]",
    r"BEGIN\s*'(.*)\s*\[DONE\]",
    r"\[BEGIN\]\s*'(.*)\s*DONE",
    r"BEGIN\s*'(.*)\s*DONE",
    r"\[BEGIN\]\s*(.*)\s*\[DONE\]",
    r"BEGIN\s*(.*)\s*\[DONE\]",
    r"\[BEGIN\]\s*(.*)\s*DONE",
    r"BEGIN\s*(.*)\s*DONE",
    r"```python\s*(.*)\s*```",
    r"```\s*(.*)\s*```",
    r"```python\s*(.*)\s*$",
    r"```\s*(.*)\s*$",
    r"(.*)\s*```.*",
    r"\[BEGIN\]\s*'(.*)",
    r"\[BEGIN\](.*)",
    r"'(.*)'\s*\[DONE\]",
]


def test_mbpp_extraction_is_linear_and_matches_dares_regexes():
    """DARE's MBPP patterns run as regexes backtrack on a response that opens and never closes: "BEGIN " x 2,000
    took 16 s, x 8,000 154 s, past score_batch's 60 s per call (a reward error, which stops the run). The linear
    matcher gives the regexes' group on 20,000 random responses of their tokens, and such a response is a 0."""
    import random
    import re

    from megadare.rewards import score_batch
    from megadare.rewards.code_forms import _mbpp_match

    regexes = [re.compile(p, re.DOTALL) for p in _MBPP_REGEXES]
    tokens = ["[BEGIN]", "BEGIN", "[DONE]", "DONE", "'", " ", "\n", "```", "```python", "x", "[", "]", "\t"]
    rng = random.Random(0)
    for _ in range(20_000):
        text = "".join(rng.choice(tokens) for _ in range(rng.randint(0, 12)))
        want = next((m.group(1) for m in map(lambda r: r.search(text), regexes) if m), None)
        assert _mbpp_match(text) == want, text
    row = {"data_source": "mbpp", "prompt": "q", "answer": json.dumps(["assert f(1) == 1"])}
    scores, stats = score_batch("auto", ["BEGIN " * 20_000], [row])
    assert scores == [0.0] and stats.failures == 0, stats
