"""dLLM-RL's code rows (Gen-Verse/dLLM-RL @10b4fd1, ``data/readme.md``) as test cases, scored as its
``reward/rl_execute.py`` + ``rl_code_reward.py`` score them.

===================  ============================================================================================
``test_method``      ``function``: ``test_list``, ``assert`` statements run after the program, one case each;
                     ``stdio``: ``test_input`` / ``test_output``, lists of the same length, one case per pair
``test_time_limit``  seconds per case (dLLM-RL's default 1); a function row's cases get dLLM-RL's 2 s of slack
                     more, each (dLLM-RL gives them to all of the row's asserts together)
===================  ============================================================================================

The score is the share of cases passed: dLLM-RL rewards the number of tests passed, z-scored in the group, which
gives the same advantages as the share (every response of a row has the same cases). Stdout is compared as
dLLM-RL compares it (the whitespace-separated words equal: ``1 2`` passes for ``1\\n2``), and a program that ends by
its own ``SystemExit`` is judged on what it printed. What differs on purpose (tests/test_dllm_rl_code.py): each case
runs in its own sandbox (dLLM-RL runs a function row's asserts one after the other in one process, so a hang in one
fails them all and state carries from one to the next), and a program that exits before its asserts ran fails them
(dLLM-RL counts ``exit()`` at the top level, or ``SystemExit`` raised in a test, as passes: any program could score
full marks). The program is dLLM-RL's: the last closed ```` ```python ```` block (:func:`dllm_rl_extract_code`);
a response without one scores 0, where megadare's own test forms also run a ```` ```py ```` block, an unclosed
fence or a bare program.
A function row's ``prefix`` (dLLM-RL appends it to the prompt) must be part of the prompt, as an assistant prefill
the response continues: the reward sees the prefill with the response.
"""

from __future__ import annotations

import re
from typing import List

from megadare.rewards.code import TestCase, code_reward, parse_tests
from megadare.rewards.sandbox import SandboxLimits

__all__ = ["dllm_rl_extract_code", "dllm_rl_test_cases", "dllm_rl_code_reward", "FUNCTION_SLACK_S"]

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


def dllm_rl_test_cases(record: dict) -> List[TestCase]:
    """The cases of a dLLM-RL code row (module docstring); ValueError naming the field when it is malformed."""
    method = record.get("test_method")
    if method == "function":
        return parse_tests(_str_list(record, "test_list"))
    if method == "stdio":
        inputs, outputs = _str_list(record, "test_input"), _str_list(record, "test_output")
        if len(inputs) != len(outputs) or not inputs:
            raise ValueError(
                f"dLLM-RL stdio row: test_input has {len(inputs)} cases and test_output {len(outputs)}; give the "
                "same non-zero number"
            )
        return [TestCase(stdin=i, expected=o, compare="tokens") for i, o in zip(inputs, outputs)]
    raise ValueError(f"dLLM-RL code row: test_method is {method!r}; dLLM-RL's rows say 'function' or 'stdio'")


def dllm_rl_code_reward(response: str, record: dict, all_or_nothing: bool = False) -> float:
    """The share of the row's cases the program in ``response`` passes (``all_or_nothing``: 1.0 only when all do)."""
    cases = dllm_rl_test_cases(record)
    limit = float(record.get("timeout_s", record.get("test_time_limit", 1)))
    if record["test_method"] == "function":
        limit += FUNCTION_SLACK_S
    limits = SandboxLimits(timeout_s=limit, memory_mb=int(record.get("memory_mb", 512)))
    code = dllm_rl_extract_code(response)
    return code_reward(response, cases, code=code, limits=limits, all_or_nothing=all_or_nothing)
