"""What a reward raises when it cannot give a score, as opposed to a low one."""

from __future__ import annotations

__all__ = ["AnswerTimeout", "RewardError", "SandboxUnavailable"]


class AnswerTimeout(TimeoutError):
    """Checking the answer ran past its time limit (a verifier on a pathological expression): the answer scores 0.0
    and is counted apart from reward errors, as a program that runs past its limit fails its test."""


class RewardError(RuntimeError):
    """Too many samples of a batch whose reward could not be computed; the message names the reward, the first
    failing record (file:row) and its exception."""


class SandboxUnavailable(RewardError):
    """The kernel refused the OS isolation code rewards run in (``rewards.code.isolation=namespaces``): no code
    reward runs, whatever ``rewards.max_error_fraction`` tolerates; the message names the weaker setting."""
