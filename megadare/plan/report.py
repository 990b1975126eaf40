"""The plan of one config: parameter counts, trainer memory per pipeline stage, rollout engine memory, verdict.

Rollout engines (RL jobs) hold, per GPU of an engine of ``rollout.engine_tp`` GPUs:

    weights  = P_total * w / engine_tp
    KV cache = 2 * L * ceil(g / engine_tp) * d * w * T * B      K and V of every layer, T = plan.prompt_length +
                                                                 rollout.max_new_tokens tokens, B = plan.rollout_batch
                                                                 sequences, at most rollout.max_batch in the built-in
                                                                 engine (KV heads replicate when engine_tp > g)
    logits   = B * block * V * 4                                 fp32 logits of the block being denoised (MDPO on
                                                                 LLaDA / Dream: of the whole response canvas)

(= 2 * layers * kv_heads * head_dim * bytes * tokens * rollout_batch / engine_tp when engine_tp divides g.)
With ``plan.rollout_gpus`` = 0 the engines share the trainer's GPUs: during rollout the trainer's weights,
gradients and optimizer states stay resident and its activations are freed, so the GPU peak is
max(trainer total, trainer static + engine). Otherwise the engines have GPUs of their own and are checked apart.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from megadare.algos import REGISTRY
from megadare.config import CHOICES, Config
from megadare.errors import ConfigError
from megadare.models.family import ModelArch
from megadare.parallel.layout import Layout
from megadare.plan.memory import (
    GIB,
    WEIGHT_BYTES,
    StageMemory,
    logits_path,
    trainer_layout,
    trainer_stages,
    trainer_world,
)
from megadare.plan.params import ParamCounts, count_params
from megadare.rollout.setup import rollout_block

JOBS = CHOICES["plan.job"]  # the one list: plan.job's Literal in the config


@dataclass(frozen=True)
class RolloutMemory:
    engines: int
    tp: int
    colocated: bool
    tokens: int  # per sequence: prompt + generated
    batch: int  # sequences per engine
    weights: float  # bytes per engine GPU
    kv_cache: float
    logits: float

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.logits


@dataclass
class PlanReport:
    model: str
    layout: Layout
    params: ParamCounts
    stages: list[StageMemory]
    rollout: RolloutMemory | None
    gpu_memory: float  # bytes per GPU
    dtype: str
    recompute: str
    distributed_optimizer: bool
    advice: list[dict[str, Any]] = field(default_factory=list)
    logits_path: str = ""  # how the last stage's output layer runs (train.logits)

    @property
    def trainer_peak(self) -> float:
        return max(s.total for s in self.stages)

    @property
    def worst_stage(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def peak(self) -> float:
        """The fullest GPU of the job (trainer, colocated trainer + engine, or an engine GPU of its own)."""
        peak = self.trainer_peak
        if self.rollout is not None:
            if self.rollout.colocated:
                peak = max(peak, max(s.static for s in self.stages) + self.rollout.total)
            else:
                peak = max(peak, self.rollout.total + self.stages[0].reserve)
        return peak

    @property
    def bottleneck(self) -> str:
        """'trainer' or 'rollout': which phase sets the peak."""
        return "trainer" if self.peak <= self.trainer_peak else "rollout"

    @property
    def fits(self) -> bool:
        return self.peak <= self.gpu_memory

    def as_dict(self) -> dict[str, Any]:
        gb = lambda x: round(x / GIB, 3)  # noqa: E731
        stages = [
            {**{k: (gb(v) if isinstance(v, float) else v) for k, v in asdict(s).items()}, "total": gb(s.total)}
            for s in self.stages
        ]
        out: dict[str, Any] = {
            "model": self.model,
            "dtype": self.dtype,
            "recompute": self.recompute,
            "distributed_optimizer": self.distributed_optimizer,
            "layout": {**asdict(self.layout), "dp": self.layout.dp, "expert_dp": self.layout.expert_dp},
            "params": {**asdict(self.params), "active_non_embedding": self.params.active_non_embedding},
            "stages_gb": stages,
            "rollout_gb": None,
            "gpu_memory_gb": gb(self.gpu_memory),
            "trainer_peak_gb": gb(self.trainer_peak),
            "peak_gb": gb(self.peak),
            "fits": self.fits,
            "bottleneck": self.bottleneck,
            "advice": self.advice,
            "logits_path": self.logits_path,
        }
        if self.rollout is not None:
            r = self.rollout
            out["rollout_gb"] = {
                "engines": r.engines,
                "tp": r.tp,
                "colocated": r.colocated,
                "tokens": r.tokens,
                "batch": r.batch,
                "weights": gb(r.weights),
                "kv_cache": gb(r.kv_cache),
                "logits": gb(r.logits),
                "total": gb(r.total),
            }
        return out


def rollout_memory(cfg: Config, arch: ModelArch, params: ParamCounts, lay: Layout) -> RolloutMemory:
    pl = cfg.plan
    w = WEIGHT_BYTES[cfg.model.dtype]
    tokens = pl.prompt_length + cfg.rollout.max_new_tokens
    kv_heads = math.ceil(arch.num_kv_heads / cfg.rollout.engine_tp)
    batch = pl.rollout_batch
    if cfg.rollout.engine == "native" and cfg.rollout.max_batch:
        batch = min(batch, cfg.rollout.max_batch)  # rows decoded together: the rest queue (continuous batching)
    kv = 2 * arch.num_layers * kv_heads * arch.head_dim * w * tokens * batch
    block = rollout_block(cfg, arch)
    algo = REGISTRY.get(cfg.algo.name)
    if algo is not None and algo.needs_step_predictions and not arch.is_block_diffusion:
        block = cfg.rollout.max_new_tokens  # MDPO: a full-attention step predicts the whole canvas after the block
    colocated = pl.rollout_gpus == 0
    gpus = lay.world if colocated else pl.rollout_gpus
    return RolloutMemory(
        engines=gpus // cfg.rollout.engine_tp,
        tp=cfg.rollout.engine_tp,
        colocated=colocated,
        tokens=tokens,
        batch=batch,
        weights=float(params.total * w / cfg.rollout.engine_tp),
        kv_cache=float(kv),
        logits=float(batch * block * arch.vocab_size * 4),
    )


def check_plan_config(cfg: Config, arch: ModelArch) -> Layout:
    """The trainer layout, validated against the GPUs the plan gives the trainer."""
    pl = cfg.plan
    if pl.job not in JOBS:
        raise ConfigError(f"plan.job={pl.job!r} is not one of {', '.join(JOBS)}")
    if pl.gpu_memory_gb <= 0 or pl.reserve_gb < 0 or pl.prompt_length < 0 or pl.rollout_gpus < 0:
        raise ConfigError(
            "plan.gpu_memory_gb must be > 0 and plan.reserve_gb, plan.prompt_length, plan.rollout_gpus >= 0"
        )
    total = pl.nodes * pl.gpus_per_node
    if pl.rollout_gpus >= total:
        raise ConfigError(
            f"plan.rollout_gpus={pl.rollout_gpus} leaves no trainer GPU of the {total} "
            f"(plan.nodes * plan.gpus_per_node)"
        )
    if pl.rollout_gpus and pl.rollout_gpus % cfg.rollout.engine_tp:
        raise ConfigError(
            f"plan.rollout_gpus={pl.rollout_gpus} is not a multiple of rollout.engine_tp={cfg.rollout.engine_tp}"
        )
    if arch.num_attention_heads % cfg.rollout.engine_tp:
        raise ConfigError(
            f"rollout.engine_tp={cfg.rollout.engine_tp} does not divide the {arch.num_attention_heads} attention heads"
        )
    world, p = trainer_world(cfg), cfg.parallel
    if p.world_size is not None and p.world_size != world:
        raise ConfigError(
            f"parallel.world_size={p.world_size} but the plan gives the trainer plan.nodes * "
            f"plan.gpus_per_node - plan.rollout_gpus = {world} GPUs: make them agree (e.g. "
            f"parallel.world_size={world} when planning another cluster shape)"
        )
    try:
        lay = trainer_layout(cfg).check_model(arch)
    except ConfigError as e:
        raise ConfigError(
            f"{e} (the trainer has plan.nodes * plan.gpus_per_node - plan.rollout_gpus = {world} GPUs)"
        ) from None
    if arch.is_moe and p.tp > 1 and not p.sp:
        raise ConfigError(f"parallel.tp={p.tp} on a MoE model needs parallel.sp=true")
    return lay


def plan_memory(cfg: Config, arch: ModelArch) -> PlanReport:
    """The memory plan of ``cfg`` for the model ``arch``, without advice (pure: reads nothing but its arguments)."""
    lay = check_plan_config(cfg, arch)
    params = count_params(arch)
    rollout = rollout_memory(cfg, arch, params, lay) if cfg.plan.job == "rl" else None
    report = PlanReport(
        model=f"{arch.architecture} ({arch.family})",
        layout=lay,
        params=params,
        stages=trainer_stages(cfg, arch, lay),
        rollout=rollout,
        gpu_memory=cfg.plan.gpu_memory_gb * GIB,
        dtype=cfg.model.dtype,
        recompute=cfg.train.recompute,
        distributed_optimizer=cfg.optim.distributed_optimizer,
        logits_path=logits_path(arch, lay, cfg),
    )
    return report
