"""The rollout engine protocol: what every engine (built-in torch, SGLang) takes and returns.

A ``Trajectory`` records, for every response token, the global denoising step at which it was committed
(``commit_step``, counted over the whole generation, one model forward per step) and the step inside its block
(``block_step``), plus the log-probability of the committed token under the sampling distribution of that step
(temperature / top-k / top-p applied). TraceRL-style estimators replay those steps; IS corrections use the
log-probs. ``validate`` checks the contract: exactly one step and one log-prob per token, steps within range
(global in [0, num_forwards), block-local below the block's step limit), a known finish reason, no positive
log-prob; it does not check that the steps grow from block to block.

Token editing (``algorithm="editing"``, LLaDA2.1) may commit a position more than once: the per-token lists then
describe the commit that wrote the final token, and ``superseded`` lists every earlier commit that a later edit
of the same position overwrote (position, token, global step, block-local step, log-prob). ``validate`` checks
that the commits of a position are strictly ordered in time, that each edit changed the token, and that edits
exist only under the editing decoder. Trace replay scores every commit, superseded ones included
(diffusion/trace_replay.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple, Optional, Protocol

import torch

from megadare.rollout.choices import ALGORITHMS, CONFIDENCES, SCHEDULES

FINISH_REASONS = ("eos", "length")
_SEED_STRIDE = 1_000_003


def prompt_seed(seed: int, index: int) -> int:
    """The seed of the random stream of the ``index``-th prompt of a generate() call with ``params.seed=seed``.

    Every engine draws one stream per prompt (sampling, then random remasking, step by step, only in the steps
    where the prompt has work), seeded from (seed, prompt index): a trajectory depends on its prompt,
    its index and the weights, not on the other prompts of the batch nor on the engine. Prompt 0 gets ``seed``."""
    return (int(seed) + int(index) * _SEED_STRIDE) % (2**63)


@dataclass(frozen=True)
class SamplingParams:
    """How to decode. ``block_size`` and ``steps_per_block``: a block of B tokens is denoised in S forwards.

    Which positions a step commits (``algorithm``): ``low_confidence_static`` the n most confident masked positions
    (``alg_temp`` > 0: n positions drawn without replacement with probabilities softmax(confidence / alg_temp),
    Dream's ``alg_temp``); ``low_confidence_dynamic`` every masked position whose confidence exceeds
    ``threshold`` when that is at least n, else the top n; ``random`` n random masked positions (LLaDA's
    'random'); ``editing`` LLaDA2.1's decoder (``rollout/editing.py``): the dynamic rule with n =
    ``num_to_transfer`` plus token edits of already decoded positions whose new prediction has confidence above
    ``editing_threshold``, and up to ``max_post_steps`` refinement forwards after the block has no masks
    (``steps_per_block`` is not used by it).

    How many (n, ``schedule``): ``even`` B/S per step, remainder to the early steps (LLaDA
    ``get_num_transfer_tokens``); ``linspace`` Dream's ``int(n_masked * (1 - s/t))`` with t, s consecutive points
    of ``linspace(1, eps, S + 1)``, the last step commits the rest; ``linspace_first`` DARE's block sampler for
    Dream (``generation_utils_block.py``): step 0 commits the block's first masked position alone, step i >= 1 the
    linspace count of step i; ``linspace_remaining`` DARE's MDPO rollout for Dream (``mdpo_dream_rollout.py``):
    ``n_masked - int(n_masked * s/t)`` (the count that stays masked is rounded down, so one more token than
    ``linspace`` where the product is fractional), the last step commits the rest (DARE's can leave masks there).

    The ranking (``confidence``): ``model_prob`` p_theta(x0) under the unfiltered model distribution (LLaDA, SDAR,
    LLaDA2.0); Dream's rules on the sampling distribution p = softmax(filter(logits / T)) (T = 0: of the logits):
    ``maskgit_plus`` p(x0), ``topk_margin`` p_(1) - p_(2), ``entropy`` sum_v p_v log(p_v + 1e-10)."""

    max_new_tokens: int = 64
    block_size: int = 4
    steps_per_block: int = 4
    algorithm: str = "low_confidence_static"
    threshold: float = 0.9
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    stop_at_eos: bool = True  # finish after the block holding the first EOS (False: decode the whole
    # canvas of max_new_tokens, rl.canvas=full)
    seed: int = 0  # prompt i draws from its own stream, seeded prompt_seed(seed, i)
    record_steps: bool = False  # keep per-step predictions and their probabilities (MDPO): every masked
    # response position a forward predicts (full attention: later blocks too, as DARE's MDPO rollouts)
    confidence: str = "model_prob"  # what low-confidence remasking ranks (CONFIDENCES)
    schedule: str = "even"  # how many tokens a static step commits (SCHEDULES)
    eps: float = 1e-3  # Dream: the last point of the linspace schedule
    alg_temp: float = 0.0  # Dream: 0 = top-n by confidence, > 0 = n positions drawn ~ softmax(conf/alg_temp)
    editing_threshold: float = 0.9  # LLaDA2.1: edit a decoded token when the new prediction's confidence exceeds it
    max_post_steps: int = 16  # LLaDA2.1: refinement forwards after the block has no masks
    num_to_transfer: int = 1  # LLaDA2.1: masked positions committed per step at least

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"sampling algorithm {self.algorithm!r} unknown; choose one of {ALGORITHMS}")
        if self.block_size < 1 or self.steps_per_block < 1 or self.max_new_tokens < 1:
            raise ValueError("block_size, steps_per_block and max_new_tokens must be >= 1")
        if self.steps_per_block > self.block_size:
            raise ValueError(
                f"steps_per_block={self.steps_per_block} > block_size={self.block_size}: a step "
                "must commit at least one token"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0: greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0: no top-k cut)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must lie in (0, 1] (1: no nucleus cut)")
        if not self.threshold < 1.0:
            raise ValueError(
                f"threshold={self.threshold} must be < 1: a step commits the positions whose confidence (at most 1) "
                "exceeds it, so none ever would (e.g. 0.9)"
            )
        self._check_decoder()

    def _check_decoder(self) -> None:
        """The confidence / schedule / editing fields and the combinations that mean something (each message
        names the field, which is also the ``rollout.`` config key)."""
        if self.confidence not in CONFIDENCES:
            raise ValueError(f"confidence={self.confidence!r} unknown; choose one of {CONFIDENCES}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} unknown; choose one of {SCHEDULES}")
        if self.algorithm == "low_confidence_dynamic" and self.confidence == "entropy" and self.threshold >= 0:
            raise ValueError(
                f"threshold={self.threshold} with confidence=entropy: that confidence is a negative entropy (<= 0), "
                "so no position ever exceeds the threshold and a step commits only its scheduled few; use a "
                "negative threshold (e.g. -0.5) or another confidence"
            )
        if not 0.0 < self.eps < 1.0 or self.alg_temp < 0:
            raise ValueError(f"eps={self.eps} must lie in (0, 1) and alg_temp={self.alg_temp} be >= 0")
        if not 0.0 <= self.editing_threshold <= 1.0 or self.max_post_steps < 0 or self.num_to_transfer < 1:
            raise ValueError(
                f"need 0 <= editing_threshold <= 1 (got {self.editing_threshold}), max_post_steps >= 0 "
                f"(got {self.max_post_steps}), num_to_transfer >= 1 (got {self.num_to_transfer})"
            )
        if self.algorithm == "editing" and (self.confidence != "model_prob" or self.schedule != "even"):
            raise ValueError(
                f"algorithm='editing' ranks by LLaDA2.1's own confidence and commits at least "
                f"num_to_transfer per step: leave confidence (got {self.confidence!r}) and schedule "
                f"(got {self.schedule!r}) at their defaults"
            )
        if self.algorithm == "random" and self.confidence != "model_prob":
            raise ValueError(f"confidence={self.confidence!r} ranks nothing under algorithm='random'")
        if self.alg_temp > 0 and self.algorithm != "low_confidence_static":
            raise ValueError(
                f"alg_temp={self.alg_temp} draws the committed positions of algorithm="
                f"'low_confidence_static' only (got {self.algorithm!r})"
            )
        if self.schedule == "linspace_first" and self.steps_per_block < 2 and self.block_size > 1:
            raise ValueError(
                "schedule='linspace_first' spends step 0 on the block's first position: it needs "
                f"steps_per_block >= 2 (got {self.steps_per_block})"
            )
        if self.confidence != "model_prob" and self.top_k > 0 and self.top_p < 1.0:
            raise ValueError(
                f"confidence={self.confidence!r} follows Dream, which applies top-p before top-k; "
                "megadare filters top-k first: set only one of top_k / top_p"
            )

    def block_step_limit(self) -> int:
        """Block-local step indices lie in [0, limit): steps_per_block, or for the editing decoder at most one
        step per masked position plus max_post_steps refinement steps."""
        if self.algorithm == "editing":
            return self.block_size + self.max_post_steps
        return self.steps_per_block

    def block_forwards(self) -> int:
        """The most forwards a block's loop may run (the editing decoder's last one may find nothing to edit)."""
        return self.block_step_limit() + (1 if self.algorithm == "editing" else 0)


class Superseded(NamedTuple):
    """A commit that a later edit of the same position overwrote (token editing)."""

    position: int  # index in response_ids
    token: int
    commit_step: int  # global denoising step
    block_step: int
    logprob: float  # log-prob of ``token`` under that step's sampling distribution


def fields_from_extra(state: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """An unpickled object's ``__dict__`` with ``names`` moved out of its ``extra`` dict: objects pickled before
    those keys became fields (checkpointed queues and replay buffers of older runs) carried them in ``extra``.
    A name already set as a field stays as it is."""
    extra = dict(state.get("extra") or {})
    moved = {k: extra.pop(k) for k in names if k in extra and k not in state}
    return {**state, **moved, "extra": extra}


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int]
    commit_step: list[int]  # global denoising step (model forward index) that committed each token
    block_step: list[int]  # step inside the token's block
    logprobs: list[float]  # log-prob of the committed token under the step's sampling distribution
    finish_reason: str  # "eos": the response holds an EOS (the answer ended), "length": it does not
    num_forwards: int
    params: SamplingParams
    policy_version: int = 0
    step_predictions: Optional[list[list[int]]] = None  # MDPO: per forward, the proposal x0 at every response
    # position that forward predicted (its block), else -1
    step_confidences: Optional[list[list[float]]] = None  # model probability of each proposal (0 where -1)
    superseded: Optional[list[Superseded]] = None  # token editing: overwritten commits, in step order
    token_versions: Optional[list[int]] = None  # partial rollouts: policy version of every response token
    engine_s: float = 0.0  # engine seconds of the chunk (on its first trajectory)
    extra: dict[str, Any] = field(default_factory=dict)  # one engine's or algorithm's own

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(fields_from_extra(state, ("token_versions", "engine_s")))

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
        limit = self.params.block_step_limit()
        if any(s < 0 or s >= limit for s in self.block_step):
            raise ValueError(
                f"trajectory: a block-local step lies outside [0, {limit}) (steps_per_block, or block "
                "size + max_post_steps under token editing)"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"trajectory: finish_reason {self.finish_reason!r} not in {FINISH_REASONS}")
        if any(lp > 1e-6 for lp in self.logprobs):
            raise ValueError("trajectory: a log-prob is positive")
        if self.step_predictions is not None:
            shapes = {len(p) for p in self.step_predictions} | {len(c) for c in self.step_confidences or [[]]}
            if len(self.step_predictions) != self.num_forwards or shapes != {n}:
                raise ValueError(
                    f"trajectory: step_predictions must hold one row of {n} response positions per "
                    f"forward ({self.num_forwards}); got {len(self.step_predictions)} rows of {shapes}"
                )
        if self.superseded:
            self._validate_edits()
        return self

    def _validate_edits(self) -> None:
        """Superseded commits: only under token editing; per position strictly earlier than the final commit and
        ordered in time (global and block-local), each edit changing the token; steps and log-probs in range."""
        if self.params.algorithm != "editing":
            raise ValueError(
                f"trajectory: {len(self.superseded or [])} superseded commits, but only "
                f"algorithm='editing' edits tokens (got {self.params.algorithm!r})"
            )
        per_pos: dict[int, list[Superseded]] = {}
        for e in self.superseded or []:
            if not 0 <= e.position < len(self.response_ids):
                raise ValueError(
                    f"trajectory: a superseded commit at position {e.position} outside the response "
                    f"({len(self.response_ids)} tokens)"
                )
            if not 0 <= e.commit_step < self.num_forwards or not 0 <= e.block_step < self.params.block_step_limit():
                raise ValueError(f"trajectory: superseded commit {tuple(e)} has a step out of range")
            if e.logprob > 1e-6:
                raise ValueError(f"trajectory: superseded commit {tuple(e)} has a positive log-prob")
            per_pos.setdefault(e.position, []).append(e)
        for k, chain in per_pos.items():
            steps = [(e.commit_step, e.block_step, e.token) for e in chain]
            steps.append((self.commit_step[k], self.block_step[k], self.response_ids[k]))
            for (g0, b0, t0), (g1, b1, t1) in zip(steps, steps[1:]):
                if not (g0 < g1 and b0 < b1):
                    raise ValueError(
                        f"trajectory: the commits of position {k} are not strictly ordered in time "
                        f"(global, block-local, token: {steps}); list superseded commits in step order"
                    )
                if t0 == t1:
                    raise ValueError(
                        f"trajectory: position {k} was 'edited' at step {g1} to the token it held "
                        f"({t1}); an edit changes the token"
                    )


def answer_ids(ids: list[int], eos_token_id: int) -> list[int]:
    """``ids`` up to the first EOS (inclusive), all of them when there is none."""
    ids = list(ids)
    return ids[: ids.index(eos_token_id) + 1] if eos_token_id in ids else ids


def check_generate_call(asleep: bool, prompts: list[list[int]]) -> None:
    """What every engine's ``generate`` refuses: a call while asleep, and no prompts or an empty one."""
    if asleep:
        raise RuntimeError("engine is asleep: call wake() before generate()")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs non-empty prompts")


class RolloutEngine(Protocol):
    """What every engine implements. Weight pushes (rollout/weight_sync/) reach it through its Ray actor, which
    calls ``update_weights`` with views of each received bucket; an engine with weight groups of its own (SGLang's
    TP ranks) also has ``join_weight_groups(specs)`` and ``receive_weights(plan, version)``."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Trajectory]: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def health(self) -> dict[str, Any]: ...
