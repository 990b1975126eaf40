"""The RL loop: prompts -> Ray-managed rollout engines -> rewards -> advantages -> the algorithm's rows ->
Megatron train step(s) -> weight sync -> next step.

    megadare rl --config examples/configs/rl_sdar_tiny.yaml [--nproc N] [key=value ...]

Every rank runs this function (torchrun / Slurm / ``--nproc``); rank 0 owns the Ray engines, scores rewards and
broadcasts the step's samples; all ranks build the same rows (corruptions seeded per (seed, step, sample)), take
their data-parallel share, and train. Checkpoints hold model, optimizer, scheduler and the RL step; a restarted
run resumes from the newest one and pushes its weights into fresh engines before the first rollout.
"""
from __future__ import annotations

import os
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from megadare.config import Config, to_yaml
from megadare.errors import ConfigError


def sampling_params(cfg: Config, arch, seed: int, evaluation: bool = False, record_steps: bool = False):
    """The rollout's SamplingParams (block size checked against the model's)."""
    from megadare.rollout.engine import SamplingParams

    r = cfg.rollout
    block = r.block_size or (arch.block_size if arch.attention == "block_causal" else 32)
    if arch.attention == "block_causal" and block != arch.block_size:
        raise ConfigError(f"rollout.block_size={block} differs from the model's block size {arch.block_size}: the "
                          "sampler, the trainer and the model must agree (set model.block_size to change it)")
    return SamplingParams(max_new_tokens=r.max_new_tokens, block_size=block,
                          steps_per_block=r.steps_per_block or block, algorithm=r.algorithm, threshold=r.threshold,
                          temperature=r.eval_temperature if evaluation else r.temperature, top_k=r.top_k,
                          top_p=r.top_p, seed=seed, record_steps=record_steps and not evaluation)


def score(reward_fn, tok, trajectories, records) -> tuple[list[float], dict[str, float]]:
    """Rewards of decoded responses (one implementation for RL and evaluation)."""
    from megadare.rewards import score_batch

    texts = [tok.decode(t.response_ids) for t in trajectories]
    scores, stats = score_batch(reward_fn, texts, records)
    return [float(x) for x in scores], {k: float(v) for k, v in stats.to_dict().items()
                                       if k in ("errors", "timeouts", "wall_s")}


def evaluate(manager, tok, reward_fn, prompts, params) -> dict[str, float]:
    """Held-out accuracy (mean reward) and mean response length under ``params``."""
    if not prompts:
        return {}
    traj = manager.generate([p.prompt_ids for p in prompts], params)
    scores, _ = score(reward_fn, tok, traj, [p.record for p in prompts])
    return {"accuracy": sum(scores) / len(scores),
            "response_length": sum(len(t.response_ids) for t in traj) / len(traj)}


def build_samples(cfg: Config, trajectories, rewards: list[float]) -> tuple[list, dict]:
    """RLSamples with advantages (after the group filters) and the step's rollout metrics."""
    from megadare.algos.advantages import filter_groups, group_advantages, truncated_as_wrong
    from megadare.algos.base import RLSample

    rl = cfg.rl
    G = rl.n_samples
    r = torch.tensor(rewards)
    truncated = torch.tensor([t.finish_reason == "length" for t in trajectories])
    if rl.truncated_as_wrong:
        r = truncated_as_wrong(r, truncated)
    adv = group_advantages(r, G, rl.advantage, rl.advantage_std)
    keep = filter_groups(r, G, rl.filter_all_equal, tuple(rl.accuracy_band) if rl.accuracy_band else None)
    samples = []
    for i, t in enumerate(trajectories):
        if not keep[i] or not t.response_ids:
            continue
        extra = {}
        if t.step_predictions is not None:
            extra = {"step_predictions": t.step_predictions, "step_confidences": t.step_confidences}
        samples.append(RLSample(prompt_ids=list(t.prompt_ids), response_ids=list(t.response_ids), reward=float(r[i]),
                                advantage=float(adv[i]), index=i, group=i // G, commit_step=list(t.commit_step),
                                block_step=list(t.block_step), truncated=bool(truncated[i]), extra=extra))
    metrics = {"reward": float(r.mean()), "reward_std": float(r.std()) if len(r) > 1 else 0.0,
               "kept_fraction": float(keep.float().mean()), "truncated": float(truncated.float().mean()),
               "response_length": sum(len(t.response_ids) for t in trajectories) / max(len(trajectories), 1),
               "forwards_per_token": sum(t.num_forwards for t in trajectories)
               / max(sum(len(t.response_ids) for t in trajectories), 1)}
    return samples, metrics


def run_rl(cfg: Config, max_steps: Optional[int] = None) -> dict[str, Any]:
    """Train on this rank (torch.distributed from the environment). Returns a summary (same on all ranks)."""
    from megadare.algos import build_algorithm
    from megadare.algos.sft import example_generator
    from megadare.config import validate
    from megadare.convert import mapping_for
    from megadare.data.prompt_data import build_prompts, load_prompt_splits
    from megadare.parallel import destroy_distributed, init_distributed
    from megadare.rewards import load_reward
    from megadare.rollout.weight_sync import sync_weights
    from megadare.algos.replay import ReplayBuffer
    from megadare.trainer.checkpoint import (latest_checkpoint, load_checkpoint_object, load_train_checkpoint,
                                             save_train_checkpoint)
    from megadare.trainer.rl_async import PartialRollout, RolloutQueue, WeightSnapshots, lookahead
    from megadare.trainer.rl_correction import (bypass_rejection, check_correction_config, engine_table,
                                                needs_snapshots, oldest_needed, reindex, version_table)
    from megadare.trainer.rl_update import Correction, build_value_model, replay_select, update
    from megadare.trainer.data_order import StepSampler
    from megadare.trainer.model_setup import build_training_chunks, resolve_model_source, tokenizer_for
    from megadare.trainer.monitor import Monitor
    from megadare.trainer.optim import OptimSettings, build_optimizer, wrap_ddp
    from megadare.trainer.signals import StopSignal

    p, t, rl = cfg.parallel, cfg.train, cfg.rl
    # aux-loss-free expert biases (LLaDA2) stay frozen during RL: the rollout engines route with the synced bias,
    # and forward-only passes (old / reference log-probs) must not feed the balancing statistics
    t.moe_bias_update_rate = 0.0
    if p.cp > 1:
        raise ConfigError("parallel.cp > 1 is not supported by the RL loop yet (slot estimates would span CP ranks)")
    init_distributed(tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, etp=p.etp, cp=p.cp, sp=p.sp, seed=cfg.seed)
    manager = None
    try:
        src = resolve_model_source(cfg)
        arch = src.arch
        validate(cfg, arch, dist.get_world_size())
        algo = build_algorithm(cfg.algo.name, dict(cfg.algo.params))
        ahead = lookahead(rl.mode, rl.max_staleness)
        check_correction_config(cfg, algo, arch, ahead)
        tok = tokenizer_for(cfg, src)
        reward_fn = load_reward(rl.reward)
        train_recs, held_recs, source = load_prompt_splits(cfg.data, rl, cfg.seed)
        train_prompts = build_prompts(train_recs, tok, source, cfg.data.prompt_key, rl.answer_key,
                                      cfg.data.messages_key)
        held_prompts = build_prompts(held_recs, tok, source + " (held-out)", cfg.data.prompt_key, rl.answer_key,
                                     cfg.data.messages_key)
        block = sampling_params(cfg, arch, 0).block_size
        kind = "block_diffusion" if arch.attention == "block_causal" else "bidirectional"
        if algo.needs_step_predictions and block < cfg.rollout.max_new_tokens:
            raise ConfigError(f"algo.name={algo.name} scores every intermediate answer, so the whole response must be "
                              f"one block: rollout.block_size={block} < rollout.max_new_tokens="
                              f"{cfg.rollout.max_new_tokens} (a full-attention family with rollout.block_size >= "
                              "max_new_tokens)")

        def load_init(chunks):
            if cfg.checkpoint.load:
                load_train_checkpoint(cfg.checkpoint.load, chunks, None, None, load_optimizer=False)

        chunks = build_training_chunks(cfg, src)
        load_init(chunks)
        model = wrap_ddp(chunks, t.distributed_optimizer)
        updates = rl.steps * rl.ppo_epochs * rl.mini_batches
        optimizer, scheduler = build_optimizer(model, OptimSettings(
            lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad, warmup_steps=t.warmup_steps,
            lr_decay_style=t.lr_decay_style, total_steps=updates, distributed_optimizer=t.distributed_optimizer,
            dtype=cfg.model.dtype))
        ref_chunks = None
        if algo.needs_ref:
            ref_chunks = build_training_chunks(cfg, src)
            load_init(ref_chunks)
            for c in ref_chunks:
                c.eval().requires_grad_(False)

        save_root = cfg.checkpoint.save or os.path.join(cfg.logging.run_dir, "ckpt")
        value = None
        if algo.p.get("value_model"):
            value = build_value_model(cfg, src, algo, load_init, updates)
        snapshots = WeightSnapshots(model) if needs_snapshots(cfg, ahead) else None
        buffer = ReplayBuffer(cfg.replay.k, cfg.replay.warmup) if cfg.replay.enable else None
        step = 0
        resume_from = latest_checkpoint(save_root)
        async_state = None
        if resume_from:
            step = int(load_train_checkpoint(resume_from, model, optimizer, scheduler)["step"])
            if value is not None:
                load_train_checkpoint(latest_checkpoint(save_root + "_value"), *value)
            async_state = load_checkpoint_object(resume_from, "rl_async")
            if snapshots is not None:
                snaps = load_checkpoint_object(resume_from, "weight_snapshots", per_rank=True)
                if snaps is None and ahead:
                    raise RuntimeError(f"{resume_from} has no weight snapshots for this rank (a different layout or "
                                       "rl.loss_mode?): the queued stale rollouts cannot be corrected")
                snapshots.load_state_dict(snaps or {})
            if buffer is not None and async_state is not None and async_state.get("replay"):
                buffer.load_state_dict(async_state["replay"])
        rank0 = dist.get_rank() == 0
        if rank0:
            os.makedirs(cfg.logging.run_dir, exist_ok=True)
            with open(os.path.join(cfg.logging.run_dir, "config.yaml"), "w") as f:
                f.write(to_yaml(cfg))
            manager = _start_engines(cfg, src, tok)
        table = mapping_for(src.hf_config)[2]
        bucket = cfg.rollout.bucket_mb << 20
        fp8 = (128, 128) if cfg.rollout.fp8_weights else None
        sync_weights(model, table, [manager] if rank0 else [], version=step, bucket_bytes=bucket, fp8_block=fp8)

        sampler = StepSampler(len(train_prompts), rl.prompts_per_step, cfg.seed, cfg.data.shuffle)
        monitor = Monitor(cfg.logging.run_dir, rl.steps, start_step=step, tensorboard=cfg.logging.tensorboard,
                          jsonl=cfg.logging.jsonl, log_interval=cfg.logging.log_interval, desc="rl")
        eval_params = sampling_params(cfg, arch, cfg.seed, evaluation=True)
        evals: dict[int, dict] = {}

        def run_eval(at: int) -> None:
            res = [evaluate(manager, tok, reward_fn, held_prompts, eval_params) if rank0 else None]
            dist.broadcast_object_list(res, src=0)
            if res[0]:
                evals[at] = res[0]
                monitor.log(at, {f"eval/{k}": v for k, v in res[0].items()}, advance=False)

        run_eval(step)
        stopper = StopSignal()
        meta = {"family": src.family.name, "architecture": arch.architecture, "written_by": "megadare rl",
                "algo": algo.name}
        objective = algo.objective(on_policy=(rl.ppo_epochs * rl.mini_batches == 1 and rl.loss_mode == "ppo"),
                                   loss_mode=rl.loss_mode)
        if rl.loss_mode == "bypass" and rl.rollout_is is not None:
            objective.reject = bypass_rejection(cfg)
        pad_id = getattr(tok, "pad_token_id", 0) or 0
        multiple = p.pp if (p.vpp or 1) > 1 else 1
        history: list[dict[str, float]] = []
        start_step, stopped = step, False

        def start_rollout(at: int):
            """(prompt indices, rollout in flight) of RL step ``at`` (rank 0)."""
            indices = sampler.batch(at)
            prompts = [train_prompts[i].prompt_ids for i in indices]
            params = sampling_params(cfg, arch, seed=cfg.seed * 100_003 + at, record_steps=algo.needs_step_predictions)
            if hasattr(algo, "rollout"):  # algorithms with their own rollout shape (d-TreeRPO's trees): blocking
                return indices, algo.rollout(manager.generate, prompts, params, rl.n_samples)
            expanded = [q for q in prompts for _ in range(rl.n_samples)]
            if rl.partial_rollout and ahead:
                return indices, PartialRollout(manager.submit, expanded, params, rl.partial_rollout,
                                               global_grid=arch.attention == "block_causal")
            return indices, manager.submit(expanded, params)

        queue = RolloutQueue(start_rollout, ahead, rl.steps) if rank0 else None
        if rank0 and async_state is not None:
            queue.restore(async_state.get("queue", {}))
        while step < rl.steps:
            monitor.step_timer()
            t0 = time.perf_counter()
            if snapshots is not None:  # the weights of version `step` (behaviour of rollouts queued now)
                snapshots.keep_from(oldest_needed(cfg, step, ahead))
                snapshots.take(step)
            payload: list[Any] = [None]
            if rank0:
                payload = [_collect(cfg, algo, queue, step, train_prompts, tok, reward_fn)]
            dist.broadcast_object_list(payload, src=0)
            samples, metrics = payload[0]
            metrics["rollout_s"] = time.perf_counter() - t0
            correction = None
            if rl.loss_mode != "ppo":
                correction = Correction({}, step, snapshots)
                if buffer is not None:
                    want = int(round(cfg.replay.fraction * len(samples)))
                    replayed = replay_select(cfg, algo, buffer, want, step, arch, block, kind, pad_id, multiple,
                                             model, example_generator, correction)
                    buffer.add(samples)
                    samples = samples + reindex(replayed, samples)
                    metrics.update(correction.metrics)
                correction.version_of = version_table(samples)
                correction.token_versions = {s.index: s.extra["token_versions"] for s in samples
                                             if "token_versions" in s.extra}
                correction.engine_logprobs = engine_table(samples) if rl.behaviour_logp == "engine" else None
            if samples:
                metrics.update(update(cfg, algo, samples, step, arch, block, kind, pad_id, multiple, model, ref_chunks,
                                      optimizer, scheduler, objective, example_generator, value, correction))
            t1 = time.perf_counter()
            step += 1
            metrics.update({f"sync_{k[5:]}" if k.startswith("sync_") else k: v for k, v in
                            sync_weights(model, table, [manager] if rank0 else [], version=step,
                                         bucket_bytes=bucket, fp8_block=fp8).items()})
            if rank0:
                queue.advance()  # partial rollouts continue on the new weights
            metrics["sync_s"] = time.perf_counter() - t1
            metrics["step_time_s"] = monitor.step_timer()
            metrics["async/trainer_idle_ratio"] = metrics.get("rollout_wait_s", 0.0) / max(metrics["step_time_s"], 1e-9)
            metrics["async/rollout_idle_ratio"] = max(0.0, 1.0 - metrics.get("async/rollout_busy_s", 0.0) / max(
                cfg.rollout.num_engines * metrics["step_time_s"], 1e-9))
            history.append(metrics)
            monitor.log(step, metrics)
            if rl.eval_interval and step % rl.eval_interval == 0 and step < rl.steps:
                run_eval(step)
            stop = stopper.should_stop()
            at_interval = cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0
            if at_interval or stop or step == rl.steps:
                state = [{"queue": queue.drain(), "replay": buffer.state_dict() if buffer is not None else None}
                         if rank0 else None]
                save_train_checkpoint(save_root, step, model, optimizer, scheduler,
                                      {"rl_step": step, "consumed_prompts": step * rl.prompts_per_step},
                                      meta=meta, hf_files_from=src.hf_dir, keep_last=cfg.checkpoint.keep_last,
                                      objects={"rl_async": state[0]} if rank0 else None,
                                      rank_objects={"weight_snapshots": snapshots.state_dict()}
                                      if snapshots is not None else None)
                if value is not None:
                    save_train_checkpoint(save_root + "_value", step, *value, {"rl_step": step},
                                          meta={**meta, "value_model": True}, keep_last=cfg.checkpoint.keep_last)
            if stop:
                stopped = True
                break
            if max_steps is not None and step - start_step >= max_steps:
                break
        if step == rl.steps and step not in evals:
            run_eval(step)
        monitor.close()
        stopper.restore()
        return {"step": step, "stopped_by_signal": stopped, "history": history, "evals": evals,
                "checkpoint_root": save_root}
    finally:
        if manager is not None:
            manager.shutdown()
        destroy_distributed()


def _collect(cfg: Config, algo, queue, step: int, train_prompts, tok, reward_fn) -> tuple[list, dict[str, float]]:
    """Rank 0: the queued rollout of ``step`` -> rewards -> samples (with their behaviour versions) + metrics."""
    from megadare.trainer.rl_async import staleness_metrics

    rl = cfg.rl
    q, traj, wait_s = queue.take(step)
    batch = [train_prompts[i] for i in q.batch_indices]
    for tr in traj:
        tr.validate()
    recs = [b.record for b in batch for _ in range(rl.n_samples)]
    rewards, rstats = score(reward_fn, tok, traj, recs)
    samples, metrics = build_samples(cfg, traj, rewards)
    if hasattr(algo, "samples_from"):  # one sample per tree node, local advantages
        samples = algo.samples_from(traj, rewards, rl.n_samples)
    if hasattr(algo, "prepare"):  # algorithms that score more than the final answer (MDPO)
        from megadare.rewards import score_batch

        def score_ids(responses, indices):
            texts = [tok.decode(r) for r in responses]
            return [float(x) for x in score_batch(reward_fn, texts, [recs[i] for i in indices])[0]]

        algo.prepare(samples, score_ids, rl.n_samples)
    metrics.update({f"reward_{k}": v for k, v in rstats.items()})
    stale = [step - t.policy_version for t in traj]
    if max(stale) > rl.max_staleness:
        oldest = min(t.policy_version for t in traj)
        raise RuntimeError(f"rollout of step {step} used policy version {oldest}, staler than "
                           f"rl.max_staleness={rl.max_staleness}")
    version = [t.policy_version for t in traj]
    for s in samples:
        s.extra["policy_version"] = version[s.index] if s.index < len(version) else step
        s.extra["rollout_step"] = step
        if s.index < len(traj) and "token_versions" in traj[s.index].extra:
            s.extra["token_versions"] = traj[s.index].extra["token_versions"]
        if rl.behaviour_logp == "engine":
            s.extra["engine_logprobs"] = list(traj[s.index].logprobs)
    metrics.update(staleness_metrics(stale))
    mixed = [len(set(t.extra["token_versions"])) > 1 for t in traj if t.extra.get("token_versions")]
    if mixed:
        metrics["async/mixed_version_fraction"] = sum(mixed) / len(mixed)
    engine_s = sum(t.extra.get("engine_s", 0.0) for t in traj)
    metrics.update(rollout_wait_s=wait_s, **{"async/rollout_busy_s": engine_s,
                                             "async/queue_depth": float(len(queue.queue))})
    return samples, metrics


def engine_spec(cfg: Config, src, tok):
    """How each engine actor builds its engine: the built-in torch engine, or SGLang (``rollout.engine_tp`` GPUs
    of tensor parallelism per engine; with ``rollout.fp8_weights`` started from a block-fp8 export of the model
    under ``<run_dir>/engine_fp8``, which the weight sync then updates in the same format)."""
    from megadare.rollout.manager import EngineSpec, build_native_engine

    r = cfg.rollout
    gpus = r.engine_resources.get("num_gpus")
    if r.engine != "sglang":
        if r.engine_tp != 1:
            raise ConfigError(f"rollout.engine_tp={r.engine_tp}: the built-in engine runs on one device; tensor-"
                              "parallel engines need rollout.engine=sglang")
        return EngineSpec(build_native_engine, {"hf_dir": src.hf_dir, "eos_token_id": tok.eos_token_id})
    if gpus is not None and gpus < r.engine_tp:
        raise ConfigError(f"rollout.engine_tp={r.engine_tp} needs rollout.engine_resources num_gpus >= "
                          f"{r.engine_tp} per engine actor (got {gpus})")
    # fail here, not inside an actor, when sglang or the plugin is missing
    from megadare.rollout.sglang_engine import _import_sglang, build_sglang_engine

    _import_sglang()
    model_path = src.hf_dir
    if r.fp8_weights:  # the engines serve block fp8, so they start from the fp8-block export of the model
        from megadare.convert.quantize import quantize_export

        model_path = os.path.join(cfg.logging.run_dir, "engine_fp8")
        if not os.path.exists(os.path.join(model_path, "config.json")):
            quantize_export(src.hf_dir, model_path, fmt="fp8-block", progress=False)
    return EngineSpec(build_sglang_engine, {
        "model_path": model_path, "eos_token_id": tok.eos_token_id, "block_size": r.block_size,
        "steps_per_block": r.steps_per_block, "algorithm": r.algorithm, "threshold": r.threshold,
        "max_running_requests": max(1, r.chunk_size), "chunk_bytes": r.bucket_mb << 20, "tp_size": r.engine_tp})


def _start_engines(cfg: Config, src, tok):
    """Rank 0: Ray (local unless RAY_ADDRESS / a running cluster) and the engine actors with the model."""
    import ray

    from megadare.rollout.manager import RolloutManager

    spec = engine_spec(cfg, src, tok)
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False, log_to_driver=False,
                 num_cpus=None if os.environ.get("RAY_ADDRESS") else max(2, cfg.rollout.num_engines + 1))
    return RolloutManager(spec, num_engines=cfg.rollout.num_engines, resources=dict(cfg.rollout.engine_resources),
                          chunk_size=cfg.rollout.chunk_size)


def rl_worker(rank: int, world: int, cfg: Config, max_steps: Optional[int] = None) -> dict[str, Any]:
    """Entry for megadare.parallel.launch.spawn (local multi-process runs, tests)."""
    return run_rl(cfg, max_steps=max_steps)


__all__ = ["run_rl", "rl_worker", "evaluate", "score", "sampling_params", "build_samples"]
