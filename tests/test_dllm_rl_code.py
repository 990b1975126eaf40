"""megadare's code reward on dLLM-RL's code rows against dLLM-RL's own (Gen-Verse/dLLM-RL @10b4fd1): its rollout's
``extract_code`` (``sample/trado_rl_rollout.py``), ``reward/rl_execute.py`` (``evaluate_function_dataset``: the
``test_list`` asserts one after the other in one spawned process, ``test_time_limit`` + 2 s for all; ``evaluate_stdio_
dataset``: one process per ``test_input``, its stdout compared by ``test_if_eq``) and ``reward/rl_code_reward.py``
(the number of tests passed, z-scored per group: the same advantages as the share passed, every response of a row
having the same tests). The ``theirs`` column was recorded by tests/dllm_rl_source.py's ``code_shares`` (stdio
workers forked: a spawned one re-imports numpy / omegaconf inside its 1 s, which on a loaded machine times out every
case); with ``DLLM_RL_SRC`` set ``test_live_*`` reruns it, else it is skipped, saying so.

Findings: before this change a dLLM-RL code row (``test_method``, ``test_list`` | ``test_input`` / ``test_output``)
could not be scored (``code``: KeyError 'answer' from DARE's forms; ``auto``: exact match); megadare's own stdin
rule also failed ``1 2`` for ``1\\n2``, and a ``sys.exit(1)`` after the right output, which dLLM-RL passes. Differs
on purpose (ON_PURPOSE): exiting before the asserts ran, or inside one, fails them (dLLM-RL scores a bare ``exit()``
full marks). Each case used to run in its own sandbox with its own assert only (one hanging assert failed only
itself, no state carried); it now runs the row's asserts in turn as dLLM-RL does (tests/test_dllm_rl_code_battery.py).
"""

from __future__ import annotations

import random
import re

import pytest

import dllm_rl_source as D
from megadare.rewards import score_batch
from megadare.rewards.dllm_rl_code import dllm_rl_extract_code, dllm_rl_test_cases
from megadare.rewards.registry import auto_rule

F = "```"


def blk(code: str, tag: str = "python") -> str:
    return f"Here is my solution.\n{F}{tag}\n{code}\n{F}\nDone."


ADD = "def add(a, b):\n    return a + b"
T3 = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == 0"]
SUM_IN, SUM_OUT = ["1 2\n", "3 4\n", "10 -3\n"], ["3\n", "7\n", "7\n"]
# (class, test_method, response, tests (asserts | (inputs, outputs)), dLLM-RL's share passed, megadare's)
BATTERY = [
    ("pass", "function", blk(ADD), T3, 1, 1),
    ("partial", "function", blk("def add(a, b):\n    return a + b if a else 99"), T3, 2 / 3, 2 / 3),
    ("partial", "function", blk("def add(a, b):\n    return 3"), T3, 1 / 3, 1 / 3),
    ("exception", "function", blk("def add(a, b):\n    raise ValueError('x')"), T3, 0, 0),
    ("exception", "function", blk("def add(a, b):\n    return a + b\nraise RuntimeError('top level')"), T3, 0, 0),
    ("exception", "function", blk("def add(a, b):\n    return 1 / a + b - 1 / a"), T3, 0, 0),
    ("syntax", "function", blk("def add(a, b)\n    return a + b"), T3, 0, 0),
    ("timeout", "function", blk("def add(a, b):\n    while True:\n        pass"), T3, 0, 0),
    (
        "timeout",
        "function",
        blk("def add(a, b):\n    if a == 0:\n        while True:\n            pass\n    return a + b"),
        T3,
        0,
        0,
    ),
    ("print_vs_return", "function", blk("def add(a, b):\n    print(a + b)"), T3, 0, 0),
    ("exit", "function", blk("import sys\nsys.exit(0)"), T3, 1, 0),
    ("exit", "function", blk("def add(a, b):\n    raise SystemExit(0)"), T3, 1, 0),
    ("exit", "function", blk("exit()"), T3, 1, 0),
    ("extract", "function", ADD, T3, 0, 0),
    ("extract", "function", blk(ADD, tag="py"), T3, 0, 0),
    ("extract", "function", blk(ADD, tag="python3"), T3, 1, 1),
    ("extract", "function", blk("def add(a, b):\n    return 0") + "\n" + blk(ADD), T3, 1, 1),
    ("extract", "function", blk(ADD) + "\n" + blk("def add(a, b):\n    return 0", tag=""), T3, 1, 1),
    ("extract", "function", f"{F}python\n{ADD}\n", T3, 0, 0),
    (
        "state",
        "function",
        blk("calls = []\ndef add(a, b):\n    calls.append(1)\n    return a + b if len(calls) < 2 else 0"),
        T3,
        2 / 3,
        2 / 3,
    ),
    ("pass", "stdio", blk("a, b = map(int, input().split())\nprint(a + b)"), (SUM_IN, SUM_OUT), 1, 1),
    (
        "partial",
        "stdio",
        blk("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)"),
        (SUM_IN, SUM_OUT),
        2 / 3,
        2 / 3,
    ),
    (
        "exception",
        "stdio",
        blk("a, b = map(int, input().split())\nprint(a + b)\nraise ValueError"),
        (SUM_IN, SUM_OUT),
        0,
        0,
    ),
    (
        "exception",
        "stdio",
        blk("a, b = map(int, input().split())\nprint(a // (b - 4) * 0 + a + b)"),
        (SUM_IN, SUM_OUT),
        2 / 3,
        2 / 3,
    ),
    (
        "timeout",
        "stdio",
        blk("a, b = map(int, input().split())\nwhile a == 3:\n    pass\nprint(a + b)"),
        (SUM_IN, SUM_OUT),
        2 / 3,
        2 / 3,
    ),
    (
        "exit",
        "stdio",
        blk("import sys\na, b = map(int, input().split())\nprint(a + b)\nsys.exit(1)"),
        (SUM_IN, SUM_OUT),
        1,
        1,
    ),
    (
        "exit",
        "stdio",
        blk("import sys\na, b = map(int, input().split())\nprint(a + b)\nsys.exit(0)"),
        (SUM_IN, SUM_OUT),
        1,
        1,
    ),
    (
        "whitespace",
        "stdio",
        blk("a, b = map(int, input().split())\nprint(a + b, end='   \\n\\n')"),
        (SUM_IN, SUM_OUT),
        1,
        1,
    ),
    ("whitespace", "stdio", blk("print(1, 2)"), (["\n"], ["1\n2\n"]), 1, 1),
    ("whitespace", "stdio", blk("print('1  2')"), (["\n"], ["1 2\n"]), 1, 1),
    ("numbers", "stdio", blk("print(7.0)"), (["\n"], ["7\n"]), 0, 0),
    (
        "print_vs_return",
        "stdio",
        blk("def main():\n    a, b = map(int, input().split())\n    return a + b\nmain()"),
        (SUM_IN, SUM_OUT),
        0,
        0,
    ),
    (
        "stdin",
        "stdio",
        blk("import sys\nd = sys.stdin.read().split()\nprint(int(d[0]) + int(d[1]))"),
        (SUM_IN, SUM_OUT),
        1,
        1,
    ),
    ("stdin", "stdio", blk("a = int(input())\nb = int(input())\nprint(a + b)"), (["1\n2\n"], ["3\n"]), 1, 1),
    (
        "main_guard",
        "stdio",
        blk(
            "def main():\n    a, b = map(int, input().split())\n    print(a + b)\nif __name__ == '__main__':\n    main()"
        ),
        (SUM_IN, SUM_OUT),
        1,
        1,
    ),
    ("extract", "stdio", "print(3)", (["\n"], ["3\n"]), 0, 0),
]
ON_PURPOSE = {
    10: "sys.exit(0) before the asserts: dLLM-RL passes all",
    11: "SystemExit raised inside each assert: dLLM-RL passes all",
    12: "exit() at the top level: dLLM-RL passes all",
}


def row(method: str, tests) -> dict:
    """A dLLM-RL code row (its data/readme.md), the gold field megadare's prompt reader wants set to anything."""
    if method == "function":
        return {"question": "q", "test_method": "function", "test_list": tests, "test_time_limit": 1, "answer": "-"}
    inputs, outputs = tests
    return {"question": "q", "test_method": "stdio", "test_input": inputs, "test_output": outputs,
            "test_time_limit": 1, "answer": "-"}  # fmt: skip


def test_dllm_rl_code_rows_score_as_dllm_rl_but_on_purpose():
    """``auto`` (the ``code`` rule) on each row gives dLLM-RL's share of tests passed, but where ON_PURPOSE says."""
    got, stats = score_batch("auto", [r for _, _, r, _, _, _ in BATTERY], [row(m, t) for _, m, _, t, _, _ in BATTERY],
                             workers=2, timeout_s=300)  # fmt: skip
    assert stats.failures == 0, stats.failed
    assert got == pytest.approx([ours for *_, ours in BATTERY])
    differ = {i for i, (*_, theirs, ours) in enumerate(BATTERY) if theirs != pytest.approx(ours)}
    assert differ == set(ON_PURPOSE)


def test_auto_gives_dllm_rl_code_rows_the_partial_credit_rule():
    assert auto_rule(row("stdio", (["1"], ["1"]))) == "code"
    assert auto_rule(row("function", ["assert f()"])) == "code"


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"test_method": "stdin"}, "test_method is 'stdin'"),
        ({"test_method": "function", "test_list": "assert f()"}, "'test_list' must be a list of strings"),
        ({"test_method": "stdio", "test_input": ["1"], "test_output": []}, "test_input has 1 cases and test_output 0"),
        ({"test_method": "stdio", "test_input": [1], "test_output": ["1"]}, "'test_input' must be a list of strings"),
    ],
)
def test_malformed_dllm_rl_rows_fail_naming_the_field(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        dllm_rl_test_cases(bad)


def test_dllm_rl_extract_code_is_its_regex():
    """dLLM-RL's extract_code is ``re.findall(r"```python(.*?)```", text, re.DOTALL)[-1].strip()`` (a fixed
    definition, checked here on random fence soups): a ```` ```python3 ```` block is read with its "3"."""
    rng = random.Random(0)
    parts = [F + "python", F, F + "py", "\n", "x = 1", F + "python3", " ", "``", "`"]
    for _ in range(5000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 10)))
        found = re.findall(r"```python(.*?)```", text, re.DOTALL)
        assert dllm_rl_extract_code(text) == (found[-1].strip() if found else ""), text
    assert dllm_rl_extract_code(blk("x = 1", tag="python3")) == "3\nx = 1"


def test_live_code_battery_is_dllm_rls():
    """dLLM-RL's reward gives the recorded ``theirs`` column."""
    shares = D.code_shares([(r, row(m, t)) for _, m, r, t, _, _ in BATTERY])
    assert shares == pytest.approx([theirs for *_, theirs, _ in BATTERY])


def test_dllm_rl_rows_load_and_score_with_no_key_overrides(tmp_path):
    """dLLM-RL's rows ({question, ground_truth_answer} for math, {question, test_method, ...} for code) needed
    data.prompt_key and rewards.answer_key pointed at its fields (for code rows: at a field the reward never reads);
    with the default keys they load as DARE's rows do, and ``auto`` scores each by dLLM-RL's rule."""
    import json

    from megadare.config import load_config
    from megadare.data.prompt_data import load_rl_prompts
    from megadare.data.tokenizer import ByteTokenizer

    rows = [
        {"question": "What is 2 + 3?", "ground_truth_answer": "5"},
        dict(row("function", ["assert f() == 1"]), question="Write f returning 1."),
    ]
    for r in rows:
        r.pop("answer", None)
    path = tmp_path / "dllm_rl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [f"data.path={path}", f"data.eval_path={path}"])
    train, held = load_rl_prompts(cfg, ByteTokenizer())
    assert len(train) == len(held) == 2
    assert [auto_rule(p.record) for p in train] == ["dllm_rl_math", "code"]
    responses = [r"so \boxed{5}", "```python\ndef f():\n    return 1\n```"]
    got, stats = score_batch("auto", responses, [p.record for p in train], workers=1, timeout_s=120)
    assert stats.failures == 0, stats.failed
    assert got == [1.0, 1.0]
