"""Code rewards: run the program in a response against its tests in the sandbox; the score is the pass fraction.

Conventions (those of the DiffuCoder / dLLM-RL code rewards and the datasets they train on):

* the program is the last fenced ```` ```python ```` block of the response (``py``/``python3`` tags too), else the
  last fenced block of any language, else the whole response;
* tests are either stdin/stdout cases ``{"inputs": [...], "outputs": [...]}`` (APPS / TACO / DeepCoder style;
  outputs compared line by line after stripping trailing whitespace and blank edges), or assert-style test
  code appended to the program (AceCoder / KodCode style): a string is one case, a list of strings one case
  each, ``{"test_code": str | list}`` the same. A case passes when the run ends "ok" (and, for stdin cases, the
  output matches). Call-based cases (``fn_name``) are not supported and raise ValueError;
* ``code_reward`` is the fraction of cases passed (``all_or_nothing=True``: 1.0 only when all pass); cases run
  concurrently on a small thread pool, each in its own sandbox.
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

from megadare.rewards.sandbox import SandboxResult, run_program

__all__ = ["extract_code", "TestCase", "CaseResult", "parse_tests", "run_tests", "code_reward", "summarize"]

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PY_TAGS = {"python", "py", "python3", "py3"}


def extract_code(response: str) -> str:
    """The last ```` ```python ```` block of ``response``; else its last fenced block; else the whole response.

    An unclosed last fence (a truncated generation) counts from the fence to the end of the text.
    """
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE_RE.finditer(response or "")]
    py = [body for tag, body in blocks if tag in _PY_TAGS]
    if py:
        return py[-1]
    tail = re.search(r"```[ \t]*(?:python|py|python3|py3)[ \t]*\n((?:(?!```).)*)$", response or "", re.DOTALL)
    if tail:
        return tail.group(1)
    if blocks:
        return blocks[-1][1]
    return response or ""


@dataclass
class TestCase:
    """One test: ``stdin`` + ``expected`` stdout (stdin/stdout style), or ``test_code`` appended to the program."""
    __test__ = False  # not a pytest class

    stdin: str = ""
    expected: Optional[str] = None
    test_code: Optional[str] = None


@dataclass
class CaseResult:
    """A test case's verdict and the sandbox run behind it."""
    passed: bool
    run: SandboxResult


def _as_text(x: Any) -> str:
    if isinstance(x, (list, tuple)):
        return "\n".join(str(v) for v in x)
    return "" if x is None else str(x)


def parse_tests(tests: Union[dict, str, Sequence[str]]) -> List[TestCase]:
    """Normalise the accepted test formats (see the module docstring) into a list of :class:`TestCase`."""
    if isinstance(tests, str):
        return [TestCase(test_code=tests)]
    if isinstance(tests, dict):
        if tests.get("fn_name"):
            raise ValueError("call-based tests (fn_name) are not supported; give stdin/stdout or assert tests")
        if "inputs" in tests or "outputs" in tests:
            inputs, outputs = list(tests.get("inputs") or []), list(tests.get("outputs") or [])
            if len(inputs) != len(outputs):
                raise ValueError(f"tests have {len(inputs)} inputs but {len(outputs)} outputs")
            return [TestCase(stdin=_as_text(i), expected=_as_text(o)) for i, o in zip(inputs, outputs)]
        if "test_code" in tests:
            return parse_tests(tests["test_code"])
        raise ValueError(f"unknown test format: keys {sorted(tests)}; expected inputs/outputs or test_code")
    if isinstance(tests, (list, tuple)) and all(isinstance(t, str) for t in tests):
        return [TestCase(test_code=t) for t in tests]
    raise ValueError(f"unknown test format: {type(tests).__name__}")


def _lines(text: str) -> List[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def _run_case(code: str, case: TestCase, sandbox_kw: dict) -> CaseResult:
    if case.test_code is not None:
        run = run_program(code + "\n\n" + case.test_code + "\n", "", **sandbox_kw)
        return CaseResult(run.ok, run)
    run = run_program(code, case.stdin, **sandbox_kw)
    return CaseResult(run.ok and _lines(run.stdout) == _lines(case.expected or ""), run)


def run_tests(code: str, tests: Union[dict, str, Sequence[str]], *, timeout_s: float = 5.0, memory_mb: int = 512,
              workers: int = 4, **sandbox_kw: Any) -> List[CaseResult]:
    """Run ``code`` on every test case (concurrently, ``workers`` sandboxes at a time), in case order."""
    cases = parse_tests(tests)
    if not cases:
        return []
    kw = dict(sandbox_kw, timeout_s=timeout_s, memory_mb=memory_mb)
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(cases))), thread_name_prefix="code-case") as ex:
        return list(ex.map(lambda c: _run_case(code, c, kw), cases))


def code_reward(response: str, tests: Union[dict, str, Sequence[str]], *, timeout_s: float = 5.0,
                memory_mb: int = 512, workers: int = 4, all_or_nothing: bool = False,
                **sandbox_kw: Any) -> float:
    """Fraction of ``tests`` passed by the program in ``response`` (0.0 for no cases or an empty program)."""
    code = extract_code(response)
    if not code.strip():
        return 0.0
    results = run_tests(code, tests, timeout_s=timeout_s, memory_mb=memory_mb, workers=workers, **sandbox_kw)
    if not results:
        return 0.0
    passed = sum(r.passed for r in results)
    if all_or_nothing:
        return 1.0 if passed == len(results) else 0.0
    return passed / len(results)


def summarize(results: Sequence[CaseResult]) -> Tuple[int, dict]:
    """``(passed, {status: count})`` over case results, for logging."""
    counts: dict = {}
    for r in results:
        counts[r.run.status] = counts.get(r.run.status, 0) + 1
    return sum(r.passed for r in results), counts
