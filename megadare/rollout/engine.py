"""The rollout engine protocol: what every engine (built-in torch, SGLang) takes and returns.

A ``Trajectory`` records, for every response token, the global denoising step at which it was committed
(``commit_step``, counted over the whole generation, one model forward per step) and the step inside its block
(``block_step``), plus the log-probability of the committed token under the sampling distribution of that step
(temperature / top-k / top-p applied). TraceRL-style estimators replay those steps; IS corrections use the
log-probs. ``validate`` checks the contract: exactly one step per token, steps within range and non-decreasing
over blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Protocol

import torch

ALGORITHMS = ("low_confidence_static", "low_confidence_dynamic", "random")
FINISH_REASONS = ("eos", "length")
WEIGHT_TRANSPORTS = ("auto", "distributed", "colocated", "object_store")   # rollout.weight_transport (weight_sync.py)
ENGINE_DEVICES = ("auto", "cpu", "cuda")                                   # rollout.device (built-in engine)


@dataclass(frozen=True)
class SamplingParams:
    """How to decode. ``block_size`` and ``steps_per_block``: a block of B tokens is denoised in S forwards;
    static schedules commit B/S tokens per step (remainder to early steps); ``low_confidence_dynamic`` commits
    every masked token whose confidence exceeds ``threshold`` (at least the static count... or at least one,
    see native.py). ``random`` remasking commits random positions (LLaDA's 'random')."""

    max_new_tokens: int = 64
    block_size: int = 4
    steps_per_block: int = 4
    algorithm: str = "low_confidence_static"
    threshold: float = 0.9
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0
    stop_at_eos: bool = True          # finish after the block holding the first EOS (False: decode the whole
                                      # canvas of max_new_tokens, rl.canvas=full)
    seed: int = 0
    record_steps: bool = False        # keep per-step predictions and confidences (MDPO)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"sampling algorithm {self.algorithm!r} unknown; choose one of {ALGORITHMS}")
        if self.block_size < 1 or self.steps_per_block < 1 or self.max_new_tokens < 1:
            raise ValueError("block_size, steps_per_block and max_new_tokens must be >= 1")
        if self.steps_per_block > self.block_size:
            raise ValueError(f"steps_per_block={self.steps_per_block} > block_size={self.block_size}: a step "
                             "must commit at least one token")
        if not 0.0 < self.top_p <= 1.0 or self.top_k < 0 or self.temperature < 0:
            raise ValueError("need temperature >= 0, top_k >= 0, 0 < top_p <= 1")


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int]
    commit_step: list[int]            # global denoising step (model forward index) that committed each token
    block_step: list[int]             # step inside the token's block
    logprobs: list[float]             # log-prob of the committed token under the step's sampling distribution
    finish_reason: str                # "eos": the response holds an EOS (the answer ended), "length": it does not
    num_forwards: int
    params: SamplingParams
    policy_version: int = 0
    step_predictions: Optional[list[list[int]]] = None    # MDPO: per step, the argmax/sample at every position
    step_confidences: Optional[list[list[float]]] = None
    extra: dict[str, Any] = field(default_factory=dict)

    def answer_ids(self, eos_token_id: int) -> list[int]:
        """The answer: the response up to its first EOS (inclusive); a full-canvas response (``stop_at_eos``
        off) also holds the tokens the sampler decoded after it, which belong to no answer."""
        return answer_ids(self.response_ids, eos_token_id)

    def validate(self) -> "Trajectory":
        n = len(self.response_ids)
        for name in ("commit_step", "block_step", "logprobs"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"trajectory: {name} has {len(getattr(self, name))} entries for {n} response tokens")
        if any(s < 0 or s >= self.num_forwards for s in self.commit_step):
            raise ValueError("trajectory: a commit step lies outside [0, num_forwards)")
        if any(s < 0 or s >= self.params.steps_per_block for s in self.block_step):
            raise ValueError("trajectory: a block-local step lies outside [0, steps_per_block)")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"trajectory: finish_reason {self.finish_reason!r} not in {FINISH_REASONS}")
        if any(lp > 1e-6 for lp in self.logprobs):
            raise ValueError("trajectory: a log-prob is positive")
        return self


def answer_ids(ids: list[int], eos_token_id: int) -> list[int]:
    """``ids`` up to the first EOS (inclusive), all of them when there is none."""
    ids = list(ids)
    return ids[:ids.index(eos_token_id) + 1] if eos_token_id in ids else ids


class RolloutEngine(Protocol):
    """What every engine implements. Weight pushes (rollout/weight_sync.py) reach it through its Ray actor, which
    calls ``update_weights`` with views of each received bucket; an engine with weight groups of its own (SGLang's
    TP ranks) also has ``join_weight_groups(specs)`` and ``receive_weights(plan, version)``."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Trajectory]: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def health(self) -> dict[str, Any]: ...
