"""Rewards for RL and evaluation: math answer checking, sandboxed code tests, DARE's planning rules, a registry.

* :mod:`.math_answer`: final-answer extraction (last ``\\boxed{}``, "answer is", last number; GSM8K ``####``)
  and MATH-style normalisation;
* :mod:`.math_verify`: answer equivalence (normalised strings, then the ``math-verify`` package) and the killable
  :class:`VerifierPool` that runs it with a timeout;
* :mod:`.dare_math`, :mod:`.dllm_rl_math`: DARE's and dLLM-RL's math rules, as those projects score;
* :mod:`.sandbox` (+ :mod:`.sandbox_start`, :mod:`.sandbox_jail`, :mod:`.sandbox_kernel`, :mod:`.sandbox_output`,
  :mod:`.sandbox_child`): one untrusted Python program in new
  namespaces with a read-only root and a private tmpfs (``rewards.code.isolation``), under rlimits, seccomp and an
  audit hook; a test mode that proves the tests ran to their end;
* :mod:`.code`: stdin/stdout, call-based and assert-style test cases through the sandbox; :mod:`.code_forms`:
  DARE's code ground truths (humaneval, humanevalplus, mbpp, taco, LiveCodeBench) and MBPP's ``[BEGIN]``/``[DONE]``;
  :mod:`.harness`: humanevalplus's harness judged outside the program's process;
  :mod:`.dllm_rl_code`: dLLM-RL's code rows;
* :mod:`.planning`: DARE's countdown and sudoku rewards;
* :mod:`.format`: ``\\boxed{}`` and ``<think>/<answer>`` format rewards;
* :mod:`.registry`: ``RewardFn(response, record) -> float`` by name or import path, the per-row ``auto`` rule,
  weighted sums; :mod:`.scoring`: :func:`score_batch`, the scorer shared by RL and evaluation, and the stop when
  rewards cannot be computed (:func:`check_reward_errors`); :mod:`.errors`: what a reward raises when it cannot
  give a score.
"""

from megadare.rewards.code import code_reward, extract_code, parse_tests, run_tests
from megadare.rewards.code_forms import dare_code_reward, extract_code_mbpp, program_extractor
from megadare.rewards.errors import AnswerTimeout, RewardError, SandboxUnavailable
from megadare.rewards.format import boxed_format_reward, think_answer_format_reward
from megadare.rewards.math_answer import extract_answer, extract_boxed, gsm8k_gold, normalize_answer
from megadare.rewards.math_verify import (
    VerifierPool,
    VerifyResult,
    answers_equal,
    default_pool,
    math_reward,
    verify_answer,
)
from megadare.rewards.planning import countdown_reward, sudoku_reward
from megadare.rewards.registry import (
    BUILTIN_REWARDS,
    RewardFn,
    RewardSpecError,
    auto_rule,
    combine,
    gold_problem,
    gold_response,
    load_reward,
    reward_notes,
    runs_code,
)
from megadare.rewards.sandbox import SandboxLimits, SandboxResult, check_isolation, run_program, set_isolation
from megadare.rewards.scoring import ScoreStats, check_reward_errors, score_batch

__all__ = [
    "extract_boxed",
    "extract_answer",
    "gsm8k_gold",
    "normalize_answer",
    "answers_equal",
    "verify_answer",
    "math_reward",
    "VerifierPool",
    "VerifyResult",
    "default_pool",
    "run_program",
    "SandboxResult",
    "SandboxLimits",
    "set_isolation",
    "check_isolation",
    "SandboxUnavailable",
    "extract_code",
    "parse_tests",
    "run_tests",
    "code_reward",
    "dare_code_reward",
    "extract_code_mbpp",
    "program_extractor",
    "countdown_reward",
    "sudoku_reward",
    "boxed_format_reward",
    "think_answer_format_reward",
    "RewardFn",
    "RewardSpecError",
    "BUILTIN_REWARDS",
    "load_reward",
    "combine",
    "auto_rule",
    "gold_problem",
    "gold_response",
    "reward_notes",
    "runs_code",
    "score_batch",
    "ScoreStats",
    "check_reward_errors",
    "AnswerTimeout",
    "RewardError",
]
