r"""The benchmark registry: per task, the fields read from a dataset row, the prompt, the reward and the extractor.

Every task turns a raw row into an evaluation record ``{"messages": [user turn], "answer" | "tests": ...}`` that
:func:`megadare.data.prompt_data.build_prompts` renders with the tokenizer's chat template (as RL prompts are) and
that the RL reward of the same name scores (:mod:`megadare.rewards`: one verifier for training and evaluation).

=========  ==========================================  =========================================  ===========
task       row fields (first present name wins)        gold / tests                               reward
=========  ==========================================  =========================================  ===========
gsm8k      question | problem                          answer (solution ending ``#### N``)        ``gsm8k``
math500    problem | question                          answer, else solution (its last box)       ``math``
aime24/25  problem | question | Problem                answer | Answer                           ``math``
humaneval  prompt, test, entry_point                   ``test`` + ``check(entry_point)``          ``code``
mbpp       prompt | text, test_list, test_imports |    imports / setup + the ``assert`` lines     ``code``
           test_setup_code
countdown  nums | numbers, target (or d1's input        the target; the numbers                    ``countdown``
           "30,100,93" + output)
sudoku     puzzle | Puzzle                             solution | Solution (16 digits)            ``sudoku``
=========  ==========================================  =========================================  ===========

Field names follow the public releases (openai/gsm8k, HuggingFaceH4/MATH-500, HuggingFaceH4/aime_2024,
AIME 2025 sets, openai_humaneval, MBPP full and sanitized, Countdown-Tasks-3to4, 4x4 sudoku CSVs). A row in the
verl / DARE schema (``prompt`` messages + ``reward_model.ground_truth``: DARE's ``data/preprocessed/rl/test``
files) is taken as it is, its prompt unchanged. A task may also be a file path (``--tasks
data/preprocessed/rl/test/mbpp_1.parquet``): its rows are DARE rows, scored by ``auto`` (per ``data_source``), and
the task is named after the file. Prompts of the built-in tasks (``eval.prompt_style`` for math):

* ``boxed``: ``"{problem}\nPlease reason step by step, and put your final answer within \boxed{}."``, the
  chain-of-thought prompt of dLLM-RL (TraDo / SDAR evaluation) and of OpenCompass' MATH 0-shot config that
  DARE uses for MATH / AIME;
* ``d1``: d1's (Zhao et al. 2025, arXiv:2504.12216) math system prompt asking for ``<reasoning>`` and an
  ``<answer>`` holding ``\boxed{}``, prepended to the question in the user turn as d1's evaluation does;
* code (both styles): dLLM-RL's function-style instruction "Place your code within a single Python code block";
  MBPP states its tests as in Austin et al. 2021 (arXiv:2108.07732);
* countdown and sudoku: DARE's prompts (``verl/utils/preprocess/preprocess_sudoku_countdown.py``), which ask for
  the expression / the 16-digit grid inside ``<answer></answer>``.

Extraction is the rewards' own: math takes :func:`~megadare.rewards.extract_answer` (last ``\boxed{}``, then
"answer is", then the last number), code :func:`~megadare.rewards.extract_code` (last ```` ```python ```` block;
MBPP rows of DARE: ``[BEGIN]``/``[DONE]``), countdown / sudoku the last ``<answer>``. A sample is correct when its
reward is 1.0 (code: every test passed; sudoku: every empty cell right).
"""

from __future__ import annotations

import difflib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megadare.config import CHOICES
from megadare.data.fields import is_verl_row
from megadare.data.files import DataError, load_rows, missing_file
from megadare.errors import ConfigError
from megadare.rewards import (
    auto_rule,
    extract_answer,
    extract_boxed,
    extract_code,
    gsm8k_gold,
    normalize_answer,
    program_extractor,
)
from megadare.rewards.planning import last_answer_tag

__all__ = [
    "TaskSpec",
    "TASKS",
    "PROMPT_STYLES",
    "task_spec",
    "file_task",
    "countdown_prompt",
    "SUDOKU_PROMPT",
    "MATH_BOXED_INSTRUCTION",
    "D1_MATH_SYSTEM_PROMPT",
    "CODE_BLOCK_INSTRUCTION",
]

# Through SDAR / TraDo's chat template this is dLLM-RL's TraDo / SDAR prompt (``sample/trado_rl_rollout.py``
# ``system_prompts``) token for token but the last: dLLM-RL renders its string with jinja2, which drops the
# template's trailing newline, so its prompts end "<|im_start|>assistant" without the "\n" its literal and the
# model's chat template put there. Kept: the newline is what both meant and what the publisher's template
# (the one every other prompt here goes through) renders (tests/test_dllm_rl_source.py).
MATH_BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
D1_MATH_SYSTEM_PROMPT = (
    "You are a math expert. You will be given a question to solve. Solve it step by step. "
    "Wrap the final answer in a \\boxed{}. \nRespond in the following format:\n<reasoning>\n"
    "Your reasoning here\n</reasoning>\n<answer>\n\\boxed{...}\n</answer>"
)
CODE_BLOCK_INSTRUCTION = (
    "Place your code within a single Python code block ```python ```. Do not include more than one code block."
)
PROMPT_STYLES = CHOICES["eval.prompt_style"]  # the one list: eval.prompt_style's Literal in the config
ID_FIELDS = ("task_id", "unique_id", "id", "ID", "idx")


def _field(raw: dict, names: tuple[str, ...], where: str, what: str) -> Any:
    """The value of the first of ``names`` present (and not null) in ``raw``; a DataError naming them otherwise."""
    for name in names:
        if raw.get(name) is not None:
            return raw[name]
    accepted = " | ".join(repr(n) for n in names)
    raise DataError(
        f"{where}: missing field {names[0]!r} ({what}; accepted names: {accepted}); found keys {sorted(raw)}"
    )


def _text(raw: dict, names: tuple[str, ...], where: str, what: str, numbers_ok: bool = False) -> str:
    """A non-empty string field (numbers accepted and turned into text when ``numbers_ok``, e.g. AIME answers)."""
    value = _field(raw, names, where, what)
    name = next(n for n in names if raw.get(n) is not None)
    if isinstance(value, float) and math.isnan(value):
        raise DataError(f"{where}: field {name!r} ({what}) is NaN (a missing value); fill it in or drop the row")
    if numbers_ok and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise DataError(f"{where}: field {name!r} ({what}) must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: field {name!r} ({what}) is empty")
    return value


def _str_list(raw: dict, name: str, where: str, what: str, required: bool) -> list[str]:
    """A list of strings (missing -> [] unless ``required``)."""
    if raw.get(name) is None and not required:
        return []
    value = _field(raw, (name,), where, what)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise DataError(f"{where}: field {name!r} ({what}) must be a list of strings")
    if required and not value:
        raise DataError(f"{where}: field {name!r} ({what}) is empty")
    return value


def _user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def _math_prompt(problem: str, style: str) -> str:
    if style == "d1":
        return f"{D1_MATH_SYSTEM_PROMPT}\n\n{problem}"
    return f"{problem}\n{MATH_BOXED_INSTRUCTION}"


def _gsm8k(raw: dict, where: str, style: str) -> dict:
    question = _text(raw, ("question", "problem"), where, "the word problem")
    answer = _text(raw, ("answer",), where, "the reference solution ending '#### N'", numbers_ok=True)
    try:
        gsm8k_gold(answer)
    except ValueError as e:
        raise DataError(f"{where}: field 'answer': {e}") from None
    return {"messages": _user(_math_prompt(question, style)), "answer": answer}


def _math500(raw: dict, where: str, style: str) -> dict:
    problem = _text(raw, ("problem", "question"), where, "the problem statement")
    answer = _text(
        raw, ("answer", "solution"), where, "the final answer (or a solution with \\boxed{})", numbers_ok=True
    )
    return {"messages": _user(_math_prompt(problem, style)), "answer": answer}


def _aime(raw: dict, where: str, style: str) -> dict:
    problem = _text(raw, ("problem", "question", "Problem"), where, "the problem statement")
    answer = _text(raw, ("answer", "Answer"), where, "the integer answer", numbers_ok=True)
    return {"messages": _user(_math_prompt(problem, style)), "answer": answer}


def _humaneval(raw: dict, where: str, style: str) -> dict:
    prompt = _text(raw, ("prompt",), where, "the function signature and docstring")
    test = _text(raw, ("test",), where, "the test code defining check(candidate)")
    entry = _text(raw, ("entry_point",), where, "the name of the function under test")
    return {"messages": _user(f"{prompt}\n{CODE_BLOCK_INSTRUCTION}"), "tests": f"{test}\n\ncheck({entry})\n"}


def _mbpp(raw: dict, where: str, style: str) -> dict:
    text = _text(raw, ("prompt", "text"), where, "the task description")
    asserts = _str_list(raw, "test_list", where, "the assert statements", required=True)
    imports = _str_list(raw, "test_imports", where, "imports the tests need", required=False)
    setup = raw.get("test_setup_code") or ""
    if not isinstance(setup, str):
        raise DataError(f"{where}: field 'test_setup_code' must be a string, got {type(setup).__name__}")
    shown = "\n".join(asserts)
    content = f"{text}\nYour code should pass these tests:\n\n{shown}\n{CODE_BLOCK_INSTRUCTION}"
    return {"messages": _user(content), "tests": "\n".join([*imports, setup, *asserts]).strip() + "\n"}


COUNTDOWN_FORMAT = "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>\n"
SUDOKU_PROMPT = (
    "Please solve the following 4x4 Sudoku puzzle. The puzzle is provided as a 16-character string reading "
    "left-to-right, top-to-bottom, where '0' represents empty cells.\n\nRules:\n- Fill empty cells with digits "
    "1-4\n- Each row must contain digits 1-4 exactly once\n- Each column must contain digits 1-4 exactly once\n- "
    "Each 2x2 box must contain digits 1-4 exactly once\n\nImportant: Your solution must be a COMPLETE 16-character "
    "string with only the digits 1-4, representing your final solved grid.\n\nRespond in this exact format:\n"
    "<reasoning>\nYour step-by-step solving process\n</reasoning>\n<answer>\n[16-character solution string with "
    "no spaces or separators]\n</answer>\n"
)


def countdown_prompt(numbers: list[int], target: int) -> str:
    """DARE's countdown question (preprocess_sudoku_countdown.py)."""
    return (
        f"{COUNTDOWN_FORMAT}\nUsing only the numbers {numbers}, create an arithmetic expression that evaluates "
        f"to exactly {target}. You must use all numbers from the list, and each number must be used exactly "
        "once. You may use the operations +, -, *, and / as needed. After reasoning, provide only your final "
        "expression inside <answer></answer> tags without including an equals sign or the target number. For "
        "example, if the numbers are [2, 3, 4] and the target is 5, a valid answer is: <answer>\n2*4-3\n</answer>"
    )


def _countdown(raw: dict, where: str, style: str) -> dict:
    if raw.get("input") is not None and raw.get("output") is not None and raw.get("target") is None:
        numbers, target = str(raw["input"]).split(","), raw["output"]  # d1's countdown_cd3_test.jsonl
    else:
        numbers, target = (
            _field(raw, ("nums", "numbers"), where, "the numbers"),
            _field(raw, ("target", "answer"), where, "the target"),
        )
    try:
        numbers = [int(str(n).strip()) for n in (json.loads(numbers) if isinstance(numbers, str) else numbers)]
        target = int(str(target).strip())
    except (TypeError, ValueError) as e:
        raise DataError(f"{where}: countdown numbers / target must be integers ({e})") from e
    return {"messages": _user(countdown_prompt(numbers, target)), "answer": str(target), "numbers": numbers}


def _sudoku(raw: dict, where: str, style: str) -> dict:
    puzzle = _text(raw, ("puzzle", "Puzzle"), where, "the 16-digit puzzle, 0 for empty cells")
    solution = _text(raw, ("solution", "Solution", "answer"), where, "the 16-digit solution")
    for name, grid in (("puzzle", puzzle), ("solution", solution)):
        if len(grid.strip()) != 16 or not grid.strip().isdigit():
            raise DataError(f"{where}: field {name!r} must be 16 digits (a 4x4 grid row by row), got {grid!r}")
    return {
        "messages": _user(f"{SUDOKU_PROMPT}\n\nSolve the following Sudoku puzzle: {puzzle.strip()}\n"),
        "answer": solution.strip(),
        "puzzle": puzzle.strip(),
    }


def _reference_answer(answer: str) -> str:
    """The final answer inside a gold field: a full solution's last box, else the text (as ``math_reward`` reads it)."""
    return (extract_boxed(answer) or answer) if "\\boxed" in answer or "\\fbox" in answer else answer


def _math_vote_key(extracted: Optional[str]) -> Optional[str]:
    """Answers that normalise to the same string (MATH ``strip_string`` rules) count as one vote."""
    key = normalize_answer(extracted) if extracted is not None else ""
    return key or None


@dataclass(frozen=True)
class TaskSpec:
    """One benchmark: ``build(row, where, style)`` -> evaluation record; ``reward`` names a built-in reward of
    :mod:`megadare.rewards`; ``extract(response)`` the answer shown in the per-sample JSONL, ``reference(gold)`` the
    gold answer shown beside it (None for code); ``vote_key`` maps an extracted answer to its majority-vote class
    (None: maj@k is not defined, as for code)."""

    name: str
    kind: str  # math | code | planning
    reward: str
    gold_field: str  # record field the reward checks
    build: Callable[[dict, str, str], dict]
    extract: Callable[[str], Optional[str]]
    reference: Optional[Callable[[str], str]]
    vote_key: Optional[Callable[[Optional[str]], Optional[str]]]
    path: Optional[str] = None  # a file task: its data file

    def record(self, raw: dict, where: str, style: str) -> dict:
        """The evaluation record of a dataset row (prompt messages, gold / tests, the row's id if it has one); a
        verl / DARE row is kept as it is (its prompt, its ``reward_model.ground_truth``)."""
        rec = dict(raw) if is_verl_row(raw) else self.build(raw, where, style)
        rec["problem_id"] = next((str(raw[k]) for k in ID_FIELDS if raw.get(k) is not None), None)
        if (
            rec["problem_id"] is None
            and isinstance(raw.get("extra_info"), dict)
            and raw["extra_info"].get("index") is not None
        ):
            rec["problem_id"] = str(raw["extra_info"]["index"])
        return rec


def _math_task(name: str, reward: str, build: Callable[[dict, str, str], dict]) -> TaskSpec:
    reference = gsm8k_gold if reward == "gsm8k" else _reference_answer
    return TaskSpec(name, "math", reward, "answer", build, extract_answer, reference, _math_vote_key)


def _code_task(name: str, build: Callable[[dict, str, str], dict], extract=extract_code) -> TaskSpec:
    return TaskSpec(name, "code", "code", "tests", build, extract, None, None)


def _planning_task(name: str, build: Callable[[dict, str, str], dict]) -> TaskSpec:
    return TaskSpec(name, "planning", name, "answer", build, last_answer_tag, str, None)


TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in (
        _math_task("gsm8k", "gsm8k", _gsm8k),
        _math_task("math500", "math", _math500),
        _math_task("aime24", "math", _aime),
        _math_task("aime25", "math", _aime),
        _code_task("humaneval", _humaneval),
        _code_task("mbpp", _mbpp),
        _planning_task("countdown", _countdown),
        _planning_task("sudoku", _sudoku),
    )
}


def _unbuildable(raw: dict, where: str, style: str) -> dict:
    raise DataError(
        f"{where}: a file task takes rows in the verl / DARE schema (prompt messages + "
        f"reward_model.ground_truth); found keys {sorted(raw)}"
    )


def file_task(path: str) -> TaskSpec:
    """The task of a DARE test file: named after the file, scored by ``auto``, shown by the rule of its first row."""
    rows = load_rows(path)
    if not rows:
        raise DataError(f"{path}: the file holds no rows")
    where, first = rows[0]
    if not is_verl_row(first):
        _unbuildable(first, where, "")
    source = str(first.get("data_source", "")).lower()
    try:
        rule = auto_rule(first)
    except ValueError as e:  # eval scores a file task by auto alone: rewards.name would not help here
        raise DataError(
            f"{where}: megadare eval scores a file task by its rows' data_source (rewards.name=auto; another "
            f"rewards.name does not apply to it) and has no rule for data_source={source!r}: give the rows one it "
            f"knows (gsm8k, math..., countdown, sudoku, a code source) or extra_info.task=math|code"
        ) from e
    name = os.path.splitext(os.path.basename(path))[0]
    if rule in ("math", "dare_math", "gsm8k"):
        return TaskSpec(
            name,
            "math",
            "auto",
            "answer",
            _unbuildable,
            extract_answer,
            gsm8k_gold if rule == "gsm8k" else _reference_answer,
            _math_vote_key,
            path,
        )
    if rule.startswith("code"):
        return TaskSpec(name, "code", "auto", "answer", _unbuildable, program_extractor(source), None, None, path)
    return TaskSpec(name, "planning", "auto", "answer", _unbuildable, last_answer_tag, str, None, path)


def task_spec(name: str, key: str = "eval.tasks") -> TaskSpec:
    """The registered task ``name``, or the file task of a data file path; a ConfigError naming ``key`` (the config
    key or the option, ``--tasks``, the user wrote) otherwise."""
    if name in TASKS:
        return TASKS[name]
    if str(name).lower().endswith((".jsonl", ".parquet")):
        if not os.path.isfile(name):
            raise DataError(missing_file(name, key))
        return file_task(str(name))
    close = difflib.get_close_matches(str(name), list(TASKS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(
        f"{key}: unknown task {name!r}{hint} (known: {', '.join(TASKS)}, or a .jsonl / .parquet file of DARE rows)"
    )
