"""dLLM-RL's code rows (Gen-Verse/dLLM-RL @10b4fd1, ``data/readme.md``) as test cases, scored as its
``reward/rl_execute.py`` + ``rl_code_reward.py`` score them.

===================  ============================================================================================
``test_method``      ``function``: ``test_list``, statements run after the program in turn in one namespace, one
                     case each; ``stdio``: ``test_input`` / ``test_output``, lists of the same length, one case per
                     pair
``test_time_limit``  seconds per case (dLLM-RL's default 1); a function row's statements get dLLM-RL's 2 s of slack
                     more, all together, as dLLM-RL gives them
===================  ============================================================================================

The score is the share of cases passed: dLLM-RL rewards the number of tests passed, z-scored in the group, which
gives the same advantages as the share (every response of a row has the same cases). A stdio program runs inside
dLLM-RL's ``worker_stdio`` (``_STDIO_WORKER``: ``input()`` without a prompt, a StringIO stdin, ``error: <message>``
for an exception) and its stdout is compared as dLLM-RL compares it (the whitespace-separated words equal: ``1 2``
passes for ``1\\n2``). A function row's case K runs the program, then every statement of the row in turn as its
``_run_many_pipe`` does, and passes when statement K ran without raising (``_FUNCTION_TESTS``): state carries, a
hang fails every case. What differs on purpose (tests/test_dllm_rl_code.py, test_dllm_rl_code_battery.py): a
program that exits before its asserts ran, or raises SystemExit inside one, fails them (dLLM-RL counts them as
passes: any program could score full marks); the sandbox's memory limit and interpreter (no site-packages); a row
whose statements do not compile, or hold no assert, is refused by name. The program is dLLM-RL's: the last closed
```` ```python ```` block (:func:`dllm_rl_extract_code`); a response without one scores 0, where megadare's own test
forms also run a ```` ```py ```` block, an unclosed fence or a bare program.
A function row's ``prefix`` (dLLM-RL appends it to the prompt) must be part of the prompt, as an assistant prefill
the response continues: the reward sees the prefill with the response.
"""

from __future__ import annotations

import ast
import re
from typing import List

from megadare.rewards.code import TestCase, code_reward, tested_builtins
from megadare.rewards.sandbox import SandboxLimits

__all__ = [
    "dllm_rl_extract_code",
    "dllm_rl_test_cases",
    "dllm_rl_stdio_program",
    "dllm_rl_code_reward",
    "FUNCTION_SLACK_S",
]

FUNCTION_SLACK_S = 2.0  # rl_execute.py _check_snippet_many's spawn_slack


_FENCE = re.compile(r"```python(.*?)```", re.DOTALL)  # its extract_code's pattern


def dllm_rl_extract_code(text: str) -> str:
    """dLLM-RL's ``extract_code``: the last match of its pattern, stripped; "" when there is none (a fence of its
    own closes a block, so no text makes the lazy scan quadratic)."""
    found = _FENCE.findall(text or "")
    return found[-1].strip() if found else ""


def _str_list(record: dict, key: str) -> list:
    value = record.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(
            f"dLLM-RL code row (test_method={record.get('test_method')!r}): {key!r} must be a list of strings, got "
            f"{type(value).__name__} ({value!r:.80})"
        )
    return value


# rl_execute.py's _run_many_pipe after the program, in the sandbox's test mode: every statement of test_list in turn
# in one namespace (state carries from one to the next; a statement without an assert passes when it runs), each a
# pass unless it raises; case K passes when statement K did. Each case runs the whole row, so a row that runs past
# its time limit fails every case, as dLLM-RL's does. A SystemExit fails the case (dLLM-RL passes it: any program
# could score full marks by raising it)
_FUNCTION_TESTS = """_dllm_rl_statements = %r
_dllm_rl_passed = False
for _dllm_rl_k, _dllm_rl_statement in enumerate(_dllm_rl_statements):
    try:
        exec(_dllm_rl_statement, globals())
        _dllm_rl_ok = True
    except Exception:
        _dllm_rl_ok = False
    if _dllm_rl_k == %d:
        _dllm_rl_passed = _dllm_rl_ok
assert _dllm_rl_passed, "dLLM-RL's test %d failed"
"""


def _function_cases(statements: List[str]) -> List[TestCase]:
    """A function row's cases (``_FUNCTION_TESTS``); ValueError when a statement does not compile (it would fail every
    program) or none holds an assert or a raise (every program would pass)."""
    if not statements:
        raise ValueError("dLLM-RL function row: test_list is empty; give its assert statements")
    for k, statement in enumerate(statements):
        try:
            ast.parse(statement)
        except SyntaxError as e:
            raise ValueError(f"dLLM-RL function row: test_list[{k}] does not compile (line {e.lineno}: {e.msg})") from e
    tree = ast.parse("\n".join(statements))
    if not any(isinstance(node, (ast.Assert, ast.Raise)) for node in ast.walk(tree)):
        raise ValueError(f"dLLM-RL function row: no test of test_list holds an assert or a raise ({statements!r:.120})")
    tested = tested_builtins(tree)
    guard = ""
    if tested:  # the function under test is named like a builtin: the program must define it (code._code_case)
        message = f"the program defines none of {', '.join(tested)}, the function under test"
        guard = f"assert {' or '.join(f'{n!r} in globals()' for n in tested)}, {message!r}\n"
    cases = [_FUNCTION_TESTS % (statements, k, k) for k in range(len(statements))]
    return [TestCase(test_code=guard + case, tested=tested) for case in cases]


def dllm_rl_test_cases(record: dict) -> List[TestCase]:
    """The cases of a dLLM-RL code row (module docstring); ValueError naming the field when it is malformed."""
    method = record.get("test_method")
    if method == "function":
        return _function_cases(_str_list(record, "test_list"))
    if method == "stdio":
        inputs, outputs = _str_list(record, "test_input"), _str_list(record, "test_output")
        if len(inputs) != len(outputs) or not inputs:
            raise ValueError(
                f"dLLM-RL stdio row: test_input has {len(inputs)} cases and test_output {len(outputs)}; give the "
                "same non-zero number"
            )
        return [TestCase(stdin=i, expected=o, compare="tokens") for i, o in zip(inputs, outputs)]
    raise ValueError(f"dLLM-RL code row: test_method is {method!r}; dLLM-RL's rows say 'function' or 'stdio'")


# rl_execute.py's worker_stdio, run in the sandbox around the program: ``input()`` reads the lines of the case's input
# (no prompt echoed, EOFError past them), ``sys.stdin`` is a StringIO of it (no ``.buffer``), fd 0 is empty (its
# multiprocessing child's stdin is /dev/null), ``sys.argv`` is its command line (a spawned child inherits it: fileinput
# reads no stdin), the program runs as ``__main__`` without ``__file__``, and its stdout
# is captured: what it printed when it ended or raised SystemExit, ``error: <message>`` when it raised an exception,
# nothing when it left by os._exit
_STDIO_WORKER = """import io as _io, os as _os, sys as _sys
_data = _sys.stdin.read()
_lines = iter(_data.splitlines())
def _input(prompt=""):
    try:
        return next(_lines)
    except StopIteration:
        raise EOFError("No more input")
_empty, _w = _os.pipe()
_os.close(_w)
_os.dup2(_empty, 0)
_real, _capture = _sys.stdout, _io.StringIO()
_sys.stdout, _sys.stdin = _capture, _io.StringIO(_data)
_sys.argv = ["rl_execute.py", "config=rl.yaml"]
try:
    exec(compile(%r, "<string>", "exec"), {"__name__": "__main__", "input": _input})
    _out = _capture.getvalue()
except SystemExit:
    _out = _capture.getvalue()
except Exception as _e:
    _out = f"error: {_e}"
finally:
    _sys.stdout = _real
_sys.stdout.write(_out)
"""


def dllm_rl_stdio_program(code: str) -> str:
    """``code`` inside dLLM-RL's stdio worker (``_STDIO_WORKER``), as the sandbox runs it for a stdio case."""
    return _STDIO_WORKER % code


def dllm_rl_code_reward(response: str, record: dict, all_or_nothing: bool = False) -> float:
    """The share of the row's cases the program in ``response`` passes (``all_or_nothing``: 1.0 only when all do)."""
    cases = dllm_rl_test_cases(record)
    limit = float(record.get("timeout_s", record.get("test_time_limit", 1)))
    if record["test_method"] == "function":
        limit += FUNCTION_SLACK_S
    limits = SandboxLimits(timeout_s=limit, memory_mb=int(record.get("memory_mb", 512)))
    code = dllm_rl_extract_code(response)
    if code and record["test_method"] == "stdio":
        code = dllm_rl_stdio_program(code)
    return code_reward(response, cases, code=code, limits=limits, all_or_nothing=all_or_nothing)
