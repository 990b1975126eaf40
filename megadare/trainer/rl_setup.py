"""Everything an RL run holds, built once: ``setup_run(spec) -> RLRun``, and its checkpoint (``save_run``).

The run is its roles: the resolved ``RunSpec`` (config, model source, algorithm, sampling parameters), the
``Policy`` (model, optimiser, schedule, reference and value model), the ``Rollouts`` (tokenizer, reward, prompts,
engines and queue on rank 0) and the ``WeightSync`` between them; then the loop's state: the step, the async
state (weight snapshots, replay buffer), the monitor, evals and history. A restarted run resumes here from the
newest checkpoint under ``checkpoint.save`` (or ``<run_dir>/ckpt``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch.distributed as dist

from megadare.config import Config, optimizer_updates
from megadare.convert.hf_megatron import mapping_for
from megadare.data.files import DataError
from megadare.data.prompt_data import load_rl_prompts
from megadare.errors import ConfigError, PeerError, RunStateError
from megadare.parallel.rank0 import run_on_rank0
from megadare.rewards import check_isolation, gold_problem, load_reward, reward_notes, runs_code, set_isolation
from megadare.rollout.ray_health import job_stop_errors, lost_to_sigterm
from megadare.rollout.setup import start_engines
from megadare.rollout.weight_sync.sync import SyncSettings, WeightSync
from megadare.trainer.checkpoint import (
    CheckpointState,
    Provenance,
    config_record,
    load_checkpoint_object,
    said_setting_changes,
)
from megadare.trainer.data_order import StepSampler, check_same_order
from megadare.trainer.model_setup import materialise, tokenizer_for
from megadare.trainer.monitor import Monitor, write_run_config
from megadare.trainer.offpolicy.correction import needs_snapshots, queued_samples_per_prompt, restored_queue_problem
from megadare.trainer.offpolicy.queue import WeightSnapshots
from megadare.trainer.offpolicy.replay import ReplayBuffer
from megadare.trainer.policy import Policy, build_policy, lora_of
from megadare.trainer.rl_rollout import Rollouts
from megadare.trainer.sft_loop import checkpoint_root
from megadare.trainer.spec import RunSpec


@dataclass
class RLRun:
    """The RL run's roles (spec, policy, rollouts, weight sync) and the loop's state."""

    spec: RunSpec
    policy: Policy
    rollouts: Rollouts
    save_root: str
    step: int = 0
    snapshots: Optional[WeightSnapshots] = None  # async correction
    buffer: Optional[ReplayBuffer] = None  # D-ARL
    async_state: Optional[dict] = None  # the checkpoint's queue / replay state (resume)
    weight_sync: Optional[WeightSync] = None  # pushes the policy into the engines (every rank)
    monitor: Optional[Monitor] = None
    evals: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    ray_lost: bool = False  # Ray died with a SIGTERM the run got: it stops and saves without Ray (trainer/rl.py)

    @property
    def cfg(self) -> Config:
        return self.spec.cfg

    @property
    def algo(self):
        return self.spec.algo

    @property
    def manager(self):
        """The engines' RolloutManager (rank 0; None elsewhere)."""
        return self.rollouts.manager

    @property
    def rank0(self) -> bool:
        return dist.get_rank() == 0

    @property
    def ahead(self) -> int:
        return self.rollouts.ahead


def rl_data(spec: RunSpec) -> tuple[Any, list, list]:
    """(tokenizer, training prompts, held-out prompts): read before the run writes anything (its lock's ``ckpt/``, a
    tiny model's ``init_hf/``), so a data file the run refuses leaves none of them behind."""
    tok = tokenizer_for(spec.cfg, spec.source, generates=True)
    return (tok, *_prompts(spec.cfg, tok))


def setup_run(spec: RunSpec, data: Optional[tuple[Any, list, list]] = None) -> RLRun:
    """Build the run on this rank (torch.distributed is initialised); rank 0 also starts the engines. ``data``:
    ``rl_data``, read now if not given."""
    cfg = spec.cfg
    tok, train_prompts, held_prompts = rl_data(spec) if data is None else data
    spec = replace(spec, source=materialise(spec.source, cfg))
    set_isolation(cfg.rewards.code.isolation)
    if runs_code(cfg.rewards.name, [p.record for p in train_prompts + held_prompts]):
        check_isolation()  # refuse now, not at the first scored step, where the kernel refuses the sandbox
    reward_fn = load_reward(cfg.rewards.name)
    policy = rl_policy(cfg, spec.source, spec.algo)
    sampler = StepSampler(len(train_prompts), cfg.rl.prompts_per_step, cfg.seed, cfg.data.shuffle)
    rollouts = Rollouts(spec, tok, reward_fn, train_prompts, held_prompts, sampler)
    run = RLRun(spec, policy, rollouts, save_root=checkpoint_root(cfg))
    run.snapshots = WeightSnapshots(run.policy.model) if needs_snapshots(cfg, run.ahead) else None
    run.buffer = ReplayBuffer(cfg.replay.k, cfg.replay.warmup) if cfg.replay.enable else None
    _resume(run)
    if run.rank0:
        write_run_config(cfg)
        for note in reward_notes(cfg.rewards.name, [p.record for p in train_prompts + held_prompts]):
            print(note, file=sys.stderr, flush=True)
        rollouts.manager = start_engines(cfg, spec.source, tok)
    run.weight_sync = _weight_sync(cfg, run)
    return run


def _weight_sync(cfg: Config, run: RLRun):
    """The run's weight sync (every rank; rank 0 drives the engines): transport and bucket size from the config,
    block-fp8 linear weights for SGLang engines serving an fp8 export."""
    return WeightSync(
        run.policy.model, mapping_for(run.spec.source.hf_config)[2], run.manager, SyncSettings.of(cfg.rollout)
    )


def _prompts(cfg: Config, tok) -> tuple[list, list]:
    """(training prompts, held-out prompts), tokenized through the chat template, each with its file:row; every
    gold readable by the reward (:func:`check_golds`)."""
    train, held = load_rl_prompts(cfg, tok, prompt_budget(cfg))
    check_golds(cfg.rewards.name, train + held)
    return train, held


def check_golds(reward: str, prompts: list) -> None:
    """Stop at the start, naming the rows, when a prompt's gold is one no response could score under the built-in
    ``reward`` (``rewards.gold_problem``): scored, such a row fails its reward (an error, not a 0) and would stop
    the run at the step that first draws it, hours in."""
    bad = [(p.where, why) for p in prompts if (why := gold_problem(reward, p.record))]
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise DataError(
            f"{bad[0][0]}: {bad[0][1]}. {len(bad)} prompt row(s) have a gold no response could match "
            f"({', '.join(w for w, _ in bad[:5])}{more}): fix or drop them"
        )


def prompt_budget(cfg: Config) -> int:
    """The longest RL prompt: data.max_length (prompt + response) minus rollout.max_new_tokens."""
    budget = cfg.data.max_length - cfg.rollout.max_new_tokens
    if budget < 1:
        raise ConfigError(
            f"data.max_length={cfg.data.max_length} (prompt + response tokens) leaves no room for a "
            f"prompt beside rollout.max_new_tokens={cfg.rollout.max_new_tokens}; raise data.max_length"
        )
    return budget


def rl_policy(cfg: Config, src, algo) -> Policy:
    """The RL policy (LoRA adapters with ``lora.rank``) over every update of the run, with the reference /
    value model when the algorithm asks for them."""
    return build_policy(
        cfg,
        src,
        updates=optimizer_updates(cfg, "rl"),
        lora=lora_of(cfg.lora),
        reference=algo.needs_ref,
        value=algo.value_model,
    )


def _resume(run: RLRun) -> None:
    """Restore step, optimizer, value model, weight snapshots, replay buffer and queue state from the newest
    checkpoint of the run (nothing when there is none)."""
    pol, cfg = run.policy, run.cfg
    hf = None if cfg.model.tiny else cfg.model.hf_path
    state = pol.resume(run.save_root, run.spec.source, "megadare rl", hf, algo=run.algo.name)
    if not state:
        return
    check_same_order(state, run.rollouts.sampler, "rl.prompts_per_step", "consumed_prompts")
    resume_from, run.step = state["resumed_from"], int(state["step"])
    run.evals = {int(k): v for k, v in (state.get("evals") or {}).items()}
    run.async_state = load_checkpoint_object(resume_from, "rl_async")
    if run.snapshots is not None:
        _load_snapshots(run, resume_from)
    if run.buffer is not None and run.async_state is not None and run.async_state.get("replay"):
        run.buffer.load_state_dict(run.async_state["replay"])
    run_on_rank0(lambda: _check_restored_queue(run, resume_from))  # rank 0 holds the queue; every rank stops
    said_setting_changes(state, cfg)


def _load_snapshots(run: RLRun, resume_from: str) -> None:
    """This rank's weight snapshots from ``resume_from``; refused (RunStateError, one line) when it has none while
    stale rollouts are queued, or ones of another layout's shards (the same world size in another layout: the
    first stale step's behaviour pass copied them into the parameters and died of a raw shape error)."""
    cfg = run.cfg
    snaps = load_checkpoint_object(resume_from, "weight_snapshots", per_rank=True)
    if snaps is None and run.ahead:
        raise RunStateError(
            f"{resume_from} has no weight snapshots for this rank (a different layout or "
            f"{cfg.as_written('offpolicy.loss_mode')}?): the queued stale rollouts cannot be corrected; resume "
            "with the layout and offpolicy settings it was saved with, or start a new run from its weights "
            "(checkpoint.load with a new logging.run_dir)"
        )
    misfit = run.snapshots.misfit(snaps or {})
    if misfit:
        raise RunStateError(
            f"{resume_from}: {misfit}: it was saved under another parallel layout (parallel.tp / pp / vpp / ep), "
            "so the stale rollouts it queued cannot be corrected; resume with the layout it was saved with, or "
            "start a new run from its weights (checkpoint.load with a new logging.run_dir)"
        )
    run.snapshots.load_state_dict(snaps or {})


def _check_restored_queue(run: RLRun, resume_from: str) -> None:
    """Rank 0: refuse, in one line naming the settings, queued rollouts of the checkpoint the resumed settings
    cannot train: made with another rl.n_samples (scored against the wrong prompts and grouped wrongly, silently,
    or an IndexError steps later), or ``restored_queue_problem`` (staler than a shorter queue allows, or their
    behaviour snapshot not kept under it)."""
    cfg = run.cfg
    queue = {int(k): v for k, v in ((run.async_state or {}).get("queue") or {}).items() if int(k) >= run.step}
    made = sorted({queued_samples_per_prompt(*v) for v in queue.values()} - {cfg.rl.n_samples})
    if made:
        raise RunStateError(
            f"{resume_from} holds the rollouts queued for RL steps {min(queue) + 1}..{max(queue) + 1}, made with "
            f"{cfg.as_written('rl.n_samples')}={made[0]} (this config: {cfg.rl.n_samples}): they cannot train under "
            "these settings; set them back to resume, or start a new run from its weights (checkpoint.load=<that "
            "checkpoint> with a new logging.run_dir)"
        )
    held = run.buffer.versions if run.buffer is not None else ()
    problem = restored_queue_problem(cfg, queue, run.ahead, held, run.snapshots)
    if problem:
        raise RunStateError(
            f"{resume_from}: {problem}: it was saved with a deeper rollout queue; resume with the "
            f"{cfg.as_written('offpolicy.mode')} and {cfg.as_written('offpolicy.max_staleness')} it was saved "
            "with, or start a new run from its weights (checkpoint.load with a new logging.run_dir)"
        )


def save_run(run: RLRun) -> None:
    """Atomic checkpoint of the policy (and its value model), the queued rollouts, replay buffer and snapshots."""
    cfg, pol, step = run.cfg, run.policy, run.step
    meta = {
        "family": run.spec.source.family.name,
        "architecture": run.spec.arch.architecture,
        "written_by": "megadare rl",
        "algo": run.algo.name,
    }
    if cfg.lora.rank > 0:  # the export folds the adapters in (convert._merged_lora)
        meta["lora"] = {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha}
    state = (
        {
            "queue": queued_rollouts(run),
            "replay": run.buffer.state_dict() if run.buffer is not None else None,
        }
        if run.rank0
        else None
    )
    saved = CheckpointState(
        {
            "rl_step": step,
            "consumed_prompts": step * cfg.rl.prompts_per_step,
            "evals": run.evals,
            "data_order": run.rollouts.sampler.settings(),
            "config": config_record(cfg),
        },
        objects={"rl_async": state} if run.rank0 else None,
        rank_objects={"weight_snapshots": run.snapshots.state_dict()} if run.snapshots is not None else None,
    )
    pol.save(run.save_root, step, saved, Provenance(meta, run.spec.source.hf_dir), cfg.checkpoint.keep_last)


def queued_rollouts(run: RLRun) -> dict:
    """Rank 0: the queued rollouts for the checkpoint, finished first while Ray is up (a partial rollout: its
    running segments, ``RolloutQueue.drain``); Ray going down with the job meanwhile (a SIGTERM:
    ``lost_to_sigterm``), only those already finished (a resumed run starts the others again), so the checkpoint
    still lands."""
    if not run.ray_lost:
        try:
            with job_stop_errors("finishing the queued rollouts for the checkpoint"):
                return run.rollouts.queue.drain(finish=True)
        except PeerError as e:
            if not lost_to_sigterm(e):
                raise
    return run.rollouts.queue.drain(finish=False)
