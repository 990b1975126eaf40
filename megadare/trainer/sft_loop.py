"""The SFT loop: data -> corruption rows -> packing -> megatron train step -> metrics -> checkpoints.

    megadare sft --config examples/configs/sft_sdar_tiny.yaml train.steps=100 parallel.tp=2

Runs on every rank of a torchrun / Slurm launch (or ``--nproc N`` locally). Resumes automatically from the
newest checkpoint under ``checkpoint.save``; SIGTERM finishes the current step, checkpoints and exits.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from megadare.config import Config, resolve_sft_mode, to_yaml
from megadare.errors import ConfigError
from megadare.data.rows import pack_rows, split_for_data_parallel, global_denominator


def sft_recipe(cfg: Config, arch):
    from megadare.algos.sft import SFTRecipe
    from megadare.diffusion.schedule import NoiseSchedule

    s = cfg.sft
    return SFTRecipe(mode=resolve_sft_mode(cfg, arch), block_size=arch.block_size or 1,
                     schedule=NoiseSchedule(s.noise_low, s.noise_high, s.weighting), normalize=s.normalize,
                     t_per=s.t_per, trace_shrink=s.trace_shrink)


def load_examples(cfg: Config, tok) -> tuple[list, dict]:
    """Tokenized, length-checked SFT examples from data.path or a synthetic task."""
    from megadare.data.prompt_data import synthetic_split
    from megadare.data.sft_data import build_sft_examples, load_records

    d = cfg.data
    if d.synthetic:  # the train split; the held-out split (rl.eval_size records) stays unseen for evaluation
        records = synthetic_split(d.synthetic, d.synthetic_size, cfg.rl.eval_size, cfg.seed, d.synthetic_correct)[0]
        source = f"synthetic:{d.synthetic}"
    elif d.path:
        records, source = load_records(d.path), d.path
    else:
        raise ConfigError("no data: set data.path (.jsonl / .parquet) or data.synthetic=addition")
    return build_sft_examples(records, tok, d.max_length, d.overlong, source=source, prompt_key=d.prompt_key,
                              response_key=d.response_key, messages_key=d.messages_key)


def _memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def run_sft(cfg: Config, max_steps: Optional[int] = None) -> dict[str, Any]:
    """Train on this rank (torch.distributed from the environment). Returns a summary (same on all ranks).

    ``max_steps`` stops early after that many steps of this invocation (tests of resume), without the final
    checkpoint unless a save interval falls there.
    """
    from megatron.core import parallel_state as ps

    from megadare.algos.sft import example_generator, example_rows, mask_kind
    from megadare.config import validate
    from megadare.parallel import destroy_distributed, init_distributed
    from megadare.trainer.checkpoint import latest_checkpoint, load_train_checkpoint, save_train_checkpoint
    from megadare.trainer.data_order import StepSampler
    from megadare.trainer.model_setup import build_training_chunks, resolve_model_source, tokenizer_for
    from megadare.trainer.flops import peak_tflops, step_flops
    from megadare.trainer.moe_stats import MoELoadStats
    from megadare.trainer.monitor import Monitor
    from megadare.trainer.optim import OptimSettings, build_optimizer, wrap_ddp
    from megadare.trainer.signals import StopSignal
    from megadare.trainer.step import train_step

    p, t = cfg.parallel, cfg.train
    layout = init_distributed(tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, etp=p.etp, cp=p.cp, sp=p.sp, seed=cfg.seed)
    try:
        src = resolve_model_source(cfg)
        arch = src.arch
        validate(cfg, arch, dist.get_world_size())
        recipe = sft_recipe(cfg, arch)
        kind = mask_kind(recipe, arch)
        tok = tokenizer_for(cfg, src)
        examples, data_stats = load_examples(cfg, tok)

        chunks = build_training_chunks(cfg, src)
        if cfg.checkpoint.load:
            load_train_checkpoint(cfg.checkpoint.load, chunks, None, None, load_optimizer=False)
        if cfg.sft.lora_rank > 0:
            from megadare.models.lora import apply_lora

            apply_lora(chunks, cfg.sft.lora_rank, cfg.sft.lora_alpha, targets=tuple(cfg.sft.lora_targets))
        model = wrap_ddp(chunks, t.distributed_optimizer)
        optimizer, scheduler = build_optimizer(model, OptimSettings(
            lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad, warmup_steps=t.warmup_steps,
            lr_decay_style=t.lr_decay_style, total_steps=t.steps, distributed_optimizer=t.distributed_optimizer,
            dtype=cfg.model.dtype))

        save_root = cfg.checkpoint.save or os.path.join(cfg.logging.run_dir, "ckpt")
        step = 0
        resume_from = latest_checkpoint(save_root)
        if resume_from:
            step = int(load_train_checkpoint(resume_from, model, optimizer, scheduler)["step"])
        if dist.get_rank() == 0:
            os.makedirs(cfg.logging.run_dir, exist_ok=True)
            with open(os.path.join(cfg.logging.run_dir, "config.yaml"), "w") as f:
                f.write(to_yaml(cfg))

        sampler = StepSampler(len(examples), t.global_batch_size, cfg.seed, cfg.data.shuffle)
        monitor = Monitor(cfg.logging.run_dir, t.steps, start_step=step, tensorboard=cfg.logging.tensorboard,
                          jsonl=cfg.logging.jsonl, log_interval=cfg.logging.log_interval, desc="sft")
        stopper = StopSignal()
        meta = {"family": src.family.name, "architecture": arch.architecture, "written_by": "megadare sft"}
        if cfg.sft.lora_rank > 0:
            meta["lora"] = {"rank": cfg.sft.lora_rank, "alpha": cfg.sft.lora_alpha}
        pad_id = getattr(tok, "pad_token_id", 0) or 0
        multiple = p.pp if (p.vpp or 1) > 1 else 1
        history: list[dict[str, float]] = []
        moe_stats = MoELoadStats(model)
        peak = peak_tflops()
        mask_fn = ((lambda mb: mb.megatron_mask(kind, recipe.block_size))
                   if cfg.model.attention_backend == "local" else None)
        start_step, stopped = step, False
        while step < t.steps:
            monitor.step_timer()
            rows = []
            for i in sampler.batch(step):
                rows.extend(example_rows(examples[i], arch, recipe, example_generator(cfg.seed, step, i)))
            mbs = pack_rows(rows, t.seq_length, t.micro_batch_size, pad_id=pad_id)
            denom = global_denominator(mbs)
            n_tokens = sum(int((~m.padding).sum()) for m in mbs)
            mine = split_for_data_parallel(mbs, ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(),
                                           multiple_of=multiple)
            metrics = train_step(model, optimizer, scheduler, mine, denom, kind, recipe.block_size,
                                 arch.vocab_size, mask_fn=mask_fn)
            step += 1
            dt = monitor.step_timer()
            metrics.update(moe_stats.collect())
            tflops = step_flops(arch, [m.tokens.shape[1] for m in mbs for _ in range(m.tokens.shape[0])]) / dt / 1e12
            metrics["tflops"] = tflops / dist.get_world_size()  # per GPU
            if peak:
                metrics["mfu"] = metrics["tflops"] / peak
            metrics.update(tokens_per_s=n_tokens / dt, step_time_s=dt, epoch=sampler.epoch(step),
                           memory_gib=_memory_gib(), micro_batches=float(len(mine)))
            history.append(metrics)
            monitor.log(step, metrics)
            stop = stopper.should_stop()
            at_interval = cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0
            if at_interval or stop or step == t.steps:
                save_train_checkpoint(save_root, step, model, optimizer, scheduler,
                                      {"consumed_examples": step * t.global_batch_size, "data": data_stats},
                                      meta=meta, hf_files_from=src.hf_dir, keep_last=cfg.checkpoint.keep_last)
            if stop:
                stopped = True
                break
            if max_steps is not None and step - start_step >= max_steps:
                break
        monitor.close()
        stopper.restore()
        return {"step": step, "stopped_by_signal": stopped, "history": history, "layout": layout.__dict__,
                "checkpoint_root": save_root, "data": data_stats}
    finally:
        destroy_distributed()


def sft_worker(rank: int, world: int, cfg: Config, max_steps: Optional[int] = None) -> dict[str, Any]:
    """Entry for megadare.parallel.launch.spawn (local multi-process runs, tests)."""
    return run_sft(cfg, max_steps=max_steps)
