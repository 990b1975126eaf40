"""Megatron DDP, the (distributed) optimizer and the LR schedule for a list of model chunks.

bf16/fp16 models keep fp32 master weights in megatron's mixed-precision optimizer; fp32 models (CPU) train
in fp32. ``use_distributed_optimizer`` shards the optimizer state over data-parallel ranks (ZeRO-1).

Without Transformer Engine or apex, megatron falls back to ``torch.optim.AdamW`` with its defaults: on the CPU
the single-tensor loop (about eight passes and two temporaries per parameter), on CUDA the multi-tensor
``foreach`` kernels (five passes over the fp32 state: 54 ms of a 295 ms SDAR-1.7B-shape step on an H200,
benchmarks/GPU.md). megadare switches that AdamW to torch's fused kernel (one pass, the same update) when its
parameters are all on the CPU or all on CUDA; a TE / apex fused Adam is left as megatron chose it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megadare.config.sections import ModelSection, OptimSection


class Trainable(Protocol):
    """Model chunks with the optimiser and LR schedule that train them (``trainer.policy``'s Policy or
    ValueModel)."""

    model: list[torch.nn.Module]
    optimizer: Any
    scheduler: Any


@dataclass
class OptimSettings(OptimSection):
    """The ``optim`` section's fields (their defaults are the section's: one source) plus what the optimizer
    needs besides: the number of updates the LR schedule spans and the model's parameter dtype."""

    total_steps: int = 1
    dtype: str = ModelSection.dtype  # the model section's default (fp32)


def optim_settings(cfg, total_steps: int, **overrides) -> OptimSettings:
    """The ``optim`` section's optimizer settings for ``total_steps`` updates; ``overrides`` replace fields
    (e.g. the value model's own learning rate)."""
    section = {f.name: getattr(cfg.optim, f.name) for f in fields(OptimSection)}
    return replace(OptimSettings(**section, total_steps=total_steps, dtype=cfg.model.dtype), **overrides)


def wrap_ddp(chunks: list[torch.nn.Module], distributed_optimizer: bool) -> list[DistributedDataParallel]:
    """Megatron DDP around every chunk (contiguous grad buffers; grads reduced once per step)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    out = []
    for i, c in enumerate(chunks):
        out.append(DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0))
    return out


def build_optimizer(ddp_chunks: list[DistributedDataParallel], s: OptimSettings):
    """Adam(W) through megatron's optimizer factory, plus its LR / weight-decay scheduler."""
    cfg = OptimizerConfig(
        optimizer="adam",
        lr=s.lr,
        min_lr=s.min_lr,
        weight_decay=s.weight_decay,
        adam_beta1=s.adam_beta1,
        adam_beta2=s.adam_beta2,
        adam_eps=s.adam_eps,
        clip_grad=s.clip_grad,
        bf16=s.dtype == "bf16",
        fp16=s.dtype == "fp16",
        params_dtype=torch.float32 if s.dtype == "fp32" else (torch.bfloat16 if s.dtype == "bf16" else torch.float16),
        use_distributed_optimizer=s.distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(cfg, ddp_chunks)
    fuse_torch_adam(optimizer)
    decay_steps = max(1, s.total_steps)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if s.warmup_steps else s.lr,
        max_lr=s.lr,
        min_lr=min(s.min_lr, s.lr),
        lr_warmup_steps=s.warmup_steps,
        lr_decay_steps=max(decay_steps, s.warmup_steps + 1),
        lr_decay_style=s.lr_decay_style,
        start_wd=s.weight_decay,
        end_wd=s.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def fuse_torch_adam(optimizer) -> None:
    """torch's fused AdamW for the torch optimizers inside megatron's (chained) optimizer whose parameters all
    live on the CPU or all on CUDA (module doc); TE / apex fused Adam are not torch optimizers and stay."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) or inner.state:
            continue
        kinds = {p.device.type for g in inner.param_groups for p in g["params"]}
        if len(kinds) == 1 and kinds <= {"cpu", "cuda"}:
            for g in inner.param_groups:
                g.update(fused=True, foreach=False)
