"""The policy role: the trained model and what trains with it, built by the one ``build_policy`` of SFT, DPO and RL.

    policy = build_policy(cfg, src, updates=cfg.train.steps, lora=lora_of(cfg.sft))          # SFT
    policy = build_policy(cfg, src, updates=cfg.train.steps, reference=True)                 # DPO
    policy = build_policy(cfg, src, updates=n, lora=lora_of(cfg.rl), reference=algo.needs_ref,
                          value=algo.value_model)                                              # RL

The model is this rank's Megatron chunks with the source weights (then ``checkpoint.load``), LoRA adapters on top
when asked, wrapped for data parallelism; the optimiser and LR schedule run over ``updates`` optimiser steps. The
reference is a frozen second model, or with LoRA the policy itself with its adapters off; TraceRL's value model
is the policy's backbone with a value head and its own optimiser. ``save`` and ``resume`` checkpoint all of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megadare.algos.algorithm import ValueModelSettings
from megadare.config import Config
from megadare.trainer.checkpoint import load_train_checkpoint, resume_run, save_train_checkpoint
from megadare.trainer.model_setup import build_training_chunks
from megadare.trainer.optim import build_optimizer, optim_settings, wrap_ddp


@dataclass(frozen=True)
class LoRA:
    """Adapters on the policy: rank, alpha and the target projections."""

    rank: int
    alpha: float
    targets: tuple[str, ...]


def lora_of(section) -> Optional[LoRA]:
    """The LoRA settings of a config section (``sft`` or ``rl``: ``lora_rank`` > 0 turns them on)."""
    if section.lora_rank <= 0:
        return None
    return LoRA(section.lora_rank, section.lora_alpha, tuple(section.lora_targets))


@dataclass
class Policy:
    """The trained model (DDP-wrapped chunks), its optimiser and LR schedule, the reference and the value model."""

    model: list
    optimizer: Any
    scheduler: Any
    ref_chunks: Optional[list] = None  # frozen reference (KL algorithms, DPO)
    value: Optional[tuple] = None  # (chunks, optimizer, scheduler) of the value model (TraceRL)
    ref_adapters_off: bool = False  # LoRA: the reference is ``model`` with its adapters off

    def save(self, root: str, step: int, train_state: dict, **kw) -> str:
        """Atomic checkpoint of model, optimiser and schedule (``checkpoint.save_train_checkpoint``'s keywords)."""
        return save_train_checkpoint(root, step, self.model, self.optimizer, self.scheduler, train_state, **kw)

    def resume(self, root: str, src, written_by: str, source: Optional[str]) -> dict[str, Any]:
        """Model, optimiser and schedule from the newest intact checkpoint under ``root`` (``checkpoint.resume_run``);
        the checkpoint's train state ({} when there is none)."""
        return resume_run(root, self.model, self.optimizer, self.scheduler, src, written_by, source=source)


def build_policy(
    cfg: Config,
    src,
    *,
    updates: int,
    lora: Optional[LoRA] = None,
    reference: bool = False,
    value: Optional[ValueModelSettings] = None,
) -> Policy:
    """The run's policy over ``updates`` optimiser steps; ``reference``: the algorithm compares with the initial
    model; ``value``: the algorithm trains a value model with these settings."""
    chunks = initial_chunks(cfg, src)
    if lora is not None:
        from megadare.models.lora import apply_lora  # megatron

        apply_lora(chunks, lora.rank, lora.alpha, targets=lora.targets)
    model = wrap_ddp(chunks, cfg.train.distributed_optimizer)
    optimizer, scheduler = build_optimizer(model, optim_settings(cfg, updates))
    policy = Policy(model, optimizer, scheduler, ref_adapters_off=reference and lora is not None)
    if reference and not policy.ref_adapters_off:
        policy.ref_chunks = frozen_chunks(cfg, src)
    if value is not None:
        policy.value = build_value_model(cfg, src, value, updates)
    return policy


def initial_chunks(cfg: Config, src) -> list:
    """This rank's model chunks with the source weights, then ``checkpoint.load`` (model only) when set."""
    chunks = build_training_chunks(cfg, src)
    if cfg.checkpoint.load:
        load_train_checkpoint(cfg.checkpoint.load, chunks, None, None, load_optimizer=False, src=src)
    return chunks


def frozen_chunks(cfg: Config, src) -> list:
    """:func:`initial_chunks` in eval mode without gradients: the frozen reference model of DPO and RL."""
    chunks = initial_chunks(cfg, src)
    for c in chunks:
        c.eval().requires_grad_(False)
    return chunks


def build_value_model(cfg: Config, src, settings: ValueModelSettings, updates: int):
    """(chunks, optimizer, scheduler) of TraceRL's value model: the policy's backbone (``checkpoint.load`` when
    set) + a zero-init value head, trained at ``settings.lr``."""
    from megadare.algos.value_model import attach_value_head  # megatron

    model = initial_chunks(cfg, src)
    attach_value_head(model)
    model = wrap_ddp(model, cfg.train.distributed_optimizer)
    opt, sched = build_optimizer(
        model, optim_settings(cfg, updates, lr=settings.lr, min_lr=0.0, warmup_steps=0, lr_decay_style="constant")
    )
    return model, opt, sched
