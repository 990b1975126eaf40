"""Offline preference optimisation of a dLLM: VRPO (LLaDA 1.5, arXiv:2505.19223) on a preference dataset.

    megadare dpo --config FILE [key=value ...] [--dry-run]

Each step takes ``train.global_batch_size`` (prompt, chosen, rejected) pairs (data.path: .jsonl / .json / .parquet in
DARE's ultrafeedback layout or with strings, data/preference_data.py). Per pair, algos/vrpo.py's estimator: for
each response n = ``dpo.n_mc`` count-stratified masks (counts evenly spaced over [1, L] with a random offset, a
uniform subset of each size, weight L / m_j), one row holding both responses; the frozen reference (the initial
weights) scores the very same stored masks (VRPO's antithetic sampling), then

    L = mean_pairs -log sigmoid( beta [ (B_theta(y_w) - B_ref(y_w)) - (B_theta(y_l) - B_ref(y_l)) ] / N ),

N = 1, or the response canvas ``dpo.canvas_length`` with ``dpo.margin_norm=canvas`` (DARE). Logged per step:
``loss``, ``margin`` (the implicit-reward margin inside the sigmoid) and ``pair_accuracy`` (margin > 0).
Checkpoints, resume, SIGTERM and export (``megadare convert megatron-to-hf``) work as for SFT; the loop, step and
checkpoint pieces are trainer/sft_loop.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional


from megadare.algos.base import RLSample
from megadare.algos.sft import example_generator
from megadare.config import Config
from megadare.data.preference_data import load_preference_examples
from megadare.parallel import destroy_distributed, init_distributed
from megadare.trainer.model_setup import materialise, tokenizer_for
from megadare.trainer.policy import build_policy
from megadare.trainer.run_lock import run_dir_lock
from megadare.trainer.sft_loop import SFTRun, SFTStep, save_sft, train_steps, checkpoint_root, resume
from megadare.trainer.spec import RunSpec, launched_world, resolve
from megadare.trainer.step import RowFormat, store_outputs


@dataclass
class DPORun(SFTRun):
    """An SFT run's parts (no SFT recipe) plus the frozen reference and VRPO (estimator and loss)."""

    algo: Any = None
    block: int = 1

    @property
    def block_size(self) -> int:
        return self.block


def run_dpo(cfg: Config, max_steps: Optional[int] = None) -> dict[str, Any]:
    """Train on this rank (torch.distributed from the environment). Returns a summary (same on all ranks)."""
    spec = resolve(cfg, launched_world(), job="dpo")
    init_distributed(spec.layout, seed=cfg.seed, timeout_s=cfg.parallel.collective_timeout_s)
    try:
        data = dpo_data(spec)  # before the lock and the tiny model: bad data leaves the run directory as it was
        with run_dir_lock(cfg.logging.run_dir, checkpoint_root(cfg)):
            run = setup_dpo(spec, data)
            out = train_steps(
                run, DPOStep(run), partial(save_sft, written_by="megadare dpo"), len(run.examples), "dpo", max_steps
            )
        return {**out, "data": run.data_stats}
    finally:
        destroy_distributed()


def preference_record_keys(cfg: Config) -> dict[str, str]:
    """The record fields the config names, as the preference builders take them (the loop and pre-flight)."""
    return {"prompt_key": cfg.data.prompt_key, "chosen_key": cfg.dpo.chosen_key, "rejected_key": cfg.dpo.rejected_key}


def dpo_data(spec: RunSpec) -> tuple[Any, list, dict]:
    """(tokenizer, preference pairs, their stats): read before the run writes anything (its lock's ``ckpt/``, a
    tiny model's ``init_hf/``), so a data file the run refuses leaves none of them behind."""
    cfg = spec.cfg
    tok, d = tokenizer_for(cfg, spec.source), cfg.data
    return (tok, *load_preference_examples(d.path, tok, d.max_length, d.overlong, **preference_record_keys(cfg)))


def setup_dpo(spec: RunSpec, data: Optional[tuple[Any, list, dict]] = None) -> DPORun:
    """Policy and frozen reference (both the initial weights: ``checkpoint.load`` or the HF model), optimizer,
    preference pairs (``dpo_data``, read now if not given); resumed from the newest checkpoint of the run when there
    is one."""
    cfg = spec.cfg
    tok, examples, stats = dpo_data(spec) if data is None else data
    src = materialise(spec.source, cfg)
    policy = build_policy(cfg, src, updates=cfg.train.steps, reference=True)
    block = src.arch.is_block_diffusion
    run = DPORun(
        cfg=cfg,
        src=src,
        recipe=None,
        kind=src.arch.training_mask,
        tok=tok,
        examples=examples,
        data_stats=stats,
        policy=policy,
        save_root=checkpoint_root(cfg),
        algo=spec.algo,
        block=src.arch.block_size if block else 1,
    )
    resume(run, "megadare dpo")
    return run


class DPOStep(SFTStep):
    """One DPO step: the step's pairs -> VRPO rows -> reference pass on the same rows -> one train step."""

    def rows(self, indices: list[int]) -> list:
        run, rows = self.run, []
        for i in indices:
            ex = run.examples[i]
            chosen = RLSample(ex.prompt_ids, ex.chosen_ids, reward=1.0, advantage=1.0, index=2 * i)
            rejected = RLSample(ex.prompt_ids, ex.rejected_ids, reward=0.0, advantage=-1.0, index=2 * i + 1)
            rows.append(
                run.algo.pair_row(
                    chosen,
                    rejected,
                    run.arch,
                    example_generator(run.cfg.seed, run.step, 2 * i),
                    example_generator(run.cfg.seed, run.step, 2 * i + 1),
                )
            )
        return rows

    def passes(self, mine: list) -> None:
        fmt = RowFormat(self.run.kind, self.run.block_size, self.run.arch.vocab_size)
        store_outputs(self.run.policy.ref_chunks, mine, "ref", fmt)

    def objective(self):
        return self.run.algo.objective(on_policy=True)

    def train(self, rows: list) -> dict[str, float]:
        metrics = super().train(rows)
        metrics["loss"] = metrics.pop("pg_loss")
        return metrics


def dpo_worker(rank: int, world: int, cfg: Config, max_steps: Optional[int] = None) -> dict[str, Any]:
    """Entry for megadare.parallel.launch.spawn (local multi-process runs, tests)."""
    return run_dpo(cfg, max_steps=max_steps)
