"""Asynchronous RL plumbing: the rollout queue (how far rollouts run ahead of training) and the weight snapshots
of the behaviour policies the trainer still needs.

Modes (``offpolicy.mode``), counted in policy versions (version v = the weights after v RL steps, each of
``rl.ppo_epochs`` x ``rl.mini_batches`` optimizer updates; the engines hold version v while RL step v trains,
counted from 0):

    sync          rollout of step k submitted at step k                      lookahead 0, staleness 0
    one_step_off  rollout of step k+1 submitted at step k, before training   lookahead 1, staleness <= 1
    fully_async   rollouts of steps k+1 .. k+s in flight at once             lookahead s = offpolicy.max_staleness

A rollout submitted while the engines hold version v is served before any later weight update (Ray runs an
actor's calls in order), so its trajectories carry version v and are consumed at step v + d with d <= lookahead:
staleness d (verl ``one_step_off_policy`` / ``fully_async_policy``, AReaL's bounded staleness).

Partial rollouts (``offpolicy.partial_rollout = n`` blocks, modes with lookahead): a queued rollout is generated n blocks
at a time; after every weight update the queue collects each running segment and submits the next one on the new
weights (prompt ++ the response so far), so a response's blocks may come from several versions
(``Trajectory.token_versions``; the trajectory's ``policy_version`` is its oldest token's, which bounds
its staleness). Segments end on block boundaries of the model's grid (block families: the global
prompt+response grid, so the first segment of a prompt with P mod B = r tokens is n*B - r long; full attention:
blocks counted from the response start), so no block is ever split between versions and the stitched trace --
commit steps offset by the earlier segments' forwards -- is a valid trace of one decoding.

Snapshots: with ``offpolicy.loss_mode`` decoupled or bypass and ``offpolicy.behaviour_logp=trainer`` the behaviour log-probs
of a stale sample are the algorithm's own estimator evaluated with the weights of the version that generated it;
the trainer keeps a CPU copy of its local parameter shards for every version still referenced (lookahead or the
replay window) and swaps it in for that forward pass. Cost: one copy of the local shards per retained version.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Optional

import torch

LOOKAHEAD = {"sync": 0, "one_step_off": 1}
PARTIAL_STATE = "partial_rollout"  # the key of a checkpointed partial rollout (``PartialRollout.state_dict``)


def lookahead(mode: str, max_staleness: int) -> int:
    """Rollouts in flight ahead of the step being trained."""
    return LOOKAHEAD.get(mode, max_staleness)


@dataclass
class QueuedRollout:
    step: int  # the RL step that will train on it
    batch_indices: list[int]  # prompt indices (StepSampler.batch(step))
    pending: Any = None  # PendingRollout / PartialRollout, or the finished trajectories


class PartialRollout:
    """One queued rollout generated in block-aligned segments (see the module docstring). ``submit(prompts,
    params)`` is ``RolloutManager.submit``; ``advance()`` collects the running segments and submits the next;
    ``result()`` drives it to the end and returns the stitched trajectories in prompt order."""

    def __init__(self, submit: Callable, prompts: list[list[int]], params, blocks: int, global_grid: bool):
        self.submit, self.prompts, self.params = submit, prompts, params
        B = params.block_size
        self.first = [blocks * B - (len(p) % B if global_grid else 0) for p in prompts]
        self.every = blocks * B
        self.parts: list[list] = [[] for _ in prompts]  # per prompt: its segments' trajectories
        self.done = [False] * len(prompts)
        self.rounds = 0
        self.inflight: list[tuple[list[int], Any]] = []
        self._submit_next()

    def _length(self, i: int) -> int:
        return sum(len(t.response_ids) for t in self.parts[i])

    def _submit_next(self) -> None:
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(self.prompts):
            left = self.params.max_new_tokens - self._length(i)
            if self.done[i] or left <= 0:
                self.done[i] = True
                continue
            seg = min(self.first[i] if not self.parts[i] else self.every, left)
            groups.setdefault(seg, []).append(i)
        self.inflight = []
        for seg, idx in sorted(groups.items()):
            params = replace(self.params, max_new_tokens=seg, seed=self.params.seed + 7919 * self.rounds)
            prompts = [self.prompts[i] + [t for tr in self.parts[i] for t in tr.response_ids] for i in idx]
            self.inflight.append((idx, self.submit(prompts, params)))
        self.rounds += 1

    def collect(self) -> None:
        """Wait for the running segments and keep them, submitting nothing: what ``advance`` does first, and a
        checkpoint's whole part (the next segments go on the weights of the next update, as without it)."""
        for idx, fut in self.inflight:
            for i, tr in zip(idx, fut.result()):
                self.parts[i].append(tr)
                if tr.finish_reason != "length" or not tr.response_ids:
                    self.done[i] = True
        self.inflight = []

    def finished(self) -> bool:
        return not self.inflight and all(
            d or self.params.max_new_tokens <= self._length(i) for i, d in enumerate(self.done)
        )

    def advance(self) -> None:
        if self.finished():
            return
        self.collect()
        self._submit_next()

    def result(self) -> list:
        while not self.finished():
            self.advance()
        return [self._stitch(i) for i in range(len(self.prompts))]

    def state_dict(self) -> dict[str, Any]:
        """The rollout for a checkpoint (``collect`` first: nothing running): prompts, parameters, segments so far."""
        assert not self.inflight, "collect() the running segments first"
        keep = ("prompts", "params", "first", "every", "parts", "done", "rounds")
        return {PARTIAL_STATE: {k: getattr(self, k) for k in keep}}

    @classmethod
    def from_state(cls, submit: Callable, state: dict[str, Any]) -> "PartialRollout":
        """A checkpoint's rollout (``state_dict``) going on through ``submit``: its next segment at the next
        ``advance`` / ``result``, on the weights the engines then hold (as the saved run's would have been)."""
        out = cls.__new__(cls)
        out.submit, out.inflight = submit, []
        out.__dict__.update(state[PARTIAL_STATE])
        return out

    def _stitch(self, i: int):
        segs = self.parts[i]
        out = replace(
            segs[0],
            prompt_ids=list(self.prompts[i]),
            response_ids=[],
            commit_step=[],
            block_step=[],
            logprobs=[],
            params=self.params,
            extra=dict(segs[0].extra),
            superseded=[] if any(t.superseded is not None for t in segs) else None,
        )
        versions: list[int] = []
        offset = 0
        for tr in segs:
            if out.superseded is not None:  # token editing: positions and steps on the stitched grid
                out.superseded += [
                    e._replace(position=e.position + len(out.response_ids), commit_step=e.commit_step + offset)
                    for e in tr.superseded or []
                ]
            out.response_ids += tr.response_ids
            out.commit_step += [c + offset for c in tr.commit_step]
            out.block_step += tr.block_step
            out.logprobs += tr.logprobs
            versions += [tr.policy_version] * len(tr.response_ids)
            offset += tr.num_forwards
        out.num_forwards, out.finish_reason = offset, segs[-1].finish_reason
        out.policy_version = min(versions, default=segs[0].policy_version)
        out.token_versions = versions
        out.engine_s = sum(t.engine_s for t in segs)
        return out


class RolloutQueue:
    """Rank 0's rollouts in flight, keyed by the step that trains on them."""

    def __init__(self, start: Callable[[int], tuple[list[int], Any]], ahead: int, last_step: int):
        self.start, self.ahead, self.last_step = start, ahead, last_step
        self.queue: dict[int, QueuedRollout] = {}
        self.floor = 0

    def _ensure(self, upto: int) -> None:
        for k in range(self.floor, min(upto, self.last_step - 1) + 1):
            if k not in self.queue:
                indices, pending = self.start(k)
                self.queue[k] = QueuedRollout(k, indices, pending)

    def take(self, step: int) -> tuple[QueuedRollout, list, float]:
        """(the queued rollout of ``step``, its trajectories, seconds waited); then tops the queue up to
        ``step + ahead`` on the weights the engines hold now (before this step's update)."""
        for k in [k for k in self.queue if k < step]:  # a checkpoint's of steps already trained (older megadare)
            del self.queue[k]
        self.floor = step
        self._ensure(step)
        q = self.queue.pop(step)
        self.floor = step + 1  # taken: topping up starts the steps after it, never this one again
        t0 = time.perf_counter()
        fut = q.pending
        traj = fut.result() if hasattr(fut, "result") else fut
        wait = time.perf_counter() - t0
        self._ensure(step + self.ahead)
        return q, traj, wait

    def advance(self) -> None:
        """After a weight update: partial rollouts collect their running segment and continue on the new weights."""
        for k in sorted(self.queue):
            if isinstance(self.queue[k].pending, PartialRollout):
                self.queue[k].pending.advance()

    def drain(self, finish: bool = True) -> dict[int, tuple[list[int], Any]]:
        """The queued rollouts for a checkpoint: {step: (prompt indices, trajectories)}, each finished first (the
        queue keeps them, now finished); a partial rollout only collects its running segments and is saved as
        ``PartialRollout.state_dict`` (finished here, its later segments ran on older weights than without the
        checkpoint: a run saving at another step trained on other rollouts). ``finish=False`` (the engines are
        gone): only those already finished or between segments; a resumed run starts the others again."""
        out = {}
        for k, q in sorted(self.queue.items()):
            if isinstance(q.pending, PartialRollout):
                if finish:
                    q.pending.collect()
                if not q.pending.inflight:
                    out[k] = (q.batch_indices, q.pending.state_dict())
                continue
            if hasattr(q.pending, "result") and finish:
                q.pending = q.pending.result()
            if not hasattr(q.pending, "result"):
                out[k] = (q.batch_indices, q.pending)
        return out

    def restore(self, state: dict[int, tuple[list[int], Any]], submit: Optional[Callable] = None) -> None:
        """The queued rollouts of a checkpoint (``drain``); its partial rollouts go on through ``submit``
        (``RolloutManager.submit``)."""
        for k, (indices, traj) in state.items():
            if isinstance(traj, dict) and PARTIAL_STATE in traj:
                if submit is None:
                    raise ValueError("restoring a partial rollout needs the engines' submit")
                traj = PartialRollout.from_state(submit, traj)
            self.queue[int(k)] = QueuedRollout(int(k), list(indices), traj)


class WeightSnapshots:
    """CPU copies of this rank's local parameter shards, one per policy version still needed."""

    def __init__(self, chunks: list[torch.nn.Module]):
        self.params = [p for c in chunks for p in c.parameters()]
        self.store: dict[int, list[torch.Tensor]] = {}

    def take(self, version: int) -> None:
        self.store[version] = [p.detach().to("cpu", copy=True) for p in self.params]

    def keep_from(self, oldest: int) -> None:
        for v in [v for v in self.store if v < oldest]:
            del self.store[v]

    @contextlib.contextmanager
    def swapped_in(self, version: int) -> Iterator[None]:
        """The model holds version ``version``'s weights inside the block and its own weights again after it."""
        if version not in self.store:
            raise RuntimeError(  # a resume that would get here is refused (correction.restored_queue_problem)
                f"no weight snapshot of policy version {version} (have {sorted(self.store)}): a bug of megadare's "
                "(the snapshots kept do not cover the samples trained); please report it with the run's config.yaml"
            )
        saved = [p.detach().clone() for p in self.params]
        try:
            with torch.no_grad():
                for p, s in zip(self.params, self.store[version]):
                    p.copy_(s)
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved):
                    p.copy_(s)

    def state_dict(self) -> dict[int, list[torch.Tensor]]:
        return dict(self.store)

    def load_state_dict(self, state: dict[int, list[torch.Tensor]]) -> None:
        self.store = {int(k): v for k, v in state.items()}

    def misfit(self, state: dict[int, list[torch.Tensor]]) -> Optional[str]:
        """Why ``state`` (a checkpoint's ``state_dict``) is not snapshots of this rank's shards, in words (another
        parallel layout shards the parameters otherwise); None when it fits."""
        want = [tuple(p.shape) for p in self.params]
        for version, tensors in sorted(state.items()):
            got = [tuple(t.shape) for t in tensors]
            if got != want:
                first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                shapes = (
                    f"{got[first] if first < len(got) else 'none'} vs {want[first] if first < len(want) else 'none'}"
                )
                return (
                    f"its snapshot of policy version {version} holds {len(got)} tensors, this rank has {len(want)} "
                    f"parameters (the {first}th: {shapes})"
                )
        return None


def staleness_metrics(stale: list[int], prefix: str = "async/") -> dict[str, float]:
    """Mean / max and the histogram (one scalar per staleness value) of the trajectories' staleness."""
    out = {
        f"{prefix}staleness_mean": sum(stale) / max(len(stale), 1),
        f"{prefix}staleness_max": float(max(stale, default=0)),
    }
    for d in sorted(set(stale)):
        out[f"{prefix}staleness_hist/{d}"] = stale.count(d) / len(stale)
    return out


__all__ = ["lookahead", "RolloutQueue", "PartialRollout", "QueuedRollout", "WeightSnapshots", "staleness_metrics"]
