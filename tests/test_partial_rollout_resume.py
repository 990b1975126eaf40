"""A checkpoint leaves a run's partial rollouts as they were: saving at step k (every save_interval, or the one a
SIGTERM asks for) and resuming from it generate the same segments on the same weights as a run that never saved.

The checkpoint used to finish every queued rollout on the weights of the save: with ``offpolicy.max_staleness`` >= 2
a rollout's later segments then came from an older version than without the save, so a run stopped by SIGTERM (or
saving at another interval) and resumed trained on other rollouts from the save on (measured end to end: steps 4
and 5 of a fully-async run differed in reward, IS weights and every final weight). Here the engine is a stand-in
whose tokens name the weights they were generated on."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

from megadare.rollout.engine import SamplingParams, Trajectory
from megadare.trainer.offpolicy.queue import PartialRollout, QueuedRollout, RolloutQueue

PROMPTS = [[5, 6, 7], [8, 9]]
PARAMS = SamplingParams(max_new_tokens=12, block_size=4, seed=11)


class Engines:
    """Each segment's tokens are (weights version, seed, prompt length): which weights and request made them."""

    def __init__(self) -> None:
        self.version = 0

    def submit(self, prompts: list[list[int]], params: SamplingParams):
        out = [
            Trajectory(
                prompt_ids=list(p),
                response_ids=[100 * self.version + params.seed % 97 + len(p)] * params.max_new_tokens,
                commit_step=list(range(params.max_new_tokens)),
                block_step=[0] * params.max_new_tokens,
                logprobs=[-1.0] * params.max_new_tokens,
                finish_reason="length",
                num_forwards=params.max_new_tokens,
                params=params,
                policy_version=self.version,
            )
            for p in prompts
        ]
        return SimpleNamespace(result=lambda: out)


def _queued(engines: Engines) -> RolloutQueue:
    """A queue holding one partial rollout (one block per segment: three segments), its first on version 0."""
    queue = RolloutQueue(None, ahead=2, last_step=10)
    queue.queue[2] = QueuedRollout(2, [0, 1], PartialRollout(engines.submit, PROMPTS, PARAMS, 1, global_grid=False))
    return queue


def _push(engines: Engines, queue: RolloutQueue, version: int) -> None:
    """A weight update pushed to the engines; the queue's partial rollouts continue on it (``push_weights``)."""
    engines.version = version
    queue.advance()


def _finished(queue: RolloutQueue) -> list[tuple[list[int], list[int]]]:
    """The rollout's trajectories as the step that trains on it takes them (``RolloutQueue.take``)."""
    pending = queue.queue.pop(2).pending
    return [(t.response_ids, t.token_versions) for t in (pending.result() if hasattr(pending, "result") else pending)]


def test_a_checkpoint_between_segments_changes_nothing_and_resumes_exactly():
    straight_engines = Engines()
    straight = _queued(straight_engines)
    _push(straight_engines, straight, 1)
    _push(straight_engines, straight, 2)
    expected = _finished(straight)
    assert [v for _, v in expected] == [[0] * 4 + [1] * 4 + [2] * 4] * 2  # one segment per version

    engines = Engines()
    saving = _queued(engines)
    _push(engines, saving, 1)
    saved = pickle.loads(pickle.dumps(saving.drain(finish=True)))  # the checkpoint's copy, after update 1
    _push(engines, saving, 2)
    assert _finished(saving) == expected  # the run that saved goes on as if it had not

    resumed_engines = Engines()
    resumed_engines.version = 1  # a resumed run pushes its checkpoint's weights before the loop
    resumed = RolloutQueue(None, ahead=2, last_step=10)
    resumed.restore(saved, resumed_engines.submit)
    _push(resumed_engines, resumed, 2)
    assert _finished(resumed) == expected


def test_each_steps_rollout_is_started_once_and_the_queue_holds_only_steps_ahead():
    """Taking step k's rollout topped the queue up from step k again: every step started a second rollout of the
    step just taken (engines generating each sync step twice, the next rollout waiting behind the copy), which
    stayed queued for good: ``async/queue_depth`` grew by one a step, and every checkpoint finished and saved all
    of them. A checkpoint's copies of steps already trained are dropped when the run takes a later step."""
    for ahead in (0, 1, 2):
        started: list[int] = []
        queue = RolloutQueue(lambda k: started.append(k) or ([k], [f"rollout {k}"]), ahead=ahead, last_step=5)
        for step in range(5):
            assert queue.take(step)[1] == [f"rollout {step}"]
            assert sorted(queue.queue) == list(range(step + 1, min(step + ahead, 4) + 1)), (ahead, step)
        assert started == [0, 1, 2, 3, 4], (ahead, started)
    restored = RolloutQueue(lambda k: ([k], [f"rollout {k}"]), ahead=1, last_step=5)
    restored.restore({1: ([1], ["copy of 1"]), 2: ([2], ["rollout 2"])})  # an older megadare's checkpoint at 2
    assert restored.take(2)[1] == ["rollout 2"] and sorted(restored.queue) == [3]
