"""The RL loop: prompts -> Ray-managed rollout engines -> rewards -> advantages -> the algorithm's rows ->
Megatron train step(s) -> weight sync -> next step.

    megadare rl --config examples/configs/sdar_tiny.yaml [--nproc N] [key=value ...]

Every rank runs ``run_rl`` (torchrun / Slurm / ``--nproc``); rank 0 owns the Ray engines, scores rewards and
broadcasts the step's samples; all ranks build the same rows (corruptions seeded per (seed, step, sample, epoch)),
take their data-parallel share, and train. Checkpoints hold model, optimizer, scheduler and the RL step; a
restarted run resumes from the newest one and pushes its weights into fresh engines before the first rollout.

Step numbers: ``run.step`` counts the steps trained so far. While a step runs it is the weight version the
engines hold and the 0-based number of that step (its key in the rollout queue, its rollout and corruption
seeds); messages name the step ``run.step + 1`` ("RL step 3" runs at ``run.step`` 2), and its metrics,
evaluation and checkpoint are recorded under ``run.step`` after the increment (3).
"""

from __future__ import annotations

import gc
import time
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Optional

from megadare.algos.sft import example_generator
from megadare.config import Config
from megadare.parallel import destroy_distributed, init_distributed
from megadare.errors import PeerError
from megadare.parallel.rank0 import on_every_rank, run_on_rank0
from megadare.rollout.ray_health import job_stop_errors, lost_to_sigterm
from megadare.trainer.loop import Loop, every
from megadare.trainer.monitor import Monitor
from megadare.trainer.offpolicy.correction import (
    bypass_rejection,
    engine_table,
    oldest_needed,
    version_table,
    with_replayed,
)
from megadare.trainer.policy import ValueModel
from megadare.trainer.rl_setup import RLRun, rl_data, save_run, setup_run
from megadare.trainer.rl_update import Correction, StepUpdate, TrainShape, replay_select
from megadare.trainer.run_lock import run_dir_lock
from megadare.trainer.sft_loop import checkpoint_root
from megadare.trainer.signals import stopping_before_the_loop
from megadare.trainer.spec import RunSpec, launched_world, resolve


def checkpoint_roots(spec: RunSpec) -> tuple[str, ...]:
    """Where the run's checkpoints go, each locked for the run: ``checkpoint_root``, and the value model's beside
    it (``<root>_value``) when the algorithm trains one (a second run saving there would rotate it away)."""
    root = checkpoint_root(spec.cfg)
    return (root, ValueModel.root_of(root)) if spec.algo.value_model is not None else (root,)


def run_rl(cfg: Config, max_steps: Optional[int] = None) -> dict[str, Any]:
    """Train on this rank (torch.distributed from the environment). Returns a summary (same on all ranks).

    set-up -> push weights (version = step) -> eval -> per step: generate -> score -> train -> push weights ->
    log / eval / save. The run directory is locked meanwhile (trainer/run_lock.py); engines and weight-sync
    groups are closed however it ends."""
    spec = resolve(cfg, launched_world(), job="rl")
    cfg = spec.cfg
    with ExitStack() as cleanup:
        cleanup.enter_context(stopping_before_the_loop())  # exited last: after Ray's end and the lock's
        init_distributed(spec.layout, seed=cfg.seed, timeout_s=cfg.parallel.collective_timeout_s)
        cleanup.callback(destroy_distributed)
        data = rl_data(spec)  # before the lock and the tiny model: bad data leaves the run directory as it was
        cleanup.enter_context(run_dir_lock(cfg.logging.run_dir, *checkpoint_roots(spec)))
        run = cleanup.enter_context(rl_run(spec, data))
        if run.step >= cfg.rl.steps:
            return finished_run(run)
        push_weights(run, queued=False)
        start_loop(run)
        if evaluation_due_at_start(run):
            evaluate_at(run)
        loop = Loop(cfg.rl.steps, run.step, run.monitor, max_steps)
        cleanup.callback(loop.close)  # an error too: the bar ends its line, Ctrl-C is Python's again
        cleanup.enter_context(set_up_heap_frozen())
        while loop.running(run.step):
            rl_step(run)
            if loop.every(run.step, cfg.rl.eval_interval):  # before the save: a resumed run does not repeat it
                unless_ray_lost(run, evaluate_at)
            if loop.checkpoint_due(run.step, cfg.checkpoint.save_interval):
                save_run(run)
            if loop.done(run.step):
                break
        if run.step == cfg.rl.steps and run.step not in run.evals:
            unless_ray_lost(run, evaluate_at)
        loop.close()
        return summary(run, loop.stopped)


def evaluation_due_at_start(run: RLRun) -> bool:
    """Whether the run evaluates before its first step: a fresh run (the step-0 baseline), or a resumed one whose
    start step was due an evaluation (``rl.eval_interval``) that its checkpoint does not hold (Ray lost before it).
    One the run logged before its checkpoint is not repeated (two points at one step), and none is added at a step
    that was due none: where the run stopped does not change which steps are evaluated."""
    step, rl_cfg = run.step, run.cfg.rl
    return step not in run.evals and (step == 0 or every(step, rl_cfg.eval_interval, rl_cfg.steps))


@contextmanager
def rl_run(spec: RunSpec, data: Optional[tuple] = None) -> Iterator[RLRun]:
    """The run (``setup_run``, of ``data``: ``rl_data``); its weight-sync groups and engines are closed when it
    ends."""
    run = setup_run(spec, data)
    try:
        yield run
    finally:
        if run.monitor is not None:  # the bar ends its line before the engines' and the error's
            run.monitor.close()
        if run.weight_sync is not None:
            run.weight_sync.close()
        run.rollouts.shutdown()


@contextmanager
def set_up_heap_frozen() -> Iterator[None]:
    """The objects of the set-up (torch, megatron, ray, the model: ~500k on the demo) out of the garbage collector's
    sight while the steps run (``gc.freeze``), back in when they end: every full collection a step triggers would
    otherwise walk them all (~0.4 s each on the demo, ~0.1 s a step). Their garbage is collected first; what they
    let go of meanwhile refcounting frees, cycles among them wait for the end of the loop."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def rl_step(run: RLRun) -> None:
    """One RL step: generate and score -> (replay) -> train -> push the new weights -> log. Ray lost to a SIGTERM
    (``unless_ray_lost``): before the update the step is dropped, after it only the push is."""
    run.monitor.step_timer()
    got = unless_ray_lost(run, generate)
    if got is None:
        return
    samples, metrics = got
    samples, correction = add_replay(run, samples, metrics)
    t0 = time.perf_counter()
    metrics.update(train(run, samples, correction))
    metrics["train_s"] = time.perf_counter() - t0
    run.step += 1
    metrics.update(unless_ray_lost(run, push_weights) or {})
    log_step(run, metrics)


def unless_ray_lost(run: RLRun, work) -> Any:
    """``work(run)``; None (and ``run.ray_lost``) when it raised because Ray went down after this process got
    SIGTERM (``lost_to_sigterm``: the Ray head died, or a call through Ray broke, ``job_stop_errors``): sent to
    every process of the job (Slurm's time limit, ``kill -TERM -- -PGID``), it ended the local Ray too. The run
    then stops on the signal as on SIGINT, its checkpoint saved without Ray: no rollout, no evaluation, no weight
    push (a resumed run pushes its weights into fresh engines)."""
    if run.ray_lost:
        return None
    try:
        return work(run)
    except PeerError as e:
        if not lost_to_sigterm(e):
            raise
        run.ray_lost = True
        return None


def summary(run: RLRun, stopped: bool) -> dict[str, Any]:
    """What ``run_rl`` returns (the CLI prints it)."""
    return {
        "step": run.step,
        "stopped_by_signal": stopped,
        "history": run.history,
        "evals": run.evals,
        "checkpoint_root": run.save_root,
    }


def finished_run(run: RLRun) -> dict[str, Any]:
    """The summary of a run resumed at its last step (nothing to train: the CLI says so)."""
    return {
        "step": run.step,
        "stopped_by_signal": False,
        "history": [],
        "evals": run.evals,
        "checkpoint_root": run.save_root,
        "already_finished": True,
    }


def push_weights(run: RLRun, queued: bool = True) -> dict[str, float]:
    """Sync the trainer's weights into every engine as version ``run.step`` (``rollout.weight_transport``; with
    LoRA the engines get W + s B A); ``queued``: the rollout queue exists and its partial rollouts then continue
    on them. Returns the sync metrics (bytes, seconds, GB/s, buckets, wall seconds)."""
    t0 = time.perf_counter()
    stats = on_every_rank(lambda: push_or_lost(run))  # a rank whose part broke: every rank raises its error
    if queued:
        on_rank0(run, lambda: advance_queue(run))
    return {**stats, "sync_s": time.perf_counter() - t0}


def push_or_lost(run: RLRun) -> dict[str, float]:
    """``push_current`` on this rank, the step's push and a repeat push alike; broken after this process got
    SIGTERM, its error is ``LostToSigterm`` (``job_stop_errors``: the run stops on the signal and saves,
    ``unless_ray_lost``). Every rank drops the push when Ray is gone before it (rank 0's check_engines, in the
    push's header)."""
    with job_stop_errors(f"the weight push of version {run.step}"):
        return push_current(run)


def advance_queue(run: RLRun) -> None:
    """Rank 0: the rollout queue moves on to the pushed weights (it submits the next rollouts through Ray)."""
    with job_stop_errors(f"the rollouts queued after the weight push of version {run.step}"):
        run.rollouts.queue.advance()


def push_current(run: RLRun) -> dict[str, float]:
    """The one push of the current weights as version ``run.step`` (collective), for the step's sync and for a
    repeat push to restarted engines alike: with LoRA inside ``merged_weights``, so the engines get W + s B A."""
    return run.policy.push(run.weight_sync, run.step)


def collect_checked(run: RLRun) -> tuple[list, dict[str, float]]:
    """Rank 0: this step's rollouts, once the Ray head is known alive (``ray_check``); broken after a SIGTERM, its
    error is ``LostToSigterm`` (``job_stop_errors``)."""
    with job_stop_errors(f"the rollout of RL step {run.step + 1}"):
        ray_check(run)
        return run.rollouts.collect(run.step)


def ray_check(run: RLRun) -> None:
    """Rank 0: raise the ``PeerError`` of a dead Ray head before a call through it (``GcsWatch.check``)."""
    watch = getattr(run.manager, "gcs", None)
    if watch is not None:
        watch.check()


def on_rank0(run: RLRun, work):
    """``work()`` on rank 0 (the engines' owner) while the other ranks stand by to push the current weights again
    should every engine have been restarted meanwhile; its result on every rank."""
    return run_on_rank0(work, lambda: push_or_lost(run), run.manager)


def start_loop(run: RLRun) -> None:
    """The monitor and (rank 0) the rollout queue, restored from the checkpoint's queued rollouts."""
    cfg = run.cfg
    run.monitor = Monitor(cfg.logging, cfg.rl.steps, start_step=run.step, desc="rl")
    if run.rank0:
        run.rollouts.open_queue(run.async_state)


def generate(run: RLRun) -> tuple[list, dict[str, float]]:
    """The step's scored samples on every rank: rank 0 takes the queued rollout and scores it, then broadcasts.
    The rollout was started by the queue (``Rollouts.start`` through ``RolloutQueue.take``): by this very take in
    sync mode and at a run's first step, else by an earlier step's take, so it ran while that step trained. With
    async correction, the weights of this version are snapshotted first (behaviour of rollouts queued now)."""
    t0 = time.perf_counter()
    if run.snapshots is not None:
        held = run.buffer.versions if run.buffer is not None else ()
        run.snapshots.keep_from(oldest_needed(run.cfg, run.step, run.ahead, held))
        run.snapshots.take(run.step)
    samples, metrics = on_rank0(run, lambda: collect_checked(run))
    metrics["rollout_s"] = time.perf_counter() - t0
    return samples, metrics


def add_replay(run: RLRun, samples: list, metrics: dict) -> tuple[list, Any]:
    """Off-policy correction state of the step (None under plain PPO) and, with D-ARL replay, the step's
    samples plus the best-matched replayed ones (the fresh samples join the buffer)."""
    cfg = run.cfg
    if cfg.offpolicy.loss_mode == "ppo":
        return samples, None
    correction = Correction({}, run.step, run.snapshots)
    if run.buffer is not None:
        want = int(round(cfg.replay.fraction * len(samples)))
        replayed = replay_select(_step_update(run), run.buffer, want, correction)
        samples = with_replayed(run.buffer, samples, replayed)
        metrics.update(correction.metrics)
    correction.version_of = version_table(samples)
    correction.token_versions = {s.index: s.token_versions for s in samples if s.token_versions is not None}
    correction.engine_logprobs = engine_table(samples) if cfg.offpolicy.behaviour_logp == "engine" else None
    return samples, correction


def train(run: RLRun, samples: list, correction) -> dict[str, float]:
    """``rl.ppo_epochs`` x ``rl.mini_batches`` Megatron steps on the algorithm's rows of ``samples`` (fewer mini-
    batches when the step kept fewer prompt groups than ``rl.mini_batches``, none when it kept none; the value
    model, if any, steps with each). The learning-rate schedule then stands where this step's end is due."""
    rl, off, pol = run.cfg.rl, run.cfg.offpolicy, run.policy
    out: dict[str, float] = {}
    if samples:
        objective = run.algo.objective(
            on_policy=(rl.ppo_epochs * rl.mini_batches == 1 and off.loss_mode == "ppo"), loss_mode=off.loss_mode
        )
        if off.loss_mode == "bypass" and off.rollout_is is not None:
            objective.reject = bypass_rejection(run.cfg)
        out = pol.update(_step_update(run), samples, objective, correction)
    catch_up_schedule(pol.scheduler, (run.step + 1) * rl.ppo_epochs * rl.mini_batches)
    return out


def catch_up_schedule(scheduler, due: int) -> None:
    """Move the learning-rate schedule (megatron's ``OptimizerParamScheduler``, sized for rl.steps x ppo_epochs x
    mini_batches updates) on to the ``due`` updates of the RL steps done so far: a step whose filters kept fewer
    prompt groups than ``rl.mini_batches`` (or none) makes fewer updates, and without this the warmup and decay
    would lag behind the RL steps for the rest of the run (the decay never reaching ``optim.min_lr``)."""
    if scheduler.num_steps < due:
        scheduler.step(increment=due - scheduler.num_steps)


def log_step(run: RLRun, metrics: dict[str, float]) -> None:
    """Step time, idle ratios; into the history (every step), tensorboard and JSONL (every
    ``logging.log_interval`` steps: ``Monitor.log``)."""
    metrics["step_time_s"] = step_s = run.monitor.step_timer()
    metrics["async/trainer_idle_ratio"] = metrics.get("rollout_wait_s", 0.0) / max(step_s, 1e-9)
    metrics["async/rollout_idle_ratio"] = max(
        0.0, 1.0 - metrics.get("async/rollout_busy_s", 0.0) / max(run.cfg.rollout.num_engines * step_s, 1e-9)
    )
    run.history.append(metrics)
    run.monitor.log(run.step, metrics)


def evaluate_at(run: RLRun) -> None:
    """Held-out accuracy at ``run.step`` (rank 0 runs it on the engines; every rank records it)."""
    res = on_rank0(run, lambda: evaluate_checked(run))
    if res:
        run.evals[run.step] = res
        run.monitor.log(run.step, {f"eval/{k}": v for k, v in res.items()}, advance=False)


def evaluate_checked(run: RLRun) -> dict[str, float]:
    """Rank 0: the held-out evaluation (``Rollouts.evaluate``, trainer/rl_rollout.py); broken after a SIGTERM, its
    error is ``LostToSigterm`` (``job_stop_errors``)."""
    with job_stop_errors(f"the held-out evaluation at RL step {run.step}"):
        return run.rollouts.evaluate()


def _step_update(run: RLRun):
    """What this step's update works from (``rl_update.StepUpdate``), with the run's ``TrainShape``."""
    spec = run.spec
    shape = TrainShape(
        spec.arch,
        spec.train_sampling.block_size,
        spec.arch.training_mask,
        _pad_id(run),
        run.spec.layout.micro_batch_multiple,
        run.policy.model,
        example_generator,
    )
    return StepUpdate(run.cfg, run.algo, run.step, shape)


def _pad_id(run: RLRun) -> int:
    return getattr(run.rollouts.tok, "pad_token_id", 0) or 0


def rl_worker(rank: int, world: int, cfg: Config, max_steps: Optional[int] = None) -> dict[str, Any]:
    """Entry for megadare.parallel.launch.spawn (local multi-process runs, tests)."""
    return run_rl(cfg, max_steps=max_steps)


__all__ = ["run_rl", "rl_worker"]
