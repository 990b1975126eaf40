"""Rewards for RL and evaluation: math answer checking, sandboxed code tests, format checks, a registry.

* :mod:`.math_answer`: final-answer extraction (last ``\\boxed{}``, "answer is", last number; GSM8K ``####``)
  and MATH-style normalisation;
* :mod:`.math_verify`: answer equivalence (string / math-verify / numeric / sympy) and the killable
  :class:`VerifierPool` that runs it with a timeout;
* :mod:`.sandbox`: one untrusted Python program under OS limits, seccomp, a network namespace and an audit hook;
* :mod:`.code`: stdin/stdout and assert-style test cases through the sandbox;
* :mod:`.format`: ``\\boxed{}`` and ``<think>/<answer>`` format rewards;
* :mod:`.registry`: ``RewardFn(response, record) -> float`` by name or import path, weighted sums and
  :func:`score_batch`, the scorer shared by RL and evaluation.

Only the standard library and sympy are needed; ``pip install 'megadare[math]'`` adds math-verify.
"""
from megadare.rewards.code import code_reward, extract_code, parse_tests, run_tests
from megadare.rewards.format import boxed_format_reward, think_answer_format_reward
from megadare.rewards.math_answer import extract_answer, extract_boxed, gsm8k_gold, normalize_answer
from megadare.rewards.math_verify import (VerifierPool, VerifyResult, answers_equal, default_pool, math_reward,
                                          verify_answer)
from megadare.rewards.registry import (BUILTIN_REWARDS, RewardFn, RewardSpecError, ScoreStats, combine,
                                       load_reward, score_batch)
from megadare.rewards.sandbox import SandboxResult, run_program

__all__ = [
    "extract_boxed", "extract_answer", "gsm8k_gold", "normalize_answer",
    "answers_equal", "verify_answer", "math_reward", "VerifierPool", "VerifyResult", "default_pool",
    "run_program", "SandboxResult",
    "extract_code", "parse_tests", "run_tests", "code_reward",
    "boxed_format_reward", "think_answer_format_reward",
    "RewardFn", "RewardSpecError", "BUILTIN_REWARDS", "load_reward", "combine", "score_batch", "ScoreStats",
]
