"""Code rewards: run the program in a response against its tests in the sandbox; the score is the pass fraction.

Conventions (those of the DiffuCoder / dLLM-RL code rewards and the datasets they train on):

* the program is the last fenced ```` ```python ```` block of the response (``py``/``python3`` tags too), else the
  last fenced block of any language, else the whole response;
* tests are either stdin/stdout cases ``{"inputs": [...], "outputs": [...]}`` (APPS / TACO / DeepCoder style;
  outputs compared line by line after stripping trailing whitespace and blank edges; exit status 0 only), call-based
  cases (the same with ``"fn_name"``: each input is the argument list, or newline-separated JSON arguments, and the
  function's return value -- a tuple read as a list; exact built-in data types only -- must equal the output; a
  ``class Solution`` method when the program defines one, as LiveCodeBench / TACO do), or assert-style test code run
  after the program (AceCoder / KodCode / MBPP / HumanEval style): a string is one case, a list of strings one case
  each, ``{"test_code": str | list}`` the same. Test code runs in the sandbox's test mode: it passes only when it ran to its end (a program that exits
  early, or raises SystemExit inside a test, fails) and it must hold an ``assert`` or a ``raise``; it calls the true
  builtins, whatever the program defines, but for a function under test named like one (``def sorted``,
  :func:`tested_builtins`), which the program must define;
* no test case at all, or test code that does not compile, raises ValueError: no test ran, which is no pass;
* ``code_reward`` is the fraction of cases passed (``all_or_nothing=True``: 1.0 only when all pass, and the cases
  stop at the first failure); cases run concurrently on a small thread pool, each in its own sandbox, within a
  total budget (:data:`BUDGET_S`, 45 s): a case not started in it counts as failed.
"""

from __future__ import annotations

import ast
import builtins
import json
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, List, Optional, Sequence, Tuple, Union

from megadare.rewards.sandbox import SandboxLimits, SandboxResult, run_program

__all__ = [
    "extract_code",
    "lcb_output_equal",
    "TestCase",
    "CaseResult",
    "call_case",
    "tested_builtins",
    "parse_tests",
    "run_tests",
    "code_reward",
]

_PY_TAGS = {"python", "py", "python3", "py3"}
_TAG_RE = re.compile(r"[ \t]*([A-Za-z0-9_+-]*)")
_TAIL_RE = re.compile(r"```[ \t]*(?:python|py|python3|py3)[ \t]*\n")


def _fenced_blocks(text: str) -> List[Tuple[str, str]]:
    """``(tag, body)`` of each closed fenced block (an opening fence, its tag, the rest of its line, then the body up
    to the next fence), in linear time. As the regex it replaces (the same matches), every opening fence with no line
    break after it scanned the rest of the text: three backticks x 16,000 (48k characters) took 29 s, past
    score_batch's 60 s per call with a little more of it."""
    blocks, at = [], text.find("```")
    while at >= 0:
        line_end = text.find("\n", at + 3)
        close = -1 if line_end < 0 else text.find("```", line_end + 1)
        if close < 0:  # no line break, or no closing fence, after this opening: none after a later one either
            break
        blocks.append((_TAG_RE.match(text, at + 3).group(1).lower(), text[line_end + 1 : close]))
        at = text.find("```", close + 3)
    return blocks


def extract_code(response: str) -> str:
    """The last ```` ```python ```` block of ``response``; else its last fenced block; else the whole response.

    An unclosed last fence (a truncated generation) counts from the fence to the end of the text.
    """
    text = response or ""
    blocks = _fenced_blocks(text)
    py = [body for tag, body in blocks if tag in _PY_TAGS]
    if py:
        return py[-1]
    last = text.rfind("```")  # an unclosed python fence holds no other fence after its line: it is the last one
    tail = _TAIL_RE.match(text, last) if last >= 0 else None
    if tail:
        return text[tail.end() :]
    if blocks:
        return blocks[-1][1]
    return text


@dataclass
class TestCase:
    """One test: ``stdin`` + ``expected`` stdout (stdin/stdout style), or ``test_code`` run after the program.
    ``compare``: how stdout is matched, "lines" (megadare's rule, :func:`_lines`), "lcb" (LiveCodeBench's
    ``grade_stdio``, which DARE runs: :func:`lcb_output_equal`) or "tokens" (dLLM-RL's: the words equal)."""

    __test__ = False  # not a pytest class

    stdin: str = ""
    expected: Optional[str] = None
    test_code: Optional[str] = None
    compare: str = "lines"
    tested: Tuple[str, ...] = ()  # builtin names under test (the tests see the program's ones): tested_builtins


@dataclass
class CaseResult:
    """A test case's verdict and the sandbox run behind it."""

    passed: bool
    run: SandboxResult


def _as_text(x: Any) -> str:
    if isinstance(x, (list, tuple)):
        return "\n".join(str(v) for v in x)
    return "" if x is None else str(x)


_BUILTIN_NAMES = frozenset(dir(builtins)) - {"globals"}  # globals: the guard of _code_case calls it


def tested_builtins(tree: ast.AST) -> Tuple[str, ...]:
    """The builtin names test code tests: when every name the tests use but do not define is a builtin (the
    function under test is named like one, ``assert sorted([3, 1]) == [1, 3]``), the builtins they call or pass to
    a call (``check(sorted)``); else none (the function under test has its own name, and every builtin the tests use
    is the true one, whatever the program defines). The tests then see the program's definitions of those names: a
    program that also redefines a builtin the tests compute an expected value with (``list``) fools them, a hole
    left open for such rows only."""
    bound, loaded, called = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        if isinstance(node, ast.Call):
            called.update(a.id for a in (node.func, *node.args) if isinstance(a, ast.Name))
    free = loaded - bound
    if not free or not free <= _BUILTIN_NAMES:
        return ()
    return tuple(sorted(called & free))


def _code_case(test_code: str) -> TestCase:
    """A test-code case, checked to compile and to hold something that can fail (an assert or a raise). When the
    function under test is named like a builtin (:func:`tested_builtins`), a first line checks the program defines
    one of those names (else the tests would test the builtin, and a program defining nothing would pass)."""
    try:
        tree = ast.parse(test_code, "tests.py")
    except SyntaxError as e:
        raise ValueError(f"test code does not compile (line {e.lineno}: {e.msg})") from e
    if not any(isinstance(node, (ast.Assert, ast.Raise)) for node in ast.walk(tree)):
        raise ValueError(f"test code holds no assert and no raise: it would pass any program; got {test_code[:200]!r}")
    tested = tested_builtins(tree)
    if tested:
        defined = " or ".join(f"{n!r} in globals()" for n in tested)
        message = f"the program defines none of {', '.join(tested)}, the function under test"
        test_code = f"assert {defined}, {message!r}\n{test_code}"
    return TestCase(test_code=test_code, tested=tested)


def _literal(value: Any) -> str:
    """JSON data (dict, list, str, int, float, bool, None) as Python source that evaluates to it."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    if isinstance(value, list):
        return "[" + ", ".join(map(_literal, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


# a call-based case compares the return value with ``==``: an object of the program's whose __eq__ is always true
# (or a metaclass whose __eq__ says a type is list) passed every case. Only exact built-in data types, whose ==
# the program cannot change, are compared (``is``, never ``in``: a membership test calls the program's __eq__)
_PLAIN_DATA_CHECK = """
def _plain(v):
    t = type(v)
    if t is list or t is tuple:
        return all(_plain(x) for x in v)
    if t is dict:
        return all(_plain(k) and _plain(x) for k, x in v.items())
    return t is int or t is float or t is bool or t is str or v is None
assert _plain(_got), 'the return value is no plain data (list, tuple, dict, str, int, float, bool, None)'
assert _got == _want, 'wrong answer'
"""


def call_case(fn_name: str, args: Any, expected: Any) -> TestCase:
    """A call-based case: ``fn_name(*args)`` (a ``Solution`` method when the program defines the class) must
    return ``expected``. ``args``: a list, or newline-separated JSON values; ``expected``: a value or JSON text."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(fn_name)):
        raise ValueError(f"fn_name {fn_name!r} is not a Python identifier")
    if isinstance(args, str):
        args = [json.loads(line) for line in args.split("\n") if line.strip()]
    if isinstance(expected, str):
        expected = json.loads(expected)
    # the expected value as a literal (JSON data, as json.dumps takes it), built by the compiler before the program
    # runs: a json.loads in the tests would call whatever the program put there (json.loads = lambda s: []). The
    # arguments may go through json (the program decides what its function does with them anyway); large inputs
    # compile far slower as literals (0.5 s and 170 MB for 200k ints)
    code = (
        f"import json as _json\n_args = _json.loads({json.dumps(json.dumps(args))})\n"
        f"_want = {_literal(json.loads(json.dumps(expected)))}\n"
        f"_fn = getattr(Solution(), {fn_name!r}) if 'Solution' in globals() else globals()[{fn_name!r}]\n"
        "_got = _fn(*_args)\n_got = list(_got) if isinstance(_got, tuple) else _got\n" + _PLAIN_DATA_CHECK
    )
    # globals()[...]: a function named like a builtin is the program's, or none (KeyError), never the builtin
    return TestCase(test_code=code, tested=(fn_name,) if fn_name in _BUILTIN_NAMES else ())


def _io_cases(tests: dict) -> List[TestCase]:
    inputs, outputs = list(tests.get("inputs") or []), list(tests.get("outputs") or [])
    if len(inputs) != len(outputs):
        raise ValueError(f"tests have {len(inputs)} inputs but {len(outputs)} outputs")
    if tests.get("fn_name"):
        return [call_case(tests["fn_name"], i, o) for i, o in zip(inputs, outputs)]
    return [TestCase(stdin=_as_text(i), expected=_as_text(o)) for i, o in zip(inputs, outputs)]


Tests = Union[dict, str, Sequence[str], Sequence[TestCase]]


def parse_tests(tests: Tests) -> List[TestCase]:
    """Normalise the accepted test formats (see the module docstring) into a non-empty list of :class:`TestCase`
    (a list of TestCase passes through)."""
    if isinstance(tests, (list, tuple)) and tests and all(isinstance(t, TestCase) for t in tests):
        cases = list(tests)
    elif isinstance(tests, str):
        cases = [_code_case(tests)]
    elif isinstance(tests, dict):
        if "inputs" in tests or "outputs" in tests:
            cases = _io_cases(tests)
        elif "test_code" in tests:
            cases = parse_tests(tests["test_code"])
        else:
            raise ValueError(f"unknown test format: keys {sorted(tests)}; expected inputs/outputs or test_code")
    elif isinstance(tests, (list, tuple)) and all(isinstance(t, str) for t in tests):
        cases = [_code_case(t) for t in tests]
    else:
        raise ValueError(f"unknown test format: {type(tests).__name__}")
    if not cases:
        raise ValueError("no test cases: nothing would run, so no program could be judged")
    return cases


def _lines(text: str) -> List[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def _decimals(line: str) -> Optional[List[Decimal]]:
    """The line's words as decimals, or None. A signalling NaN (``sNaN``) is no number: ``==`` on it raises
    InvalidOperation, so a program printing it turned its wrong answer into a reward error (LiveCodeBench's worker
    dies on it: a failed case)."""
    try:
        words = [Decimal(word) for word in line.split()]
    except (InvalidOperation, ValueError, TypeError):
        return None
    return None if any(w.is_snan() for w in words) else words


def lcb_output_equal(output: str, expected: str) -> bool:
    """LiveCodeBench's stdout rule, as DARE runs it (``code_utils/livecodebench.py:184-189, 340-377`` of DARE
    @83ae8a3): both texts stripped and split on newlines, each line stripped, as many lines; each line equal as
    text, else as its whitespace-separated words read as decimals (``1.0`` = ``1``, ``1e3`` = ``1000``)."""
    got = [line.strip() for line in output.strip().split("\n")]
    want = [line.strip() for line in expected.strip().split("\n")]
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if g != w and (_decimals(g) is None or _decimals(g) != _decimals(w)):
            return False
    return True


def _run_case(code: str, case: TestCase, limits: SandboxLimits) -> CaseResult:
    if case.test_code is not None:
        run = run_program(code, "", limits, tests=case.test_code, tested=case.tested)
        return CaseResult(bool(run.tests_passed), run)
    run = run_program(code, case.stdin, limits)
    if case.compare == "lcb":
        # DARE's grade_stdio runs the program through LiveCodeBench's call_method, which swallows any SystemExit:
        # a program that prints the answer then calls sys.exit(1) passes there (an uncaught exception does not), so
        # it passes here (megadare's own "lines" rule keeps asking for exit status 0)
        return CaseResult((run.ok or run.exited) and lcb_output_equal(run.stdout, case.expected or ""), run)
    if case.compare == "tokens":
        # dLLM-RL's stdio rule (reward/rl_execute.py test_if_eq): the whitespace-separated words equal; its worker
        # keeps what a program printed before its own SystemExit of any code, and an exception fails
        return CaseResult((run.ok or run.exited) and run.stdout.split() == (case.expected or "").split(), run)
    return CaseResult(run.ok and _lines(run.stdout) == _lines(case.expected or ""), run)


# the most one code reward runs its cases, below score_batch's 60 s per call (past it a call is a reward failure, which
# stops the run): N cases on 4 workers x timeout_s ran 48 / 4 x 5 s = 60 s
BUDGET_S = 45.0


def run_tests(
    code: str,
    tests: Tests,
    *,
    limits: SandboxLimits = SandboxLimits(),
    workers: int = 4,
    budget_s: Optional[float] = None,
) -> List[CaseResult]:
    """Run ``code`` on every test case (concurrently, ``workers`` sandboxes at a time, each under ``limits``), in
    case order. ``budget_s``: the cases' total time (None: no limit); a case starts only while its ``timeout_s``
    fits in what is left of it (each worker's first case always starts), and a case not started fails (its run has
    status "timeout" and says why in its stderr)."""
    cases = parse_tests(tests)
    ex = ThreadPoolExecutor(max_workers=max(1, min(workers, len(cases))), thread_name_prefix="code-case")
    try:
        return [f.result() for f in _submit(ex, workers, code, cases, limits, budget_s)]
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def _submit(ex: ThreadPoolExecutor, workers: int, code: str, cases: List[TestCase], limits: SandboxLimits, budget_s):
    """Each case as a future of ``ex`` (``workers`` threads), under the total ``budget_s`` (see :func:`run_tests`)."""
    deadline = time.monotonic() + (math.inf if budget_s is None else budget_s)
    first_wave = max(1, workers)

    def run(k: int) -> CaseResult:
        if k >= first_wave and time.monotonic() + limits.timeout_s > deadline:
            why = f"[code] case not run: the cases' {budget_s:g}s budget was spent (it counts as failed)"
            return CaseResult(False, SandboxResult("timeout", None, "", why, 0.0))
        return _run_case(code, cases[k], limits)

    return [ex.submit(run, k) for k in range(len(cases))]


def code_reward(
    response: str,
    tests: Tests,
    *,
    limits: SandboxLimits = SandboxLimits(),
    all_or_nothing: bool = False,
    preamble: str = "",
    code: Optional[str] = None,
) -> float:
    """Fraction of ``tests`` passed by the program in ``response`` (0.0 for an empty program), each case in its own
    sandbox under ``limits`` (:class:`~megadare.rewards.sandbox.SandboxLimits`: time, memory, isolation ...).

    The cases run 4 at a time within :data:`BUDGET_S` in all (45 s: below score_batch's 60 s per call): a case not
    started while its ``timeout_s`` still fits in the budget counts as failed, so the score is (cases passed) / (all
    cases), and a slow program on a row of many cases scores what it passed in the budget. ``all_or_nothing``: 1.0
    only when every case passes; the cases stop at the first failure.

    ``code``: the program when the caller extracted it already (else :func:`extract_code`); ``preamble``: source
    put before it (imports the program may rely on). Test formats are checked before anything runs, so bad tests
    raise ValueError even for an empty program.
    """
    cases = parse_tests(tests)
    program = extract_code(response) if code is None else code
    if not program.strip():
        return 0.0
    if all_or_nothing:
        return 1.0 if _all_pass(preamble + program, cases, limits, BUDGET_S) else 0.0
    results = run_tests(preamble + program, cases, limits=limits, budget_s=BUDGET_S)
    return sum(r.passed for r in results) / len(results)


def _all_pass(code: str, cases: List[TestCase], limits: SandboxLimits, budget_s: float, workers: int = 4) -> bool:
    """Do all ``cases`` pass (within ``budget_s``: :func:`run_tests`)? Stops at the first failure (the cases not
    started yet never run), as LiveCodeBench's harness does: a program that loops ran every case to its timeout,
    ``len(cases) / workers * timeout_s`` (a row with 48 cases: past score_batch's 60 s, a reward failure that stops
    the run), for a score already 0."""
    ex = ThreadPoolExecutor(max_workers=max(1, min(workers, len(cases))), thread_name_prefix="code-case")
    try:
        return all(f.result().passed for f in as_completed(_submit(ex, workers, code, cases, limits, budget_s)))
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
