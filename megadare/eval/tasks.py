"""The benchmark registry: per task, the fields read from a dataset row, the prompt, the reward and the extractor.

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
=========  ==========================================  =========================================  ===========

Field names follow the public releases (openai/gsm8k, HuggingFaceH4/MATH-500, HuggingFaceH4/aime_2024,
AIME 2025 sets, openai_humaneval, MBPP full and sanitized). Prompts (``eval.prompt_style`` for math):

* ``boxed``: ``"{problem}\\nPlease reason step by step, and put your final answer within \\boxed{}."``, the
  chain-of-thought prompt of dLLM-RL (TraDo / SDAR evaluation) and of OpenCompass' MATH 0-shot config that
  DARE uses for MATH / AIME;
* ``d1``: d1's (Zhao et al. 2025, arXiv:2504.12216) math system prompt asking for ``<reasoning>`` and an
  ``<answer>`` holding ``\\boxed{}``, prepended to the question in the user turn as d1's evaluation does;
* code (both styles): dLLM-RL's function-style instruction "Place your code within a single Python code block";
  MBPP states its tests as in Austin et al. 2021 (arXiv:2108.07732).

Extraction is the rewards' own: math takes :func:`~megadare.rewards.extract_answer` (last ``\\boxed{}``, then
"answer is", then the last number), code :func:`~megadare.rewards.extract_code` (last ```` ```python ```` block).
A code sample is correct when the program passes every test (the tests form one case, so the reward is 0 or 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from megadare.data.sft_data import DataError
from megadare.rewards import extract_answer, extract_boxed, extract_code, gsm8k_gold, normalize_answer

__all__ = ["TaskSpec", "TASKS", "PROMPT_STYLES", "task_spec", "MATH_BOXED_INSTRUCTION", "D1_MATH_SYSTEM_PROMPT",
           "CODE_BLOCK_INSTRUCTION"]

MATH_BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
D1_MATH_SYSTEM_PROMPT = ("You are a math expert. You will be given a question to solve. Solve it step by step. "
                         "Wrap the final answer in a \\boxed{}. \nRespond in the following format:\n<reasoning>\n"
                         "Your reasoning here\n</reasoning>\n<answer>\n\\boxed{...}\n</answer>")
CODE_BLOCK_INSTRUCTION = ("Place your code within a single Python code block ```python ```. "
                          "Do not include more than one code block.")
PROMPT_STYLES = ("boxed", "d1")
ID_FIELDS = ("task_id", "unique_id", "id", "ID", "idx")


def _field(raw: dict, names: tuple[str, ...], where: str, what: str) -> Any:
    """The value of the first of ``names`` present (and not null) in ``raw``; a DataError naming them otherwise."""
    for name in names:
        if raw.get(name) is not None:
            return raw[name]
    accepted = " | ".join(repr(n) for n in names)
    raise DataError(f"{where}: missing field {names[0]!r} ({what}; accepted names: {accepted}); "
                    f"found keys {sorted(raw)}")


def _text(raw: dict, names: tuple[str, ...], where: str, what: str, numbers_ok: bool = False) -> str:
    """A non-empty string field (numbers accepted and turned into text when ``numbers_ok``, e.g. AIME answers)."""
    value = _field(raw, names, where, what)
    name = next(n for n in names if raw.get(n) is not None)
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
    return {"messages": _user(_math_prompt(question, style)), "answer": answer}


def _math500(raw: dict, where: str, style: str) -> dict:
    problem = _text(raw, ("problem", "question"), where, "the problem statement")
    answer = _text(raw, ("answer", "solution"), where, "the final answer (or a solution with \\boxed{})",
                   numbers_ok=True)
    return {"messages": _user(_math_prompt(problem, style)), "answer": answer}


def _aime(raw: dict, where: str, style: str) -> dict:
    problem = _text(raw, ("problem", "question", "Problem"), where, "the problem statement")
    answer = _text(raw, ("answer", "Answer"), where, "the integer answer", numbers_ok=True)
    return {"messages": _user(_math_prompt(problem, style)), "answer": answer}


def _humaneval(raw: dict, where: str, style: str) -> dict:
    prompt = _text(raw, ("prompt",), where, "the function signature and docstring")
    test = _text(raw, ("test",), where, "the test code defining check(candidate)")
    entry = _text(raw, ("entry_point",), where, "the name of the function under test")
    return {"messages": _user(f"{prompt}\n{CODE_BLOCK_INSTRUCTION}"),
            "tests": f"{test}\n\ncheck({entry})\n"}


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
    kind: str                                                   # math | code
    reward: str
    gold_field: str                                             # record field the reward checks
    build: Callable[[dict, str, str], dict]
    extract: Callable[[str], Optional[str]]
    reference: Optional[Callable[[str], str]]
    vote_key: Optional[Callable[[Optional[str]], Optional[str]]]

    def record(self, raw: dict, where: str, style: str) -> dict:
        """The evaluation record of a dataset row (prompt messages, gold / tests, the row's id if it has one)."""
        rec = self.build(raw, where, style)
        rec["problem_id"] = next((str(raw[k]) for k in ID_FIELDS if raw.get(k) is not None), None)
        return rec


def _math_task(name: str, reward: str, build: Callable[[dict, str, str], dict]) -> TaskSpec:
    reference = gsm8k_gold if reward == "gsm8k" else _reference_answer
    return TaskSpec(name, "math", reward, "answer", build, extract_answer, reference, _math_vote_key)


def _code_task(name: str, build: Callable[[dict, str, str], dict]) -> TaskSpec:
    return TaskSpec(name, "code", "code", "tests", build, extract_code, None, None)


TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    _math_task("gsm8k", "gsm8k", _gsm8k),
    _math_task("math500", "math", _math500),
    _math_task("aime24", "math", _aime),
    _math_task("aime25", "math", _aime),
    _code_task("humaneval", _humaneval),
    _code_task("mbpp", _mbpp),
)}


def task_spec(name: str) -> TaskSpec:
    """The registered task ``name``; a ConfigError naming ``eval.tasks`` otherwise."""
    import difflib

    from megadare.errors import ConfigError

    if name not in TASKS:
        close = difflib.get_close_matches(str(name), list(TASKS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"eval.tasks: unknown task {name!r}{hint} (known: {', '.join(TASKS)})")
    return TASKS[name]
