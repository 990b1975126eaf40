"""The SFT loop: data -> corruption rows -> packing -> megatron train step -> metrics -> checkpoints.

    megadare sft --config examples/configs/sft_sdar_tiny.yaml train.steps=100 parallel.tp=2

Runs on every rank of a torchrun / Slurm launch (or ``--nproc N`` locally). Resumes automatically from the
newest checkpoint under ``checkpoint.save``; SIGTERM finishes the current step, checkpoints and exits.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megadare.algos.sft import SFTRecipe, mask_kind, example_generator, example_rows
from megadare.config import Config, resolve_sft_mode, resolve_sft_t_per
from megadare.data.files import load_many
from megadare.data.prompt_data import synthetic_split
from megadare.data.rows import pack_rows, split_for_data_parallel, global_denominator
from megadare.data.sft_data import build_sft_examples, pad_responses
from megadare.diffusion.schedule import NoiseSchedule
from megadare.errors import ConfigError
from megadare.models.family import MaskKind, get_family
from megadare.parallel import destroy_distributed, init_distributed
from megadare.parallel.layout import Layout
from megadare.trainer.data_order import StepSampler, check_same_order
from megadare.trainer.flops import peak_tflops, step_flops
from megadare.trainer.checkpoint import CheckpointState, Provenance, config_record, said_setting_changes
from megadare.trainer.loop import Loop
from megadare.trainer.model_setup import materialise, tokenizer_for
from megadare.trainer.moe_stats import MoELoadStats
from megadare.trainer.monitor import Monitor, write_run_config
from megadare.trainer.policy import Policy, build_policy, lora_of
from megadare.trainer.run_lock import run_dir_lock
from megadare.trainer.signals import stopping_before_the_loop
from megadare.trainer.spec import RunSpec, launched_world, resolve
from megadare.trainer.step import RowFormat, weighted_nll, train_step


def sft_recipe(cfg: Config, arch):
    """The SFT recipe of the config for this model; what the config leaves to the family (sft.t_per=auto, the
    block draw's redraw rule) is the family's declaration (models/<family>.py ``sft_*``)."""
    s = cfg.sft
    declared = get_family(arch.family).extra
    return SFTRecipe(
        mode=resolve_sft_mode(cfg, arch),
        block_size=arch.block_size or 1,
        schedule=NoiseSchedule(s.noise_low, s.noise_high, s.weighting),
        normalize=s.normalize,
        t_per=resolve_sft_t_per(cfg, declared.get("sft_t_per")),
        trace_shrink=s.trace_shrink,
        redraw_empty=declared.get("sft_redraw_empty", True),
    )


def sft_record_keys(cfg: Config) -> dict[str, str]:
    """The record fields the config names, as ``build_sft_examples`` takes them (the loop and pre-flight)."""
    d = cfg.data
    return {"prompt_key": d.prompt_key, "response_key": d.response_key, "messages_key": d.messages_key}


def load_examples(cfg: Config, tok) -> tuple[list, dict]:
    """Tokenized, length-checked SFT examples from data.path or a synthetic task."""
    d = cfg.data
    sources = None
    if d.synthetic:  # the train split; the held-out split (rl.eval_size records) stays unseen for evaluation
        records = synthetic_split(d.synthetic, d.synthetic_size, cfg.rl.eval_size, cfg.seed, d.synthetic_correct)[0]
        source = f"synthetic:{d.synthetic}"
    elif d.path:
        located = load_many(d.path, "data.path")
        records, sources, source = [r for _, r in located], [w for w, _ in located], str(d.path)
    else:
        raise ConfigError(
            "no data: set data.path (.jsonl / .json / .parquet, or a list of files) or data.synthetic=addition"
        )
    examples, stats = build_sft_examples(
        records,
        tok,
        d.max_length,
        d.overlong,
        source=source if sources is None else sources,
        **sft_record_keys(cfg),
    )
    return pad_responses(examples, cfg.sft.pad_response, tok, d.max_length), stats


def _memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import psutil  # optional-heavy: only for the memory metric

    return psutil.Process().memory_info().rss / 2**30


@dataclass
class SFTRun:
    """What an SFT run holds, built once by ``setup_sft``."""

    cfg: Config
    src: Any
    recipe: Any  # SFTRecipe
    kind: MaskKind  # training mask kind
    tok: Any
    examples: list
    data_stats: dict
    policy: Policy
    save_root: str
    step: int = 0

    @property
    def arch(self):
        return self.src.arch

    @property
    def block_size(self) -> int:
        return self.recipe.block_size


def run_sft(cfg: Config, max_steps: Optional[int] = None) -> dict[str, Any]:
    """Train on this rank (torch.distributed from the environment). Returns a summary (same on all ranks).

    ``max_steps`` stops early after that many steps of this invocation (tests of resume), without the final
    checkpoint unless a save interval falls there.
    """
    spec = resolve(cfg, launched_world(), job="sft")
    with stopping_before_the_loop():
        layout = init_distributed(spec.layout, seed=cfg.seed, timeout_s=cfg.parallel.collective_timeout_s)
        try:
            data = sft_data(spec)  # before the lock and the tiny model: bad data leaves the run directory as it was
            with run_dir_lock(cfg.logging.run_dir, checkpoint_root(cfg)):
                run = setup_sft(spec, data)
                out = train_steps(run, SFTStep(run), save_sft, len(run.examples), "sft", max_steps)
            return {**out, "layout": {**asdict(layout), "dp": layout.dp}, "data": run.data_stats}
        finally:
            destroy_distributed()


def train_steps(run, step_fn, save, n_examples: int, desc: str, max_steps: Optional[int] = None) -> dict[str, Any]:
    """The offline training loop shared by SFT and DPO: ``train.steps`` global batches of ``train.global_batch_size``
    example indices (a pure function of seed and step) -> ``step_fn`` -> metrics (console, tensorboard, JSONL);
    ``save(run)`` every ``checkpoint.save_interval`` steps, at the end and on SIGTERM. ``run`` has cfg, step and
    save_root; ``step_fn(indices)`` returns the step's metrics and ``step_fn.add_speed`` adds the speed ones."""
    cfg, steps = run.cfg, run.cfg.train.steps
    sampler = sampler_of(run, n_examples)
    loop = Loop(steps, run.step, Monitor(cfg.logging, steps, start_step=run.step, desc=desc), max_steps)
    history: list[dict[str, float]] = []
    try:  # however it ends: the bar ends its line (an error stands on its own) and Ctrl-C is Python's again
        while loop.running(run.step):
            loop.monitor.step_timer()
            metrics = step_fn(sampler.batch(run.step))
            run.step += 1
            step_fn.add_speed(metrics, loop.monitor.step_timer(), sampler.epoch(run.step))
            history.append(metrics)
            loop.monitor.log(run.step, metrics)
            if loop.checkpoint_due(run.step, cfg.checkpoint.save_interval):
                save(run)
            if loop.done(run.step):
                break
    finally:
        loop.close()
    return {
        "step": run.step,
        "stopped_by_signal": loop.stopped,
        "history": history,
        "checkpoint_root": run.save_root,
        "already_finished": loop.start >= steps,
    }


def sampler_of(run, n_examples: Optional[int] = None) -> StepSampler:
    """The order of ``run``'s examples: global batches of ``train.global_batch_size``, from ``seed``."""
    cfg = run.cfg
    n = len(run.examples) if n_examples is None else n_examples
    return StepSampler(n, cfg.train.global_batch_size, cfg.seed, cfg.data.shuffle)


def sft_data(spec: RunSpec) -> tuple[Any, list, dict]:
    """(tokenizer, examples, their stats): read before the run writes anything (its lock's ``ckpt/``, a tiny
    model's ``init_hf/``), so a data file the run refuses (a missing key) leaves none of them behind."""
    tok = tokenizer_for(spec.cfg, spec.source)
    return (tok, *load_examples(spec.cfg, tok))


def setup_sft(spec: RunSpec, data: Optional[tuple[Any, list, dict]] = None) -> SFTRun:
    """Model (from ``checkpoint.load``, with LoRA adapters if asked), optimizer, data (``sft_data``, read now if not
    given); resumed from the newest checkpoint of the run when there is one."""
    cfg = spec.cfg
    tok, examples, data_stats = sft_data(spec) if data is None else data
    src = materialise(spec.source, cfg)
    recipe = sft_recipe(cfg, src.arch)
    policy = build_policy(cfg, src, updates=cfg.train.steps, lora=lora_of(cfg.lora))
    run = SFTRun(
        cfg=cfg,
        src=src,
        recipe=recipe,
        kind=mask_kind(recipe, src.arch),
        tok=tok,
        examples=examples,
        data_stats=data_stats,
        policy=policy,
        save_root=checkpoint_root(cfg),
    )
    resume(run, "megadare sft")
    return run


def checkpoint_root(cfg: Config) -> str:
    """Where a run's checkpoints go: ``checkpoint.save``, else ``<logging.run_dir>/ckpt``."""
    return cfg.checkpoint.save or os.path.join(cfg.logging.run_dir, "ckpt")


def resume(run, written_by: str) -> dict:
    """Resume ``run`` (model, optimizer, scheduler, step) from the newest intact checkpoint under its save root, if
    any (``checkpoint.resume_run``: written by ``written_by`` from this model); rank 0 writes the run's config.
    Returns the checkpoint's train state ({} for a fresh run)."""
    cfg = run.cfg
    state = run.policy.resume(run.save_root, run.src, written_by, None if cfg.model.tiny else cfg.model.hf_path)
    if state:
        check_same_order(state, sampler_of(run), "train.global_batch_size", "consumed_examples")
        said_setting_changes(state, cfg)
    run.step = int(state.get("step", 0))
    if dist.get_rank() == 0:
        write_run_config(cfg)
    return state


class SFTStep:
    """One SFT step: the step's examples -> corruption rows -> packed micro-batches -> this rank's data-parallel
    share -> megatron train step; plus the speed metrics (tokens/s, TFLOP/s per GPU, MFU, memory)."""

    def __init__(self, run: SFTRun):
        self.run = run
        self.moe_stats = MoELoadStats(run.policy.model)
        self.peak = peak_tflops()
        cfg = run.cfg
        self.mask_fn = (
            (lambda mb: mb.megatron_mask(run.kind, run.block_size)) if cfg.model.attention_backend == "local" else None
        )
        self.pad_id = getattr(run.tok, "pad_token_id", 0) or 0
        self.multiple = Layout.of(cfg.parallel).micro_batch_multiple  # interleaved pipelines: pp micro-batches

    def __call__(self, indices: list[int]) -> dict[str, float]:
        return self.train(self.rows(indices))

    def rows(self, indices: list[int]) -> list:
        """The training rows of the step's examples (corruptions seeded per (seed, step, example))."""
        run, rows = self.run, []
        for i in indices:
            rows.extend(
                example_rows(run.examples[i], run.arch, run.recipe, example_generator(run.cfg.seed, run.step, i))
            )
        return rows

    def passes(self, mine: list) -> None:
        """Forward-only passes the objective needs before the step (none for SFT; DPO: the reference)."""

    def objective(self):
        return weighted_nll

    def train(self, rows: list) -> dict[str, float]:
        """Rows -> packed micro-batches -> this rank's data-parallel share -> one megatron train step."""
        run, t = self.run, self.run.cfg.train
        mbs = pack_rows(rows, t.seq_length, t.micro_batch_size, pad_id=self.pad_id)
        self.n_tokens = sum(int((~m.padding).sum()) for m in mbs)
        self.lengths = [m.tokens.shape[1] for m in mbs for _ in range(m.tokens.shape[0])]
        mine = split_for_data_parallel(
            mbs, ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), multiple_of=self.multiple
        )
        self.passes(mine)
        fmt = RowFormat(run.kind, run.block_size, run.arch.vocab_size, self.mask_fn)
        metrics = train_step(run.policy, mine, global_denominator(mbs), fmt, objective=self.objective())
        metrics["micro_batches"] = float(len(mine))
        return metrics

    def add_speed(self, metrics: dict[str, float], dt: float, epoch: float) -> None:
        metrics.update(self.moe_stats.collect())
        metrics["tflops"] = step_flops(self.run.arch, self.lengths) / dt / 1e12 / dist.get_world_size()  # per GPU
        if self.peak:
            metrics["mfu"] = metrics["tflops"] / self.peak
        metrics.update(tokens_per_s=self.n_tokens / dt, step_time_s=dt, epoch=epoch, memory_gib=_memory_gib())


def save_sft(run: SFTRun, written_by: str = "megadare sft") -> None:
    """Atomic checkpoint of model, optimizer, schedule and data position (LoRA rank / alpha in the meta); also
    ``megadare dpo``'s (``written_by``)."""
    cfg = run.cfg
    meta = {"family": run.src.family.name, "architecture": run.arch.architecture, "written_by": written_by}
    if cfg.lora.rank > 0 and written_by == "megadare sft":
        meta["lora"] = {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha}
    state = {
        "consumed_examples": run.step * cfg.train.global_batch_size,
        "data": run.data_stats,
        "data_order": sampler_of(run).settings(),
        "config": config_record(cfg),
    }
    run.policy.save(
        run.save_root, run.step, CheckpointState(state), Provenance(meta, run.src.hf_dir), cfg.checkpoint.keep_last
    )


def sft_worker(rank: int, world: int, cfg: Config, max_steps: Optional[int] = None) -> dict[str, Any]:
    """Entry for megadare.parallel.launch.spawn (local multi-process runs, tests)."""
    return run_sft(cfg, max_steps=max_steps)
