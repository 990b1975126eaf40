"""DARE's code ground truths as test cases, and its MBPP answer extraction (``verl/utils/reward_score/code_reward.py``,
DARE @83ae8a3).

DARE's RL rows keep the tests in ``reward_model.ground_truth`` (the record's ``answer`` here), by ``data_source``:

=====================================  =====================================================================
humaneval                              test code defining ``check(candidate)``; DARE appends ``check(<entry>)``
                                       (here the ``entry_point`` field, else the last ``def`` of the prompt)
humanevalplus                          a full harness (numpy, ``check(...)`` called at its end), judged outside
                                       the program's process (:mod:`.harness`): the sandbox prints what the
                                       program returned on the inputs, DARE's ``assertion`` runs in the trainer
mbpp, kodcode                          a JSON list of ``assert`` lines (one case each)
taco, apps, code_contests              ``{"inputs", "outputs"[, "fn_name"]}`` (JSON text or dict), read as DARE's
                                       ``taco_to_lcb_format`` reads them (a list output is its first element, empty
                                       cases left out)
lcbv5, livecodebench, codeforces,      a list of ``{"input", "output", "testtype"}``; ``functional`` cases call
primeintellect                         ``extra_info.metadata.func_name`` (JSON lines of arguments)
=====================================  =====================================================================

Stdin cases of both kinds compare stdout by LiveCodeBench's rule (:func:`~megadare.rewards.code.lcb_output_equal`:
lines stripped, words equal as decimals), as DARE's ``grade_stdio`` does; and as there, a program that ends by its own
``SystemExit`` of any code (``sys.exit(1)`` after printing the answer) is judged on its output (a crash fails).

Programs get DARE's standard-library imports in front (its ``BASE_IMPORTS`` without numpy/pandas: ``List``,
``math``, ``Counter``, ...), so a program that relies on them is judged as DARE judges it. An MBPP response (its
prompt's ``[BEGIN]`` turn closed, as verl renders DARE's rows: the response alone is scored, as DARE scores it) gives
the program DARE's OpenCompass-style patterns take between ``[BEGIN]`` and ``[DONE]``; any other source gives DARE's
fenced block (:func:`extract_code_dare`; kodcode too: DARE's MBPP patterns are for ``mbpp`` only), and a response
without one scores 0. DARE's code reward is binary: all cases must pass.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Callable, List, Optional

from megadare.rewards.code import BUDGET_S, TestCase, call_case, code_reward, parse_tests
from megadare.rewards.harness import harness_verdict, parse_harness
from megadare.rewards.sandbox import OUTPUT_LIMIT, SandboxLimits

__all__ = [
    "CODE_SOURCES",
    "PREAMBLE",
    "extract_code_mbpp",
    "extract_code_dare",
    "program_extractor",
    "entry_point",
    "dare_test_cases",
    "dare_code_reward",
]

HUMANEVAL, HUMANEVALPLUS = "humaneval", "humanevalplus"
ASSERT_LISTS = ("mbpp", "kodcode")
IO_DICTS = ("taco", "apps", "code_contests")
LCB_LISTS = ("lcbv5", "livecodebench", "codeforces", "primeintellect")
CODE_SOURCES = frozenset((HUMANEVAL, HUMANEVALPLUS) + ASSERT_LISTS + IO_DICTS + LCB_LISTS)

PREAMBLE = """from itertools import accumulate, chain, combinations, count, permutations, product, groupby, islice, repeat
from copy import deepcopy
from string import ascii_lowercase, ascii_uppercase
from math import floor, log2, log10, sqrt, comb, gcd, ceil, inf, isqrt, factorial, atan2, pi, log, prod
from collections import defaultdict, deque, Counter, OrderedDict
from bisect import bisect, bisect_left, bisect_right, insort
from heapq import heappush, heappop, heapify, merge, nlargest, nsmallest, heapreplace
from functools import reduce, cache, lru_cache, cmp_to_key, partial
from typing import List, Tuple, Dict, Set, Optional, Union, Any, Callable, Iterable, Iterator, Generator, Deque
import copy, string, math, collections, bisect, heapq, functools, random, itertools, operator, re, datetime, sys
"""

# OpenCompass' MBPPEvaluator patterns, in DARE's order (extract_code_from_model_mbpp), each as (opening literal,
# whitespace after it, opening quote, closing quote, closing literal; "" = the text's start, None = its end): the
# pattern ``A\s*Q(.*)Q\s*B`` (DOTALL, searched). Run as regexes they backtrack: "BEGIN " x 2,000 (12k characters)
# took 16 s, x 8,000 154 s, past score_batch's 60 s per call: a reward error any response could cause
_MBPP_PATTERNS = (
    ("[BEGIN]", True, "'", "'", "[DONE]"),
    ("BEGIN", True, "'", "'", "[DONE]"),
    ("[BEGIN]", True, "'", "'", "DONE"),
    ("BEGIN", True, "'", "'", "DONE"),
    ("[BEGIN]", True, "'", "", "[DONE]"),
    ("BEGIN", True, "'", "", "[DONE]"),
    ("[BEGIN]", True, "'", "", "DONE"),
    ("BEGIN", True, "'", "", "DONE"),
    ("[BEGIN]", True, "", "", "[DONE]"),
    ("BEGIN", True, "", "", "[DONE]"),
    ("[BEGIN]", True, "", "", "DONE"),
    ("BEGIN", True, "", "", "DONE"),
    ("```python", True, "", "", "```"),
    ("```", True, "", "", "```"),
    ("```python", True, "", "", None),
    ("```", True, "", "", None),
    ("", False, "", "", "```"),
    ("[BEGIN]", True, "'", "", None),
    ("[BEGIN]", False, "", "", None),
    ("'", False, "", "'", "[DONE]"),
)


def _group_start(text: str, opening: str, space: bool, quote: str) -> Optional[int]:
    """Where ``(.*)`` starts in the leftmost match of ``opening\s*quote`` (``space``: the ``\s*``), or None."""
    at = text.find(opening)
    while at >= 0:
        g = at + len(opening)
        while space and g < len(text) and text[g].isspace():
            g += 1
        if text.startswith(quote, g):
            return g + len(quote)
        at = text.find(opening, at + 1)
    return None


def _group_end(text: str, start: int, quote: str, closing: Optional[str]) -> Optional[int]:
    """Where a greedy ``(.*)`` from ``start`` ends before ``quote\s*closing`` (the last place it fits), or None."""
    if closing is None:
        return len(text)
    at = text.rfind(closing)
    while at >= start:
        e = at
        while quote and e > 0 and text[e - 1].isspace():
            e -= 1
        e -= len(quote)
        if e >= start and text.startswith(quote, e):
            return e
        at = text.rfind(closing, 0, at)
    return None


def _mbpp_match(text: str) -> Optional[str]:
    """The group of the first of :data:`_MBPP_PATTERNS` that matches ``text``, as ``re.search`` gives it, in linear
    time: the group's start only moves right from one opening to the next, so the first opening is the only one
    that can match."""
    for opening, space, q_open, q_close, closing in _MBPP_PATTERNS:
        start = _group_start(text, opening, space, q_open)
        end = None if start is None else _group_end(text, start, q_close, closing)
        if end is not None:
            return text[start:end]
    return None


def extract_code_mbpp(text: str) -> Optional[str]:
    """The program of an MBPP response (prefill included), by DARE's patterns; None when under 10 characters."""
    found = _mbpp_match(text or "")
    if found is not None:
        text = found
    text = re.split(r"'?\s*\[?DONE\]?", (text or "").split("```")[0])[0].replace("\\_", "_").strip()
    return text if len(text) >= 10 else None


_DARE_FENCE_RE = re.compile(r"```(?:\w+)?\s*\n(.*?)```", re.DOTALL)
_DEF_RE = re.compile(r"def\s+\w+\s*\(")


def extract_code_dare(text: str) -> Optional[str]:
    """The program DARE takes from a (non-MBPP) response (``extract_code_from_model``): the only closed fenced block,
    else the first one that defines a function, else the last; stripped. None without a closed fenced block."""
    blocks = [b.strip() for b in _DARE_FENCE_RE.findall(text or "")]
    if len(blocks) <= 1:
        return blocks[0] if blocks else None
    return next((b for b in blocks if _DEF_RE.search(b)), blocks[-1])


def _extra(record: dict) -> dict:
    extra = record.get("extra_info")
    return extra if isinstance(extra, dict) else {}


def entry_point(record: dict) -> str:
    """The function HumanEval's ``check`` is called on: ``entry_point`` (top level or in extra_info), else the
    last top-level ``def`` of the prompt's last user message (DARE's rows carry no entry point).

    DARE differs here on purpose: it checks the FIRST ``def`` of the response (``code_reward.py:277-290`` of DARE
    @83ae8a3), so a right answer with a helper defined first scores 0 and a function renamed by the model can
    score 1; that tests the wrong function, so megadare keeps HumanEval's own ``check(entry_point)``."""
    name = record.get("entry_point") or _extra(record).get("entry_point")
    if name:
        return str(name)
    prompt = record.get("prompt")
    text = (
        prompt
        if isinstance(prompt, str)
        else next(
            (m.get("content", "") for m in reversed(prompt or []) if isinstance(m, dict) and m.get("role") == "user"),
            "",
        )
    )
    found = re.findall(r"^def\s+([A-Za-z_]\w*)\s*\(", text or "", re.MULTILINE)
    if not found:
        raise ValueError(
            "humaneval record: no entry_point field and no top-level 'def' in its prompt; the tests' "
            "check(candidate) would not know which function to test"
        )
    return found[-1]


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _calls_check(test_code: str) -> bool:
    tree = ast.parse(test_code)
    return any(
        isinstance(n, ast.Expr)
        and isinstance(n.value, ast.Call)
        and isinstance(n.value.func, ast.Name)
        and n.value.func.id == "check"
        for n in tree.body
    )


def _humaneval(test_code: str, record: dict) -> List[TestCase]:
    if "def check" not in test_code:
        raise ValueError("humaneval tests must define check(candidate)")
    if _calls_check(test_code):
        return parse_tests(test_code)
    return parse_tests(f"{test_code}\n\ncheck({entry_point(record)})\n")


def _lcb(cases: Any, record: dict) -> List[TestCase]:
    cases = _json(cases)
    fn_name = (_json(_extra(record).get("metadata") or record.get("metadata") or {}) or {}).get("func_name")
    out = []
    for case in cases:
        if case.get("testtype") == "functional":
            if not fn_name:
                raise ValueError("functional (call-based) test without extra_info.metadata.func_name")
            out.append(call_case(fn_name, case["input"], case["output"]))
        else:
            out.append(TestCase(stdin=_stdin(case["input"]), expected=str(case["output"]), compare="lcb"))
    return parse_tests(out)


def _stdin(value: Any) -> str:
    """A case's input as the program reads it: a list is its lines (LiveCodeBench's ``call_method``)."""
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _io_dict(tests: Any) -> List[TestCase]:
    """TACO / APPS cases as DARE's ``taco_to_lcb_format`` makes them (``code_reward.py:351-388`` of DARE @83ae8a3):
    an output given as a list is its first element, a case with an empty input or output is left out (a program
    that reads nothing is not judged on it); stdout compared by LiveCodeBench's rule (:func:`lcb_output_equal`)."""
    tests = dict(_json(tests))
    inputs, outputs = list(tests.get("inputs") or []), list(tests.get("outputs") or [])
    if len(inputs) != len(outputs):
        raise ValueError(f"tests have {len(inputs)} inputs but {len(outputs)} outputs")
    cases = []
    for inp, out in zip(inputs, outputs):
        if not inp or not out:
            continue
        out = out[0] if isinstance(out, list) else out
        if tests.get("fn_name"):
            cases.append(call_case(tests["fn_name"], inp, out))
        else:
            cases.append(TestCase(stdin=_stdin(inp), expected=str(out), compare="lcb"))
    if not cases:
        raise ValueError("no test case with both an input and an output (DARE leaves the empty ones out)")
    return parse_tests(cases)


def dare_test_cases(record: dict) -> List[TestCase]:
    """The test cases of a DARE code row (its ``answer`` = ``reward_model.ground_truth``; see the table above). A
    humanevalplus row's are its harness run in the program's process, as DARE runs it: :func:`dare_code_reward`
    judges those rows outside it instead (:mod:`.harness`)."""
    source, gold = str(record.get("data_source", "")).lower(), record["answer"]
    if source == HUMANEVAL or source == HUMANEVALPLUS:
        return _humaneval(str(gold), record)
    if source in ASSERT_LISTS:
        asserts = _json(gold)
        if not isinstance(asserts, list) or not all(isinstance(a, str) for a in asserts):
            raise ValueError(f"{source} tests must be a JSON list of assert lines, got {str(gold)[:200]!r}")
        return parse_tests(asserts)
    if source in IO_DICTS:
        return _io_dict(gold)
    if source in LCB_LISTS:
        return _lcb(gold, record)
    raise ValueError(f"no DARE code-test format for data_source {source!r} (known: {', '.join(sorted(CODE_SOURCES))})")


# the most a humanevalplus harness runs: below score_batch's 60 s per reward call (a harness of 70 inputs got 70 s, so
# a program that loops ran past the call's limit, a reward failure that stops the run, not a wrong answer)
HARNESS_TIMEOUT_CAP_S = BUDGET_S
# the program's outputs on a harness's inputs come back on stdout (the sandbox's usual cap: 1 MiB): tri's, the
# largest of DARE's rows, are 55 MB (a million floats per input, packed; large strs and ints travel as SHA-256s)
HARNESS_OUTPUT_LIMIT = 256 << 20


def _harness_timeout(n_inputs: int, base: float) -> float:
    """DARE's humanevalplus budget: 1 s per entry of the harness's ``inputs`` list (at least ``base``), at most
    :data:`HARNESS_TIMEOUT_CAP_S` (a right program runs the harness in well under a second)."""
    return max(base, min(HARNESS_TIMEOUT_CAP_S, float(n_inputs)))


def program_extractor(source: str) -> Callable[[str], Optional[str]]:
    """How DARE takes the program out of a response of ``data_source`` ``source``: MBPP's ``[BEGIN]..[DONE]``
    patterns for ``mbpp``, its fenced-block rule (:func:`extract_code_dare`) otherwise."""
    return extract_code_mbpp if str(source).lower() == "mbpp" else extract_code_dare


def dare_code_reward(response: str, record: dict, all_or_nothing: bool = True) -> float:
    """DARE's code score of ``response`` (the prompt's prefill included) on the row's tests; a humanevalplus row's
    harness is judged outside the program's process (:mod:`.harness`)."""
    source = str(record.get("data_source", "")).lower()
    plus = source == HUMANEVALPLUS  # its harness imports numpy
    harness = parse_harness(str(record["answer"]), record) if plus else None
    cases = None if plus else dare_test_cases(record)
    code = program_extractor(source)(response)
    timeout = float(record.get("timeout_s", 5.0))
    if harness is not None:
        timeout = _harness_timeout(harness.n_inputs, timeout)
    limits = SandboxLimits(
        timeout_s=timeout,
        memory_mb=int(record.get("memory_mb", 1024)),
        allow_site_packages=plus,
        preload=("numpy",) if plus else (),
        output_limit=HARNESS_OUTPUT_LIMIT if plus else OUTPUT_LIMIT,
    )
    if harness is not None:
        return 1.0 if code and code.strip() and harness_verdict(PREAMBLE + code, harness, limits) else 0.0
    return code_reward(
        response, cases, code=code or "", preamble=PREAMBLE, limits=limits, all_or_nothing=all_or_nothing
    )
