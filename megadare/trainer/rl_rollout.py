"""The rollout role of the RL loop: ``Rollouts`` (start, collect, evaluate) and the step's samples (the sampling
parameters and the engine actors come from rollout/setup.py).

Rank 0 owns the engines (``rollout.setup.start_engines``) and the rollout queue; ``Rollouts.collect`` turns the
queued rollout of a step into scored ``RLSample``s with advantages and behaviour versions (rewards through
:mod:`.reward_step`, which stops the run when they cannot be computed); ``Rollouts.evaluate`` is the held-out
accuracy.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from megadare.algos.advantages import all_equal_groups, filter_groups, group_advantages, truncated_as_wrong
from megadare.algos.base import ANSWER_LENGTH, RLSample
from megadare.config import Config
from megadare.rollout.engine import answer_ids
from megadare.trainer.data_order import StepSampler
from megadare.trainer.offpolicy.queue import PartialRollout, RolloutQueue, lookahead, staleness_metrics
from megadare.trainer.reward_step import score_rollouts, score_texts
from megadare.trainer.spec import RunSpec


@dataclass
class Rollouts:
    """What the RL loop's rollouts need: the run's spec (config, algorithm, train / eval sampling parameters),
    the tokenizer and reward, the training and held-out prompts and which of them each step takes; on rank 0
    the engines (``manager``, started after the checkpoint is read) and the rollout queue (``open_queue``)."""

    spec: RunSpec
    tok: Any
    reward_fn: Any
    train_prompts: list
    held_prompts: list
    sampler: StepSampler
    manager: Any = None  # RolloutManager (rank 0)
    queue: Optional[RolloutQueue] = None  # rank 0, from ``open_queue``
    flat_steps: int = 0  # steps so far whose every group had equal rewards (nothing to learn)

    @property
    def cfg(self) -> Config:
        return self.spec.cfg

    @property
    def ahead(self) -> int:
        """How many steps the rollouts run ahead of the trainer (``offpolicy.mode``, ``offpolicy.max_staleness``)."""
        return lookahead(self.cfg.offpolicy.mode, self.cfg.offpolicy.max_staleness)

    def open_queue(self, restored: Optional[dict]) -> None:
        """Rank 0: the rollout queue, restored from the checkpoint's queued rollouts (``restored``) when given."""
        self.queue = RolloutQueue(self.start, self.ahead, self.cfg.rl.steps)
        if restored is not None:
            self.queue.restore(restored.get("queue", {}), self.manager.submit if self.manager is not None else None)

    def start(self, at: int):
        """Rank 0: starts the rollout of RL step ``at`` -> (prompt indices, rollout in flight): ``rl.n_samples``
        responses per prompt, seeded per step; d-TreeRPO's trees block (their own shape); partial rollouts with a
        queue go in block-aligned segments."""
        cfg, rl, algo, manager = self.cfg, self.cfg.rl, self.spec.algo, self.manager
        grid = self.spec.arch.is_block_diffusion
        indices = self.sampler.batch(at)
        prompts = [self.train_prompts[i].prompt_ids for i in indices]
        params = replace(self.spec.train_sampling, seed=cfg.seed * 100_003 + at)
        if algo.own_rollout:
            return indices, algo.rollout(manager.generate, prompts, params, rl.n_samples, global_grid=grid)
        expanded = [q for q in prompts for _ in range(rl.n_samples)]
        if cfg.offpolicy.partial_rollout and self.ahead:
            segment = cfg.offpolicy.partial_rollout
            return indices, PartialRollout(manager.submit, expanded, params, segment, global_grid=grid)
        return indices, manager.submit(expanded, params)

    def evaluate(self) -> dict[str, float]:
        """Rank 0: held-out accuracy (mean reward) and mean response length under the eval sampling parameters."""
        prompts = self.held_prompts
        if not prompts:
            return {}
        traj = self.manager.generate([p.prompt_ids for p in prompts], self.spec.eval_sampling)
        scores, _ = score_rollouts(self.cfg, self.reward_fn, self.tok, traj, prompts, "held-out evaluation")
        return {
            "accuracy": sum(scores) / len(scores),
            "response_length": sum(len(t.response_ids) for t in traj) / len(traj),
        }

    def collect(self, step: int) -> tuple[list, dict[str, float]]:
        """Rank 0: the queued rollout of RL ``step`` -> rewards -> samples (with their behaviour versions) +
        metrics."""
        cfg, algo, tok, reward_fn, rl = self.cfg, self.spec.algo, self.tok, self.reward_fn, self.cfg.rl
        q, traj, wait_s = self.queue.take(step)
        batch = [self.train_prompts[i] for i in q.batch_indices]
        for tr in traj:
            tr.validate()
        prompts = [b for b in batch for _ in range(rl.n_samples)]
        rewards, rstats = score_rollouts(cfg, reward_fn, tok, traj, prompts, f"RL step {step + 1}")
        samples, metrics = build_samples(cfg, traj, rewards)
        self._warn_if_flat(step, metrics)
        own = algo.samples_from(traj, rewards, rl.n_samples)  # d-TreeRPO: one sample per tree node
        samples = samples if own is None else own
        for s in samples:  # dLLM-RL's post_num (algos/tracerl.py) tells the answer from a full canvas's tail
            s.extra[ANSWER_LENGTH] = len(answer_ids(s.response_ids, tok.eos_token_id))

        def score_ids(responses, indices):
            texts = [tok.decode(answer_ids(r, tok.eos_token_id)) for r in responses]
            return score_texts(
                cfg, reward_fn, texts, [prompts[i] for i in indices], f"RL step {step + 1} (intermediate answers)"
            )[0]

        algo.prepare(samples, score_ids, rl.n_samples)  # MDPO: intermediate answers; TraceRL: step width
        metrics.update({f"reward_{k}": v for k, v in rstats.items()})
        stale = [step - t.policy_version for t in traj]
        off = cfg.offpolicy
        if max(stale) > off.max_staleness:
            oldest = min(t.policy_version for t in traj)
            raise RuntimeError(
                f"the rollout of RL step {step + 1} used policy version {oldest} (the weights after {oldest} steps), "
                f"staler than {cfg.as_written('offpolicy.max_staleness')}={off.max_staleness}: a bug of megadare's "
                "(the queue runs at most that far ahead, and a resume checks the rollouts it restores); please "
                "report it with the run's config.yaml"
            )
        _stamp_versions(samples, traj, step, off.behaviour_logp == "engine")
        metrics.update(staleness_metrics(stale))
        mixed = [len(set(t.token_versions)) > 1 for t in traj if t.token_versions]
        if mixed:
            metrics["async/mixed_version_fraction"] = sum(mixed) / len(mixed)
        engine_s = sum(t.engine_s for t in traj)
        metrics.update(
            rollout_wait_s=wait_s,
            **{"async/rollout_busy_s": engine_s, "async/queue_depth": float(len(self.queue.queue))},
        )
        return samples, metrics

    def _warn_if_flat(self, step: int, metrics: dict) -> None:
        """One stderr line the first time a step has nothing to learn from: every group's rewards equal (zero
        advantage) or every group dropped by the group filters; each step logs ``all_equal_groups`` and
        ``kept_fraction``, and ``flat_steps`` counts such steps."""
        flat = metrics["all_equal_groups"] >= 1.0
        if not flat and metrics["kept_fraction"] > 0.0:
            return
        self.flat_steps += 1
        if self.flat_steps > 1:
            return
        band = self.cfg.advantage.accuracy_band
        why = (
            f"every group's {self.cfg.rl.n_samples} rewards are equal, so every advantage is 0"
            if flat
            else f"{self.cfg.as_written('advantage.accuracy_band')}={band} dropped every group"
        )
        print(
            f"rl: RL step {step + 1}: {why}: this step cannot learn. If it persists (metrics all_equal_groups, "
            "kept_fraction), the task is too hard or too easy for the policy or the reward is constant: check it "
            "with 'megadare data inspect FILE --reward NAME', or raise rl.n_samples",
            file=sys.stderr,
        )

    def shutdown(self) -> None:
        """Rank 0: stop the engines."""
        if self.manager is not None:
            self.manager.shutdown()


def _stamp_versions(samples, traj, step: int, engine_logp: bool) -> None:
    """Each sample's behaviour policy version (per token with partial rollouts), its rollout step and, with
    ``offpolicy.behaviour_logp=engine``, the engine's log-probs."""
    version = [t.policy_version for t in traj]
    for s in samples:
        s.policy_version = version[s.index] if s.index < len(version) else step
        s.extra["rollout_step"] = step
        if s.index < len(traj) and traj[s.index].token_versions:
            s.token_versions = traj[s.index].token_versions
        if engine_logp:
            # per slot of the trace replay: token k, then the commits token edits overwrote (trace_replay.py)
            t = traj[s.index]
            s.engine_logprobs = list(t.logprobs) + [e.logprob for e in t.superseded or []]


def build_samples(cfg: Config, trajectories, rewards: list[float]) -> tuple[list, dict]:
    """RLSamples with advantages (after the group filters) and the step's rollout metrics."""
    a = cfg.advantage
    G = cfg.rl.n_samples
    r = torch.tensor(rewards)
    truncated = torch.tensor([t.finish_reason == "length" for t in trajectories])
    if cfg.rewards.truncated_as_wrong:
        r = truncated_as_wrong(r, truncated)
    keep = filter_groups(r, G, a.filter_all_equal, tuple(a.accuracy_band) if a.accuracy_band else None)
    lengths = [len(t.response_ids) if keep[i] else 0 for i, t in enumerate(trajectories)]  # reinforce_pp's weights
    adv = group_advantages(r, G, a.estimator, a.std, lengths=lengths)
    samples = []
    for i, t in enumerate(trajectories):
        if not keep[i] or not t.response_ids:
            continue
        extra: dict = {"sampling_temperature": t.params.temperature}  # JustGRPO scores at the sampler's T
        if t.step_predictions is not None:
            extra.update(step_predictions=t.step_predictions, step_confidences=t.step_confidences)
        samples.append(
            RLSample(
                prompt_ids=list(t.prompt_ids),
                response_ids=list(t.response_ids),
                reward=float(r[i]),
                advantage=float(adv[i]),
                index=i,
                group=i // G,
                commit_step=list(t.commit_step),
                block_step=list(t.block_step),
                superseded=list(t.superseded or []) or None,
                truncated=bool(truncated[i]),
                extra=extra,
            )
        )
    metrics = {
        "reward": float(r.mean()),
        "reward_std": float(r.std()) if len(r) > 1 else 0.0,
        "kept_fraction": float(keep.float().mean()),
        "all_equal_groups": float(all_equal_groups(r, G).float().mean()),  # zero advantage before any filter
        "truncated": float(truncated.float().mean()),
        "response_length": sum(len(t.response_ids) for t in trajectories) / max(len(trajectories), 1),
        "forwards_per_token": sum(t.num_forwards for t in trajectories)
        / max(sum(len(t.response_ids) for t in trajectories), 1),
    }
    return samples, metrics
