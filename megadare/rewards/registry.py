"""Reward functions by name, the per-row ``auto`` rule, and weighted combinations.

A reward function is ``RewardFn = Callable[[str, dict], float]``: the response text (an assistant prefill of the
prompt included) and the sample record (the dataset row, with its gold answer under ``answer`` whatever
``rewards.answer_key`` named it; ``tests`` for megadare's code rows). Built-ins:

=========================  ================================================================================
``math``                   ``answer`` vs :func:`extract_answer` of the response (:func:`math_reward`)
``gsm8k``                  the same with the gold taken after ``####`` (:func:`gsm8k_gold`)
``dare_math``              DARE's ``math_rm``: the last ``\\boxed{}`` only, DARE's MATH / sympy grader
                           (:func:`dare_math_reward`)
``dllm_rl_math``           dLLM-RL's ``is_equal``: the last ``\\boxed{}`` only, its MATH / Minerva strings, then
                           its sympy stage where antlr4 4.11 runs it (:func:`dllm_rl_math_reward`)
``exact_match``            stripped response == stripped ``answer``
``countdown``              DARE's rule on target ``answer`` and ``numbers`` (:func:`countdown_reward`)
``sudoku``                 DARE's rule on solution ``answer`` and ``puzzle`` (:func:`sudoku_reward`)
``code``                   fraction of ``tests`` passed (:func:`code_reward`), of a dLLM-RL row's tests
                           (``test_method``: :mod:`.dllm_rl_code`), or of DARE's test form of the row's
                           ``answer`` by ``data_source`` (:mod:`.code_forms`)
``code_all_or_nothing``    the same, 1.0 only when every test passes (DARE's rule)
``boxed_format``           :func:`boxed_format_reward`
``think_answer_format``    :func:`think_answer_format_reward`
``auto``                   per row, by ``data_source`` / ``extra_info.task`` (:func:`auto_rule`)
=========================  ================================================================================

``numbers`` / ``puzzle`` are read from the record or its ``extra_info`` (where DARE keeps them).
``load_reward(spec)`` takes a built-in name or an import path ``"pkg.module:function"``; ``combine`` builds a
weighted sum (e.g. DiffuCoder's ``[("code", 2.0), ("boxed_format", 0.5)]``-style code + format reward).
"""

from __future__ import annotations

import difflib
import importlib
import json
import math
import platform
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from megadare.rewards.code import code_reward
from megadare.rewards.code_forms import CODE_SOURCES, dare_code_reward
from megadare.rewards.sandbox import SandboxLimits
from megadare.rewards.sandbox_kernel import seccomp_denies_processes
from megadare.rewards.format import boxed_format_reward, think_answer_format_reward
from megadare.rewards.dare_math import dare_gold
from megadare.rewards.dllm_rl_code import dllm_rl_code_reward
from megadare.rewards.dllm_rl_latex import sympy_latex_runs
from megadare.rewards.dllm_rl_math import dllm_rl_math_reward
from megadare.rewards.math_answer import gsm8k_gold
from megadare.rewards.math_verify import dare_math_reward, math_reward
from megadare.rewards.planning import check_sudoku_grid, countdown_reward, sudoku_reward

__all__ = [
    "RewardFn",
    "RewardSpecError",
    "BUILTIN_REWARDS",
    "load_reward",
    "combine",
    "auto_rule",
    "gold_response",
    "reward_notes",
    "runs_code",
    "as_score",
    "gold_problem",
]

RewardFn = Callable[[str, dict], float]
RewardSpec = Union[str, RewardFn]
MATH_SOURCES = (
    "math",
    "math500",
    "aime",
    "amc",
    "openr1",
    "deepscaler",
    "lighteval/math",
    "olympiad",
    "numina",
    "minerva",
)


DLLM_RL_GOLD = "ground_truth_answer"  # dLLM-RL's math rows: {question, ground_truth_answer}
DLLM_RL_TESTS = "test_method"  # its code rows: test_method function (test_list) | stdio (test_input, test_output)


class RewardSpecError(ValueError):
    """A reward spec that names no built-in and no importable callable."""


def _gold(record: dict) -> str:
    if "answer" not in record:
        raise KeyError(
            f"the record has no gold answer 'answer' (set rewards.answer_key to the field holding it); "
            f"record keys {sorted(record)}"
        )
    gold = record["answer"]
    if isinstance(gold, float) and math.isnan(gold):
        gold = None
    if gold is None or not isinstance(gold, (str, int, float)) or isinstance(gold, bool) or not str(gold).strip():
        what = "null" if gold is None else "empty" if isinstance(gold, str) else f"a {type(gold).__name__}"
        raise ValueError(
            f"the record's gold answer 'answer' is {what} ({gold!r:.80}); this reward compares it as text: give "
            "a non-empty string or a number (drop the row, or rewards.skip_rows_without_answer=true for null ones)"
        )
    return str(gold)


def _extra_info(record: dict) -> Any:
    """The row's ``extra_info``; a JSON object written as a string (as DARE's reward code also accepts) parsed."""
    extra = record.get("extra_info")
    if isinstance(extra, str) and extra.lstrip().startswith("{"):
        try:
            return json.loads(extra)
        except ValueError as e:
            raise ValueError(f"extra_info is a string that is not a JSON object ({e}): {extra[:80]!r}") from None
    return extra


def _extra_field(record: dict, name: str) -> Any:
    extra = _extra_info(record)
    if name in record:
        return record[name]
    if isinstance(extra, dict) and name in extra:
        return extra[name]
    raise KeyError(f"the record has no {name!r} (top level or extra_info.{name})")


def _math(response: str, record: dict) -> float:
    return math_reward(response, _gold(record), timeout=float(record.get("verify_timeout", 5.0)))


def _gsm8k(response: str, record: dict) -> float:
    return math_reward(response, gsm8k_gold(_gold(record)), timeout=float(record.get("verify_timeout", 5.0)))


def _dare_math(response: str, record: dict) -> float:
    if "answer" not in record:
        _gold(record)  # raises, naming the key
    return dare_math_reward(response, record["answer"], timeout=float(record.get("verify_timeout", 5.0)))


def _dllm_rl_math(response: str, record: dict) -> float:
    return dllm_rl_math_reward(response, _gold(record), timeout=float(record.get("verify_timeout", 5.0)))


def _exact_match(response: str, record: dict) -> float:
    return 1.0 if response.strip() == _gold(record).strip() else 0.0


def _countdown(response: str, record: dict) -> float:
    return countdown_reward(response, _gold(record), _extra_field(record, "numbers"))


def _sudoku(response: str, record: dict) -> float:
    return sudoku_reward(response, _gold(record), _extra_field(record, "puzzle"))


def _code_with(all_or_nothing: bool) -> RewardFn:
    def code(response: str, record: dict) -> float:
        if "tests" not in record and DLLM_RL_TESTS in record:
            return dllm_rl_code_reward(response, record, all_or_nothing=all_or_nothing)
        if "tests" not in record:
            return dare_code_reward(response, record, all_or_nothing=all_or_nothing)
        return code_reward(
            response,
            record["tests"],
            limits=SandboxLimits(
                timeout_s=float(record.get("timeout_s", 5.0)), memory_mb=int(record.get("memory_mb", 512))
            ),
            all_or_nothing=all_or_nothing,
        )

    return code


def _boxed_format(response: str, record: dict) -> float:
    return boxed_format_reward(response)


def _think_answer_format(response: str, record: dict) -> float:
    return think_answer_format_reward(response)


def auto_rule(record: dict) -> str:
    """The built-in that scores ``record`` under ``rewards.name=auto``, as DARE's ``dllm_rm`` dispatches.

    ``data_source`` sudoku* / countdown* -> sudoku / countdown; a ``tests`` field, ``extra_info.task == "code"`` or
    a code source (:data:`CODE_SOURCES`) -> code_all_or_nothing; ``task == "math"`` (a DARE row: gsm8k, math500,
    aime*, ...) -> dare_math, scored as DARE scores it; without a task, a source containing gsm8k -> gsm8k and a
    math source (math, math500, aime*, amc*, openr1*, ...) -> math; a row with neither source nor task: a dLLM-RL
    code row (``test_method``) -> code (its partial credit), a dLLM-RL math row (``ground_truth_answer``) ->
    dllm_rl_math, else (megadare's own files, the synthetic tasks) -> exact_match. Anything else raises ValueError.
    """
    source = str(record.get("data_source") or "").lower()
    extra = _extra_info(record)
    task = str(extra.get("task") or "").lower() if isinstance(extra, dict) else ""
    if source.startswith("sudoku"):
        return "sudoku"
    if source.startswith("countdown"):
        return "countdown"
    if not source and not task and DLLM_RL_TESTS in record:
        return "code"
    if "tests" in record or task == "code" or source in CODE_SOURCES:
        return "code_all_or_nothing"
    if task == "math":
        return "dare_math"
    if "gsm8k" in source:
        return "gsm8k"
    if source.startswith(MATH_SOURCES):
        return "math"
    if not source and not task and DLLM_RL_GOLD in record:
        return "dllm_rl_math"
    if not source and not task:
        return "exact_match"
    raise ValueError(
        f"rewards.name=auto has no rule for data_source={source!r}, extra_info.task={task!r}; name the "
        f"reward (rewards.name=math | gsm8k | countdown | sudoku | code | ...) or give rows a known source"
    )


def _auto(response: str, record: dict) -> float:
    return BUILTIN_REWARDS[auto_rule(record)](response, record)


BUILTIN_REWARDS: Dict[str, RewardFn] = {
    "math": _math,
    "gsm8k": _gsm8k,
    "dare_math": _dare_math,
    "dllm_rl_math": _dllm_rl_math,
    "exact_match": _exact_match,
    "countdown": _countdown,
    "sudoku": _sudoku,
    "code": _code_with(False),
    "code_all_or_nothing": _code_with(True),
    "boxed_format": _boxed_format,
    "think_answer_format": _think_answer_format,
    "auto": _auto,
}


def gold_response(rule: str, record: dict) -> Optional[str]:
    """The row's gold answer stated as a correct response states it, for the built-in ``rule``; None where the
    row holds no answer (a countdown target, code tests) or the rule checks no answer (format rewards)."""
    if rule == "auto":
        rule = auto_rule(record)
    gold = _gold(record) if rule in ("math", "dare_math", "dllm_rl_math", "gsm8k", "exact_match", "sudoku") else None
    if rule in ("math", "dare_math", "dllm_rl_math"):
        return gold if "\\boxed" in gold else f"The answer is \\boxed{{{gold}}}."
    if rule == "gsm8k":
        return f"The answer is \\boxed{{{gsm8k_gold(gold)}}}."
    if rule == "sudoku":
        return f"<answer>\n{check_sudoku_grid(gold, 'solution')}\n</answer>"
    return gold if rule == "exact_match" else None


def gold_problem(reward: str, record: dict) -> Optional[str]:
    """Why no response could score on ``record`` under the built-in ``reward``: a null, empty or NaN gold, a
    ``\\boxed`` gold with no readable box (``dare_math``), a GSM8K gold with nothing after ``####``, a sudoku gold
    that is no grid. None when the gold reads, when the reward reads no gold (format, code, countdown's target) or
    is not a built-in, and for rows ``auto`` has no rule for (scoring names those)."""
    if reward not in BUILTIN_REWARDS:
        return None
    try:
        rule = auto_rule(record) if reward == "auto" else reward
    except ValueError:
        return None
    try:
        gold_response(rule, record)
        if rule == "dare_math":
            dare_gold(record["answer"])
    except (ValueError, KeyError) as e:
        return str(e).strip("'\"")
    return None


_ORIGIN_RULES = {
    "dare_math": ("DARE", "(extra_info.task=math)", "DARE's math_rm"),
    "dllm_rl_math": ("dLLM-RL", "(ground_truth_answer)", "dLLM-RL's is_equal"),
}


def reward_notes(reward: str, records: Sequence[dict]) -> List[str]:
    """Lines to print at a run's start where ``reward`` scores ``records`` otherwise than the project they come
    from would: ``math`` / ``gsm8k`` on DARE's math rows (``extra_info.task == "math"``, which ``auto`` gives to
    ``dare_math``) or dLLM-RL's (``ground_truth_answer``: ``dllm_rl_math``), one line each; and where ``reward``
    runs code, one line for each hole of the code sandbox on this machine or these rows (:func:`_sandbox_notes`);
    where ``dllm_rl_math`` scores, which of dLLM-RL's last stages decides here (:func:`_dllm_rl_math_note`)."""
    notes = _sandbox_notes(reward, records) + _dllm_rl_math_note(reward, records)
    if reward not in ("math", "gsm8k"):
        return notes
    counts = dict.fromkeys(_ORIGIN_RULES, 0)
    for record in records:
        rule = _rule_or_none(record)
        if rule in counts:
            counts[rule] += 1
    return notes + [
        f"rewards: rewards.name={reward} scores {n} of {len(records)} rows that are {origin} math rows {tag} by "
        "megadare's looser rule, which also takes an unboxed answer ('the answer is X', the last number); "
        f"{ref} reads the last \\boxed{{}} only: rewards.name={rule} (or auto) scores them as {origin} does"
        for rule, n in counts.items()
        if n
        for origin, tag, ref in [_ORIGIN_RULES[rule]]
    ]


def _dllm_rl_math_note(reward: str, records: Sequence[dict]) -> List[str]:
    """One line where ``dllm_rl_math`` scores these rows (named, or ``auto`` on dLLM-RL math rows): its verdicts
    depend on this environment as dLLM-RL's do (sympy's parse_latex runs only under antlr4 4.11)."""
    if reward != "dllm_rl_math" and not (reward == "auto" and any(_rule_or_none(r) == "dllm_rl_math" for r in records)):
        return []
    if sympy_latex_runs():
        how = "sympy's parse_latex (antlr4 4.11 is installed here), as dLLM-RL grades where it is"
    else:
        how = (
            "dLLM-RL's normalised strings (sympy's parse_latex needs antlr4 4.11, not installed here; nor by "
            "dLLM-RL's own requirements), so 2/4 is not 1/2; rewards.name=math checks equivalence"
        )
    return [f"rewards: dllm_rl_math decides answers the Hendrycks strings leave open by {how}"]


def _rule_or_none(record: dict) -> Optional[str]:
    try:
        return auto_rule(record)
    except ValueError:
        return None


def _sandbox_notes(reward: str, records: Sequence[dict]) -> List[str]:
    """What the code sandbox does not hold for these rows, said where it was silent: the seccomp filter exists for
    x86-64 and aarch64 only (elsewhere, riscv64 or ppc64le nodes, native code may call sync, io_uring, memfd_create,
    SysV shared memory and unshare). DARE's humanevalplus rows say nothing: their harness is judged outside the
    program's process (:mod:`.harness`), so numpy's raw memory in there cannot fake a pass."""
    if not runs_code(reward, records):
        return []
    notes = []
    if seccomp_denies_processes(1) is None:
        notes.append(
            f"rewards: the code sandbox has no seccomp filter on {platform.machine()} (x86-64 and aarch64 only): "
            "programs run in its namespaces as an unprivileged uid with no_new_privs, but native code may call sync, "
            "io_uring, memfd_create, SysV shared memory and unshare, which the filter refuses there (README 'Code "
            "sandbox')"
        )
    return notes


def runs_code(reward: str, records: Sequence[dict]) -> bool:
    """Will ``reward`` run programs in the sandbox on these ``records``? (a code built-in, or ``auto`` with a row
    ruled to one); rows ``auto`` has no rule for are left to fail when scored."""
    code = ("code", "code_all_or_nothing")
    if reward != "auto":
        return reward in code
    for record in records:
        try:
            if auto_rule(record) in code:
                return True
        except ValueError:
            continue
    return False


def load_reward(spec: RewardSpec) -> RewardFn:
    """A reward function from a built-in name, an import path ``"pkg.module:function"``, or a callable."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise RewardSpecError(f"reward spec must be a name, 'pkg.module:function' or a callable, got {spec!r}")
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        close = difflib.get_close_matches(spec, list(BUILTIN_REWARDS), n=1, cutoff=0.75)
        raise RewardSpecError(
            f"unknown reward {spec!r}: {f'did you mean {close[0]!r}? ' if close else ''}not a built-in "
            f"({', '.join(sorted(BUILTIN_REWARDS))}) and not an import path 'pkg.module:function'"
        )
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise RewardSpecError(f"reward {spec!r}: expected 'pkg.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise RewardSpecError(f"reward {spec!r}: module {module_name!r} not found") from e
        raise RewardSpecError(f"reward {spec!r}: importing {module_name!r} failed: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardSpecError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardSpecError(f"reward {spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
    return obj


def as_score(value: Any) -> float:
    """A reward's return value as a float: a number, a bool or a one-element tensor / array. A string (``"1.0"``,
    ``"correct"``) is refused, not parsed: a reward that returns text has a bug, and float() would hide it; a dict
    (verl's ``compute_score`` form) is refused naming its ``score``."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"reward returned a {type(value).__name__} ({value!r:.80}), not a number; return a float")
    if isinstance(value, Mapping):
        raise TypeError(
            f"reward returned a dict with keys {sorted(map(str, value))[:8]}, not a number (verl's compute_score "
            "form): return its score, e.g. a wrapper returning result['score']"
        )
    return float(value)


def combine(specs_with_weights: Union[Mapping[RewardSpec, float], Sequence[Tuple[RewardSpec, float]]]) -> RewardFn:
    """Weighted sum of rewards: ``combine([("code", 2.0), ("boxed_format", 0.5)])``.

    Each spec goes through :func:`load_reward` now, so a bad spec fails here and not mid-training.
    """
    items = list(specs_with_weights.items()) if isinstance(specs_with_weights, Mapping) else list(specs_with_weights)
    if not items:
        raise RewardSpecError("combine needs at least one (spec, weight)")
    parts = [(load_reward(spec), float(w)) for spec, w in items]

    def combined(response: str, record: dict) -> float:
        return sum(w * as_score(fn(response, record)) for fn, w in parts)

    return combined
