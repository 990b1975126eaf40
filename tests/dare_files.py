"""Small files in DARE's schemas (written here, following verl/utils/preprocess/*.py of DARE @83ae8a3; no DARE data
is copied): RL rows, SFT rows and preference rows, as parquet with the nested structs DARE's files have."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq


def rl_row(source: str, prompt, gold: str, index: int, task: str = "math", **extra) -> dict:
    msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    return {
        "data_source": source,
        "prompt": msgs,
        "reward_model": {"ground_truth": gold, "style": "rule"},
        "extra_info": {"index": index, "split": "train", "task": task, **extra},
    }


def math_rows(n: int = 3) -> list[dict]:
    return [rl_row("math", f"What is {i} + {i + 2}?", str(2 * i + 2), i) for i in range(n)]


def countdown_rows(n: int = 3) -> list[dict]:
    return [
        rl_row(
            "countdown",
            f"Use [{i + 1}, {i + 3}] to make {2 * i + 4}. Answer in <answer></answer>.",
            str(2 * i + 4),
            i,
            numbers=json.dumps([i + 1, i + 3]),
        )
        for i in range(n)
    ]


def sudoku_rows() -> list[dict]:
    return [
        rl_row(
            "sudoku", "Solve 1030041020004301 in <answer></answer>.", "1234341221434321", 0, puzzle="1030041020004301"
        )
    ]


MBPP_PREFILL = [
    {"role": "user", "content": "Write add(a, b). Tests:\nassert add(1, 2) == 3"},
    {"role": "assistant", "content": "[BEGIN]\n"},
]


def mbpp_rows() -> list[dict]:
    return [
        rl_row("mbpp", MBPP_PREFILL, json.dumps(["assert add(1, 2) == 3", "assert add(2, 2) == 4"]), 0, task="code")
    ]


def _mbpp_turn(task: str, tests: list[str]) -> dict:
    """The user turn of DARE's MBPP prompt (verl/utils/preprocess/preprocess.py, process_single_example)."""
    shown = "\n".join(tests)
    return {
        "role": "user",
        "content": f"You are an expert Python programmer, and here is your task: {task} Your code should pass "
        f"these tests:\n\n {shown}  \n",
    }


# three solved examples in DARE's few-shot layout: tests after " \n", programs quoted between [BEGIN] and [DONE] with
# CRLF line ends and trailing spaces (the tasks and programs are written here, not DARE's)
MBPP_SHOTS = [
    ("Write a function to count the vowels in a string.", ["assert count_vowels('banana') == 3 "]),
    ("Write a python function to reverse a list in place.", ["assert flip([1, 2]) == [2, 1] "]),
    ("Write a function to find the longest word.", ["assert longest(['a', 'abc', 'ab']) == 'abc' "]),
]
MBPP_PROGRAMS = [
    "def count_vowels(s):\r\n  return sum(ch in 'aeiou' for ch in s)",
    "def flip(xs):\r\n    xs.reverse()\r\n    return xs",
    "def longest(words):\r\n  return max(words, key=len)",
]


def mbpp_fewshot_row(index: int = 0) -> dict:
    """An MBPP row in the shape DARE's preprocess.py writes: 3 few-shot user / assistant pairs, the task, and an
    assistant message "[BEGIN]\\n" at the end."""
    shots = []
    for (task, tests), program in zip(MBPP_SHOTS, MBPP_PROGRAMS):
        shots += [_mbpp_turn(task, tests), {"role": "assistant", "content": f"[BEGIN]\n '{program}' \n[DONE] \n\n "}]
    tests = ["assert twice(2) == 4", "assert twice(-1) == -2"]
    messages = shots + [_mbpp_turn("Write a function to double a number.", tests)]
    messages.append({"role": "assistant", "content": "[BEGIN]\n"})
    return rl_row("mbpp", messages, json.dumps(tests), index, task="code")


def sft_rows(n: int = 3) -> list[dict]:
    out = []
    for i in range(n):
        q = f"Tom has {i} apples and buys 2. How many?"
        out.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [
                    {
                        "role": "user",
                        "content": q + ' Let\'s think step by step and output the final answer after "####".',
                    }
                ],
                "ability": "math",
                "reward_model": {"ground_truth": str(i + 2), "style": "rule"},
                "extra_info": {
                    "answer": f"{i} + 2 = {i + 2}.\n#### {i + 2}",
                    "index": i,
                    "question": q,
                    "split": "train",
                },
            }
        )
    return out


def preference_rows(n: int = 2) -> list[dict]:
    return [
        {
            "data_source": "ultrafeedback",
            "prompt": [{"role": "user", "content": f"Say hi {i}"}],
            "chosen": [{"role": "assistant", "content": f"Hi {i}!"}],
            "rejected": [{"role": "assistant", "content": "no"}],
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(n)
    ]


def write_parquet(path, rows: list[dict]) -> str:
    os.makedirs(os.path.dirname(str(path)) or ".", exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


# Text in the scripts and symbols DARE's files hold (curly quotes and dashes in GSM8K / MBPP, unicode math in MATH and
# AIME, arrows and inequality signs in HumanEval docstrings), plus CJK and an emoji: written here, not copied.
UNICODE_QUESTIONS = [
    "Janet’s hens lay 16 eggs a day; she sells each for €2. How many euros does she make?",
    "Let f(x) = √(x² + 1). Compute ∑_{k=1}^{3} f(k)² – is it ≤ 6π?",
    "A function maps “abc” ➞ “cba”. How many characters does it return for “abcde” (0 ≤ n ≤ 10⁶)?",
    "小明有 3 个苹果，又买了 2 个。他现在有几个苹果？🍎",
]


def unicode_rl_rows() -> list[dict]:
    golds = ["32", "17", "5", "5"]
    return [
        rl_row("openai/gsm8k", q + ' Let\'s think step by step and output the final answer after "####".', g, i)
        for i, (q, g) in enumerate(zip(UNICODE_QUESTIONS, golds))
    ]


def unicode_sft_rows() -> list[dict]:
    answers = [
        "16 × 2 = 32 €.\n#### 32",
        "f(k)² = k² + 1, so ∑ = 2 + 5 + 10 = 17 ≤ 6π ≈ 18.85.\n#### 17",
        "It keeps every character: “edcba” has 5.\n#### 5",
        "3 + 2 = 5（个）。\n#### 5",
    ]
    rows = sft_rows(len(UNICODE_QUESTIONS))
    for row, q, a in zip(rows, UNICODE_QUESTIONS, answers):
        row["prompt"][0]["content"] = q + ' Let\'s think step by step and output the final answer after "####".'
        row["extra_info"].update(question=q, answer=a)
        row["reward_model"]["ground_truth"] = a.rsplit("#### ", 1)[1]
    return rows
