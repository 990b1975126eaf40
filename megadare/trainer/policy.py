"""The policy role: the trained model and what trains with it, built by the one ``build_policy`` of SFT, DPO and RL.

    policy = build_policy(cfg, src, updates=cfg.train.steps, lora=lora_of(cfg.lora))          # SFT
    policy = build_policy(cfg, src, updates=cfg.train.steps, reference=True)                 # DPO
    policy = build_policy(cfg, src, updates=n, lora=lora_of(cfg.lora), reference=algo.needs_ref,
                          value=algo.value_model)                                              # RL

The model is this rank's Megatron chunks with the source weights (then ``checkpoint.load``), LoRA adapters on top
when asked, wrapped for data parallelism; the optimiser and LR schedule run over ``updates`` optimiser steps. The
reference is a frozen second model, or with LoRA the policy itself with its adapters off; TraceRL's value model
is the policy's backbone with a value head and its own optimiser (``ValueModel``). ``save`` and ``resume``
checkpoint all of it. In RL the policy also ``prepare``s a step's micro-batches (old / reference / value / behaviour
passes), ``update``s itself on them (``trainer/rl_update.py``) and ``push``es its weights into the engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megadare.algos.algorithm import ValueModelSettings
from megadare.algos.value_model import attach_value_head
from megadare.config import Config
from megadare.convert.mcore_ckpt import iteration_dirs
from megadare.errors import RunStateError
from megadare.models.lora import apply_lora, merged_weights
from megadare.trainer import rl_update
from megadare.trainer.checkpoint import (
    CheckpointState,
    Provenance,
    load_train_checkpoint,
    resume_run,
    save_train_checkpoint,
)
from megadare.trainer.checkpoint_rotation import drop_rolled_back, iteration_dir, prune_checkpoints
from megadare.trainer.model_setup import build_training_chunks
from megadare.trainer.optim import build_optimizer, optim_settings, wrap_ddp


@dataclass(frozen=True)
class LoRA:
    """Adapters on the policy: rank, alpha and the target projections."""

    rank: int
    alpha: float
    targets: tuple[str, ...]


def lora_of(section) -> Optional[LoRA]:
    """The LoRA settings of config section ``lora`` (``rank`` > 0 turns them on)."""
    if section.rank <= 0:
        return None
    return LoRA(section.rank, section.alpha, tuple(section.targets))


@dataclass
class ValueModel:
    """TraceRL's value model: the policy's backbone with a value head (DDP-wrapped chunks), its optimiser and LR
    schedule; checkpointed beside the policy under ``<root>_value`` at the same steps."""

    model: list
    optimizer: Any
    scheduler: Any

    @staticmethod
    def root_of(policy_root: str) -> str:
        return policy_root + "_value"

    def save(self, policy_root: str, step: int, meta: dict, keep_last: int) -> str:
        about = Provenance({**meta, "value_model": True})
        return save_train_checkpoint(
            self.root_of(policy_root), step, self, CheckpointState({"rl_step": step}), about, keep_last
        )

    def load(self, policy_root: str, step: int) -> None:
        load_train_checkpoint(
            iteration_dir(self.root_of(policy_root), step), self.model, self.optimizer, self.scheduler
        )


@dataclass
class Policy:
    """The trained model (DDP-wrapped chunks), its optimiser and LR schedule, the reference and the value model."""

    model: list
    optimizer: Any
    scheduler: Any
    ref_chunks: Optional[list] = None  # frozen reference (KL algorithms, DPO)
    value: Optional[ValueModel] = None  # TraceRL
    ref_adapters_off: bool = False  # LoRA: the reference is ``model`` with its adapters off
    lora: Optional[LoRA] = None  # the adapters trained (None: full fine-tuning); saved, checked on resume

    def adapters(self) -> Optional[dict]:
        """The LoRA settings a checkpoint records (``checkpoint.resume_run`` compares them), None without LoRA."""
        lo = self.lora
        return {"rank": lo.rank, "alpha": lo.alpha, "targets": sorted(lo.targets)} if lo is not None else None

    def save(self, root: str, step: int, state: CheckpointState, about: Provenance, keep_last: int) -> str:
        """Atomic checkpoint of model, optimiser, schedule and the run's ``state``
        (``checkpoint.save_train_checkpoint``), after the value model's of the same step: the policy's rename
        commits the step (a kill between the two leaves a value checkpoint newer than the policy's, which resume
        sets aside until this save of its step removes it; the other order left a first checkpoint without its
        value model, and no run could go on)."""
        if self.value is None:
            return save_train_checkpoint(root, step, self, state, about, keep_last)
        self.value.save(root, step, about.meta, keep_last=0)
        path = save_train_checkpoint(root, step, self, state, about, keep_last=0)
        for r in (root, self.value.root_of(root)):  # once both of this step are in place: a kill between the
            prune_checkpoints(r, keep_last, step)  # two saves must leave an older step that has both
        drop_rolled_back(self.value.root_of(root), step)  # what resumes set aside, now replaced
        return path

    def companion_roots(self, root: str) -> tuple[str, ...]:
        """Checkpoint roots saved beside ``root`` at the same steps (the value model's): a step counts only with
        them intact (``checkpoint.resume_run``)."""
        return (ValueModel.root_of(root),) if self.value is not None else ()

    def resume(
        self, root: str, src, written_by: str, source: Optional[str], algo: Optional[str] = None
    ) -> dict[str, Any]:
        """Model, optimiser and schedule from the newest intact checkpoint under ``root`` (``checkpoint.resume_run``)
        and the value model's of the same step; the checkpoint's train state ({} when there is none)."""
        self._check_same_value_model(root)
        state = resume_run(root, self, src, written_by, source=source, algo=algo)
        if state and self.value is not None:
            self.value.load(root, int(state["step"]))
        return state

    def _check_same_value_model(self, root: str) -> None:
        """Refuse (one line) resuming checkpoints trained with a value model without one, or the reverse: the run
        would stop saying every checkpoint is damaged (its value model missing), or drop the value model's
        training without a word."""
        value_root = ValueModel.root_of(root)
        if not iteration_dirs(root) or bool(iteration_dirs(value_root)) == (self.value is not None):
            return
        had, has = ("no", "one") if self.value is not None else ("one", "none")
        raise RunStateError(
            f"the checkpoints under {root} were trained with {had} value model ({value_root} holds "
            f"{'none' if had == 'no' else 'its checkpoints'}), this config trains {has} (algo.params.value_model="
            f"{str(self.value is not None).lower()}): set it back, or start a new run (logging.run_dir / "
            "checkpoint.save, with checkpoint.load to start from its weights)"
        )

    def prepare(self, su, groups, objective, correction, out: dict) -> tuple[list[list], int]:
        """An RL step's micro-batches with their old / reference / value / behaviour passes
        (``rl_update.prepare_all``)."""
        return rl_update.prepare_all(su, groups, self, objective, correction, out)

    def update(self, su, samples, objective, correction=None) -> dict[str, float]:
        """One RL step's optimiser steps of the policy (and value model) on ``samples`` (``rl_update.update``)."""
        return rl_update.update(su, samples, self, objective, correction)

    def push(self, weight_sync, version: int) -> dict[str, float]:
        """Push the current weights into the engines as ``version`` (collective; with LoRA the engines get the
        merged W + s B A). The run's ``WeightSync`` is passed: it is built after the engines start and closed
        with them, and SFT / DPO policies have none."""
        with merged_weights(self.model):
            return weight_sync.push(version)


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
        apply_lora(chunks, lora.rank, lora.alpha, targets=lora.targets)
    model = wrap_ddp(chunks, cfg.optim.distributed_optimizer)
    optimizer, scheduler = build_optimizer(model, optim_settings(cfg, updates))
    policy = Policy(model, optimizer, scheduler, ref_adapters_off=reference and lora is not None, lora=lora)
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


def build_value_model(cfg: Config, src, settings: ValueModelSettings, updates: int) -> ValueModel:
    """TraceRL's value model: the policy's backbone (``checkpoint.load`` when set) + a zero-init value head,
    trained at ``settings.lr``."""
    model = initial_chunks(cfg, src)
    attach_value_head(model)
    model = wrap_ddp(model, cfg.optim.distributed_optimizer)
    opt, sched = build_optimizer(
        model, optim_settings(cfg, updates, lr=settings.lr, min_lr=0.0, warmup_steps=0, lr_decay_style="constant")
    )
    return ValueModel(model, opt, sched)
