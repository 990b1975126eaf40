"""Every fact of a run, worked out once from its config: ``resolve(cfg, world, job=...) -> RunSpec``.

    spec = resolve(cfg, launched_world(), job="rl")   # checks the whole config (trainer/checks.py validate) on the way
    init_distributed(spec.layout, seed=cfg.seed)

The spec holds the model source (an HF checkpoint, or a tiny random model of a family that rank 0 writes when
the run starts: ``model_setup.materialise``), its ``ModelArch``, the parallel ``Layout`` placed on the world, the
job's algorithm and the rollout's train / evaluation sampling parameters. The CLI, SFT, DPO, RL, eval and plan
start here; after it nothing changes the config (RL's one adjustment -- frozen expert biases -- is made here).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Optional

from megadare.algos import build_algorithm
from megadare.algos.vrpo import VRPO
from megadare.config import Config, check_model_path
from megadare.trainer.checks import validate
from megadare.errors import ConfigError
from megadare.models.family import Family, ModelArch, family_of, get_family, read_hf_config
from megadare.parallel.layout import Layout
from megadare.rollout.engine import SamplingParams
from megadare.rollout.setup import sampling_params
from megadare.trainer.offpolicy.settings import check_correction_config
from megadare.trainer.offpolicy.queue import lookahead

JOBS = ("sft", "dpo", "rl", "eval", "plan")


@dataclass(frozen=True)
class ModelSource:
    """Where the initial weights and config.json come from; ``tiny``: a random model rank 0 writes to ``hf_dir``."""

    family: Family
    arch: ModelArch
    hf_dir: str
    hf_config: dict
    tiny: bool = False


@dataclass(frozen=True)
class RunSpec:
    """The resolved facts of one run (``resolve``). ``source`` is None when the config names no model."""

    cfg: Config
    job: str
    layout: Layout
    source: Optional[ModelSource] = None
    algo: Any = None  # RL: the configured Algorithm; DPO: VRPO from dpo.*; else None
    train_sampling: Optional[SamplingParams] = None  # RL rollouts (seed set per step) and eval
    eval_sampling: Optional[SamplingParams] = None

    @property
    def arch(self) -> Optional[ModelArch]:
        return None if self.source is None else self.source.arch


def resolve(cfg: Config, world: Optional[int] = None, *, job: str, rules_checked: bool = False) -> RunSpec:
    """The run's spec for ``job`` on ``world`` processes (None: ``parallel.world_size`` or not yet known); the
    config is checked once here (``validate`` of trainer/checks.py and the job's own checks; ``rules_checked``: the
    caller ran ``config.check_rules`` on ``cfg``, as the CLI does before torch loads). Raises ConfigError."""
    if job not in JOBS:
        raise ValueError(f"job={job!r} is not one of {JOBS}")
    if job == "rl":  # aux-loss-free expert biases (LLaDA2) stay frozen during RL: the engines route with the
        # synced bias, and forward-only passes (old / reference log-probs) must not feed the balancing statistics
        cfg = cfg.replace(train=replace(cfg.train, moe_bias_update_rate=0.0))
    source = model_source(cfg)
    arch = None if source is None else source.arch
    algo = build_algorithm(cfg.algo.name, dict(cfg.algo.params))
    # rl's replace above: no rule reads that key
    validate(cfg, arch, world, algo=algo, rules=not rules_checked, job=job)
    if job == "dpo":
        algo = check_dpo(cfg, arch)
    spec = RunSpec(cfg=cfg, job=job, layout=Layout.of(cfg.parallel, world or cfg.parallel.world_size), source=source)
    if job == "dpo":
        return replace(spec, algo=algo)
    if job in ("rl", "eval") and arch is not None:
        if job == "rl":
            check_correction_config(cfg, algo, arch, lookahead(cfg.offpolicy.mode, cfg.offpolicy.max_staleness))
        train = sampling_params(cfg, arch, 0, record_steps=algo.needs_step_predictions)
        spec = replace(spec, train_sampling=train, eval_sampling=sampling_params(cfg, arch, cfg.seed, evaluation=True))
    return replace(spec, algo=algo) if job == "rl" else spec


def model_source(cfg: Config) -> Optional[ModelSource]:
    """The model a config names (``model.hf_path``, or ``model.family`` with its tiny config; None: no model).
    Reads config.json; writes nothing."""
    m = cfg.model
    check_model_path(cfg)
    if m.hf_path:
        return source_of(read_hf_config(m.hf_path), m.hf_path, m.block_size)
    if not m.family:
        return None
    fam = get_family(m.family)
    over = dict(m.tiny_config)
    if m.block_size and fam.arch(fam.tiny_config()).is_block_diffusion:
        over["block_size"] = m.block_size
    hf_dir = os.path.join(cfg.logging.run_dir, "init_hf")
    return replace(source_of(fam.tiny_config(**over), hf_dir, m.block_size), tiny=bool(m.tiny))


def source_of(hf: dict, hf_dir: str, block_size: Optional[int]) -> ModelSource:
    """The source of a config.json, with ``model.block_size`` in place of a block-diffusion model's own."""
    fam = family_of(hf)
    arch = fam.arch(hf)
    if block_size is not None and arch.is_block_diffusion and block_size != arch.block_size:
        arch = replace(arch, block_size=block_size)
    return ModelSource(family=fam, arch=arch, hf_dir=hf_dir, hf_config=hf)


def launched_world() -> int:
    """The number of processes the launcher started (torchrun / Slurm / ``--nproc``: WORLD_SIZE; alone: 1)."""
    return int(os.environ.get("WORLD_SIZE", 1))


def vrpo_for(cfg: Config) -> VRPO:
    """DPO's algorithm: VRPO with the ``dpo.*`` settings."""
    d = cfg.dpo
    return VRPO(
        {
            "beta": d.beta,
            "n_mc": d.n_mc,
            "margin_norm": d.margin_norm,
            "canvas_length": d.canvas_length if d.margin_norm == "canvas" else None,
        }
    )


def check_dpo(cfg: Config, arch: Optional[ModelArch]) -> VRPO:
    """A preference pair is one row of 2 x dpo.n_mc views (x_t ++ x_0 for block families): it must fit
    ``train.seq_length``; the data must be a file. Returns DPO's algorithm."""
    if not cfg.data.path:
        raise ConfigError(
            "megadare dpo trains on a preference file: set data.path (.jsonl / .json / .parquet with prompt, chosen, rejected)"
        )
    if cfg.lora.rank:  # one lora section serves SFT and RL; DPO has no LoRA path, so it must not look set
        raise ConfigError(
            f"lora.rank={cfg.lora.rank}: megadare dpo trains the full model (no LoRA path); set lora.rank=0"
        )
    algo = vrpo_for(cfg)
    block = arch is not None and arch.is_block_diffusion
    row = 2 * cfg.dpo.n_mc * cfg.data.max_length * (2 if block else 1)
    if row > cfg.train.seq_length:
        raise ConfigError(
            f"a preference pair is one row of 2 x dpo.n_mc={cfg.dpo.n_mc} views of up to "
            f"data.max_length={cfg.data.max_length} tokens{' (x2: x_t ++ x_0)' if block else ''} = {row}, "
            f"more than train.seq_length={cfg.train.seq_length}; raise train.seq_length or lower "
            "dpo.n_mc / data.max_length"
        )
    return algo
