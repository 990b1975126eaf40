"""Training checkpoints: model + optimizer + LR schedule + RNG + data position, saved atomically, resumable.

Layout of a run's checkpoint root (Megatron-LM's, so megatron tools and our converters read it):

    <root>/iter_0000006/            megatron distributed checkpoint (torch_dist): model keys as written by the
                                    converter ("model." / "model<i>.") plus "optimizer." (fully reshardable)
    <root>/iter_0000006/train_state.json   step, data position, scheduler state, config
    <root>/iter_0000006/rng/rank_00000.pt  per-rank torch + megatron RNG tracker states
    <root>/iter_0000006/manifest.json      every file with its size (sha256 of the small ones), written last
    <root>/latest_checkpointed_iteration.txt

A save goes to ``iter_X.tmp`` and is renamed once every rank finished; the tracker file is replaced atomically
after that, so a crash at any point leaves the previous checkpoint loadable; a failed write (a full disk) removes
the partial ``iter_X.tmp``. ``keep_last`` old checkpoints are kept. megatron's writer processes die with the
trainer (convert/ckpt_writers.py).

Resume (``resume_run``) takes the newest checkpoint whose manifest holds, passing over damaged ones and saying
which and why (the tracker file is a hint, not the authority); checkpoints of older megadare versions, without a
manifest, are checked against their .metadata. It refuses a checkpoint of another model or command, and applies
this run's LR-schedule settings over the checkpoint's, saying which changed.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from megadare.convert.ckpt_writers import writers_die_with_trainer
from megadare.errors import RunStateError
from megadare.models.family import ModelConfigError, family_of
from megadare.trainer.optim_groups import group_settings, restore_group_settings
from megadare.trainer.checkpoint_rotation import (
    ROOT_ID,
    _say,
    iteration_dir,
    prune_checkpoints,
    root_id,
)
from megadare.convert.mcore_ckpt import (
    HF_SUBDIR,
    MEGADARE_META,
    SHARDED_SD_METADATA,
    TRACKER,
    MegatronCheckpointError,
    _barrier,
    _drop_extra_state,
    _finalise,
    _rank,
    _tmp,
    intact_checkpoint_dir,
    iteration_dirs,
    iteration_step,
    newest_intact,
    load_into_chunks,
    model_sharded_state_dict,
    read_json,
    resolve_checkpoint_dir,
    write_meta,
)

TRAIN_STATE = "train_state.json"
OPTIM_METADATA = {**SHARDED_SD_METADATA, "distrib_optim_sharding_type": "fully_reshardable"}


if TYPE_CHECKING:  # annotations only: trainer/optim.py imports megatron at its top
    from megadare.trainer.optim import Trainable


@dataclass(frozen=True)
class CheckpointState:
    """What a training checkpoint holds besides model, optimiser and schedule: the JSON ``train_state`` (steps,
    consumed data, evals; ``step``, world size and schedule are added), ``objects`` (picklable state saved by
    rank 0 as ``<name>.pt``, e.g. the RL loop's queued rollouts and replay buffer) and ``rank_objects``
    (per-rank state saved as ``<name>/rank_XXXXX.pt``, e.g. weight snapshots of this rank's shards). Read the
    objects back with ``load_checkpoint_object``."""

    train_state: dict[str, Any] = field(default_factory=dict)
    objects: Optional[dict[str, Any]] = None
    rank_objects: Optional[dict[str, Any]] = None


@dataclass(frozen=True)
class Provenance:
    """Where a checkpoint comes from: its ``meta`` (family, architecture, written_by, ...) and the HF checkpoint
    ``hf_files_from`` whose config / tokenizer files it carries (its path is recorded as ``source``)."""

    meta: dict[str, Any] = field(default_factory=dict)
    hf_files_from: Optional[str] = None


def _unwrap(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The models inside megatron's DDP (one level: megadare wraps nothing else). Not megatron.core.utils'
    unwrap_model: this module imports no megatron at its top."""
    return [getattr(c, "module", c) for c in chunks]


def _init_empty_optimizer_state(optimizer) -> list[tuple[dict, torch.Tensor]]:
    """Give the parameters of a fresh Adam their state tensors (zeros, step 0) so megatron can describe the state
    (megatron's torch-Adam path needs a 'step' entry per parameter). Returns the (state, parameter) pairs filled."""
    filled = []
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = o.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if len(inner.state[p]) == 0:
                    filled.append((inner.state, p))
                    inner.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    inner.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)
                    inner.state[p]["step"] = torch.tensor(0.0)
    return filled


def _unshare_adam_steps(optimizer) -> None:
    """megatron's torch-Adam load path gives every parameter the SAME 'step' tensor; torch's foreach Adam then
    increments it once per parameter per step (wrong bias correction after a resume). One tensor each."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        for st in o.optimizer.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()


def _sharded_state(chunks, optimizer, is_loading: bool) -> dict:
    model_sd = model_sharded_state_dict(_unwrap(chunks))
    sd = dict(model_sd)
    if optimizer is not None:
        # a fresh Adam (loading, or saving before the first update: an RL run whose first steps kept no
        # group) gets zero moments at step 0, which megatron can describe; they save and load as a fresh Adam
        filled = _init_empty_optimizer_state(optimizer)
        sd["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=dict(OPTIM_METADATA))
        for state, p in filled:  # back to unallocated (only what was filled here): megatron's load_state_dict
            del state[p]  # allocates the state it restores, a fresh Adam allocates at its first step
    return _drop_extra_state(sd)


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker  # heavy: this module loads without megatron

    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker  # heavy: this module loads without megatron

    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def save_train_checkpoint(
    root: str,
    step: int,
    trained: Trainable,
    state: CheckpointState,
    about: Provenance = Provenance(),
    keep_last: int = 2,
) -> str:
    """Save everything needed to resume at ``step`` (collective): ``trained``'s model, optimiser and schedule and
    the run's ``state``, all inside one atomic rename; the newest ``keep_last`` are kept. Returns the checkpoint
    directory. A failed write (a full disk) removes the partial ``iter_X.tmp`` and raises MegatronCheckpointError
    in one line."""
    final = iteration_dir(root, step)
    tmp = _tmp(final)
    hf = about.hf_files_from
    about = Provenance(dict(about.meta, **({"source": os.path.abspath(hf)} if hf else {})), hf)
    if _rank() == 0:  # the one that writes megadare.json
        about = Provenance(dict(about.meta, **{ROOT_ID: root_id(root)}), hf)
    try:
        _write_train_checkpoint(tmp, root, step, trained, state, about)
        if _rank() == 0:
            _finalise(tmp, final)
    except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_iteration(root)
        raise MegatronCheckpointError(
            f"saving {final} failed: {_os_reason(e)}{_space_hint(root)}; the partial {os.path.basename(tmp)} was "
            "removed"
            + (
                f" and {previous} is intact: fix the cause, then rerun the same command to resume from it"
                if previous
                else ""
            )
        ) from None
    if _rank() == 0:
        _write_tracker(root, step)
        prune_checkpoints(root, keep_last, step)
    _barrier()
    return final


def _write_tracker(root: str, step: int) -> None:
    """Point the tracker at ``step`` (atomic: a temp file, then a rename). A failure is one line: the checkpoint
    it names is in place, and a resume finds it without the tracker (the newest intact ``iter_*``)."""
    tracker_tmp = os.path.join(root, TRACKER + ".tmp")
    try:
        with open(tracker_tmp, "w") as f:
            f.write(str(step))
        os.replace(tracker_tmp, os.path.join(root, TRACKER))
    except OSError as e:
        raise MegatronCheckpointError(
            f"{os.path.join(root, TRACKER)}: writing the tracker failed: {_os_reason(e)}{_space_hint(root)}; "
            f"{iteration_dir(root, step)} is saved and intact: fix the cause, then rerun the same command to resume "
            "from it"
        ) from None


def _write_train_checkpoint(
    tmp: str, root: str, step: int, trained: Trainable, state: CheckpointState, about: Provenance
) -> None:
    """Every file of the checkpoint into ``tmp`` (collective); rank 0 writes train_state.json and the meta last."""
    from megatron.core import dist_checkpointing  # heavy: this module loads without megatron

    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed save of this very step: ours
        os.makedirs(tmp)
    _barrier()
    with writers_die_with_trainer():
        dist_checkpointing.save(_sharded_state(trained.model, trained.optimizer, is_loading=False), tmp)
    world = dist.get_world_size() if dist.is_initialized() else 1
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{_rank():05d}.pt"))
    for name, obj in (state.rank_objects or {}).items():
        os.makedirs(os.path.join(tmp, name), exist_ok=True)
        torch.save(obj, os.path.join(tmp, name, f"rank_{_rank():05d}.pt"))
    if _rank() == 0:
        for name, obj in (state.objects or {}).items():
            torch.save(obj, os.path.join(tmp, f"{name}.pt"))
    _barrier()
    if _rank() == 0:
        scheduler = trained.scheduler
        train_state = dict(
            state.train_state,
            step=step,
            world_size=world,
            layout=_layout(),
            scheduler=scheduler.state_dict() if scheduler is not None else None,
            **({"lora": trained.adapters()} if hasattr(trained, "adapters") else {}),
        )
        with open(os.path.join(tmp, TRAIN_STATE), "w") as f:
            json.dump(train_state, f, indent=2, default=str)
        write_meta(tmp, about.meta, about.hf_files_from)


def _os_reason(e: BaseException) -> str:
    """The operating-system error behind a failed save or load (through megatron's and torch's wrappers, which
    gather per-rank errors as pickles: the OSError may survive only as its text), in words."""
    seen: set[int] = set()
    todo: list[BaseException] = [e]
    innermost = e
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno:
            return f"{x.strerror or os.strerror(x.errno)}" + (f" ({x.filename})" if x.filename else "")
        m = re.search(r"\[Errno \d+\] ([^:\n]+)(?:: '([^'\n]+)')?", str(x))
        if m and not isinstance(x, CheckpointException):
            return m.group(1) + (f" ({m.group(2)})" if m.group(2) else "")
        todo += [c for c in (x.__cause__, x.__context__) if c is not None]
        for f in getattr(x, "failures", {}).values():  # torch.distributed.checkpoint's per-rank failures
            inner = [y for y in (f if isinstance(f, tuple) else (f,)) if isinstance(y, BaseException)]
            innermost = inner[0] if inner else innermost
            todo += inner
    first = str(innermost).strip().splitlines()
    return f"{type(innermost).__name__}: {first[0] if first else ''}"


def _space_hint(root: str) -> str:
    """What may have stopped a write that failed without saying why (torch's zip writer reports a full disk or a
    file-size limit as 'unexpected pos'): a file-size limit of this process, a nearly full disk under ``root``."""
    said = []
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        said.append(f"this process may write files of at most {limit} bytes (ulimit -f)")
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    if free is not None and free < 1 << 30:
        said.append(f"the disk of {root} has {free >> 20} MiB free")
    return f" ({'; '.join(said)})" if said else ""


def latest_iteration(root: str) -> Optional[str]:
    """The newest ``iter_*`` directory under ``root`` (unchecked), or None."""
    its = iteration_dirs(root)
    return its[0] if its else None


def load_checkpoint_object(path: str, name: str, per_rank: bool = False) -> Any:
    """An object saved with ``CheckpointState.objects`` (or this rank's of ``rank_objects``); None
    when the checkpoint has none."""
    ckpt = resolve_checkpoint_dir(path)
    f = os.path.join(ckpt, name, f"rank_{_rank():05d}.pt") if per_rank else os.path.join(ckpt, f"{name}.pt")
    return torch.load(f, weights_only=False) if os.path.exists(f) else None


# a checkpoint's model must be this model: these ModelArch fields shape its tensors
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "ffn_hidden_size",
    "num_experts",
    "moe_ffn_hidden_size",
    "num_shared_experts",
    "first_k_dense",
    "qk_norm",
    "qkv_bias",
    "tie_word_embeddings",
)


def check_same_model(ckpt: str, src) -> None:
    """Refuse (MegatronCheckpointError, one line) a checkpoint of another model than ``src`` (a ModelSource):
    the family and architecture first, then the config.json fields that shape the tensors, naming what differs."""
    meta_file = os.path.join(ckpt, MEGADARE_META)
    meta = read_json(meta_file) if os.path.exists(meta_file) else {}
    fam, arch = meta.get("family"), meta.get("architecture")
    if fam and fam != src.family.name or arch and arch != src.arch.architecture:
        raise MegatronCheckpointError(
            f"{ckpt} is a checkpoint of a {fam} model ({arch}); this run builds a {src.family.name} model "
            f"({src.arch.architecture}) from {src.hf_dir}: point checkpoint.load / checkpoint.save at a checkpoint "
            "of this model, or model.hf_path at the model it was trained from"
        )
    hf_config = os.path.join(ckpt, HF_SUBDIR, "config.json")
    if not os.path.exists(hf_config):
        return
    try:
        cfg = read_json(hf_config)
        theirs = family_of(cfg).arch(cfg)
    except ModelConfigError as e:
        raise MegatronCheckpointError(f"{hf_config}: {e}") from None
    diff = [
        f"{k} {getattr(theirs, k)} vs {getattr(src.arch, k)}"
        for k in SHAPE_FIELDS
        if getattr(theirs, k) != getattr(src.arch, k)
    ]
    if theirs.family != src.arch.family or diff:
        raise MegatronCheckpointError(
            f"{ckpt} holds another {theirs.family} model than this run's {src.hf_dir} (checkpoint vs run: "
            f"{', '.join(diff) or 'family ' + theirs.family + ' vs ' + src.arch.family}): point checkpoint.load / "
            "checkpoint.save at a checkpoint of this model, or model.hf_path at the model it was trained from"
        )


def load_train_checkpoint(
    path: str, chunks: list[torch.nn.Module], optimizer, scheduler, load_optimizer: bool = True, src=None
) -> dict[str, Any]:
    """Restore model (+ optimizer, scheduler, RNG when present) from a checkpoint dir or root (collective).

    The checkpoint is verified against its manifest first (a damaged one raises naming the file) and, with
    ``src`` (the run's ModelSource), against the model. Returns the saved train state ({} for a model-only
    checkpoint, e.g. one written by the converter), with ``schedule_changes``: the LR-schedule settings of this
    run that replaced the checkpoint's (the run's config applies; the caller says so)."""
    from megatron.core import dist_checkpointing  # heavy: this module loads without megatron

    ckpt = intact_checkpoint_dir(path)
    if src is not None:
        check_same_model(ckpt, src)
    state_file = os.path.join(ckpt, TRAIN_STATE)
    has_train_state = os.path.exists(state_file)
    state = read_json(state_file) if has_train_state else {}
    if has_train_state and not isinstance(state.get("step"), int):
        raise MegatronCheckpointError(f"{state_file} has no integer 'step'; the checkpoint is damaged")
    with_opt = load_optimizer and has_train_state and optimizer is not None
    try:
        with warnings.catch_warnings():  # megatron 0.16 calls torch's deprecated name on every load
            warnings.filterwarnings(
                "ignore",
                message="`load_state_dict` is deprecated",
                category=FutureWarning,
                module=r"megatron\.core\.dist_checkpointing",
            )
            loaded = dist_checkpointing.load(
                _sharded_state(chunks, optimizer if with_opt else None, is_loading=True), ckpt
            )
    except (Exception, CheckpointException) as e:  # megatron / torch raise anything on a damaged checkpoint
        raise MegatronCheckpointError(
            f"{ckpt} cannot be loaded ({_os_reason(e)}); move it aside to resume from the checkpoint before it"
        ) from None
    load_into_chunks(_unwrap(chunks), loaded, ckpt)
    if not has_train_state:
        return {}
    if with_opt:
        _restore_optimizer(optimizer, scheduler, loaded["optimizer"], state)
    _restore_rng(ckpt, state)
    return state


def _restore_optimizer(optimizer, scheduler, optimizer_state: dict, state: dict[str, Any]) -> None:
    """Load the optimizer's state with this run's group settings put back (lr bounds, Adam's betas and eps: the load
    restores the checkpoint's) before the LR schedule's (this run's settings, the checkpoint's step count); the
    settings that replaced the checkpoint's go to ``state["schedule_changes"]``."""
    mine = group_settings(optimizer)
    optimizer.load_state_dict(optimizer_state)
    state["schedule_changes"] = restore_group_settings(optimizer, mine)  # before the scheduler sets the lr
    _unshare_adam_steps(optimizer)
    if scheduler is not None and state.get("scheduler"):
        state["schedule_changes"][:0] = schedule_changes(scheduler, state["scheduler"])
        scheduler.override_opt_param_scheduler = True  # the run's settings, the checkpoint's step count
        scheduler.load_state_dict(state["scheduler"])


def _restore_rng(ckpt: str, state: dict[str, Any]) -> None:
    """This rank's random states from ``ckpt``, unless the layout changed since the save (each rank's streams
    belong to its place in the saved layout): then fresh ones, said in ``state["rng_note"]``."""
    rng_file = os.path.join(ckpt, "rng", f"rank_{_rank():05d}.pt")
    world = dist.get_world_size() if dist.is_initialized() else 1
    saved = {"world size": state.get("world_size"), **(state.get("layout") or {})}
    now = {"world size": world, **_layout()}
    moved = [f"{k} {saved[k]} -> {now[k]}" for k in now if k in saved and saved[k] != now[k]]
    if os.path.exists(rng_file) and not moved:
        _set_rng_state(torch.load(rng_file, weights_only=False))
    elif moved:
        state["rng_note"] = f"random states not restored, the layout changed: {', '.join(moved)}"


def _layout() -> dict[str, int]:
    """This rank's parallel layout (megatron's group sizes), {} before megatron's groups exist."""
    from megatron.core import parallel_state as ps  # heavy: this module loads without megatron

    if not ps.model_parallel_is_initialized():
        return {}
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


_SCHEDULE_KEYS = {
    "max_lr": "lr",
    "min_lr": "min lr",
    "lr_warmup_steps": "warmup steps",
    "lr_decay_steps": "decay steps",
    "lr_decay_style": "decay style",
}


def schedule_changes(scheduler, saved: dict) -> list[str]:
    """``'<setting> <checkpoint's> -> <run's>'`` for each LR-schedule setting that this run changes."""
    out = []
    for key, name in _SCHEDULE_KEYS.items():
        if key in saved and saved[key] != getattr(scheduler, key):
            out.append(f"{name} {saved[key]} -> {getattr(scheduler, key)}")
    return out


def describe_schedule(scheduler, optimizer) -> str:
    """The LR schedule in words, with the learning rate of the next step."""
    lr = scheduler.get_lr(optimizer.param_groups[0]) if optimizer is not None else scheduler.max_lr
    decays = "" if scheduler.lr_decay_style == "constant" else f" -> {scheduler.min_lr:g}"  # constant: never min_lr
    return (
        f"{scheduler.lr_decay_style}, lr {scheduler.max_lr:g}{decays}, warmup "
        f"{scheduler.lr_warmup_steps}, over {scheduler.lr_decay_steps} steps; lr now {lr:.3g}"
    )


# settings a resumed run changes without changing what it trains: where it writes, how long it runs
_UNSAID_SETTINGS = ("logging.", "checkpoint.", "plan.", "train.steps", "rl.steps")


def config_record(cfg) -> dict[str, Any]:
    """The run's resolved config (a dataclass) as ``{"section.key": value}`` for its checkpoints' train state, as
    JSON reads it back (``said_setting_changes`` compares it with the resumed run's)."""

    def flat(d: dict, prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
        return out

    return json.loads(json.dumps(flat(asdict(cfg), ""), default=str))


def said_setting_changes(state: dict[str, Any], cfg) -> None:
    """Say in one line which settings of the resumed run differ from those its checkpoint ``state`` was trained
    with (they apply from the resumed step on; the data order, model and LoRA settings are refused before this),
    so a resume with another algorithm setting is never a silently different run. Nothing for a checkpoint
    from before the config was recorded."""
    saved = state.get("config")
    if not isinstance(saved, dict):
        return
    now = config_record(cfg)
    changed = [
        f"{k} {saved[k]!r} -> {now[k]!r}"
        for k in sorted(now)
        if k in saved and saved[k] != now[k] and not k.startswith(_UNSAID_SETTINGS)
    ]
    if changed:
        _say(
            f"resume: this run's settings differ from those {state.get('resumed_from', 'its checkpoint')} was "
            f"trained with and apply from step {state.get('step')} on: {', '.join(changed)}"
        )


def _move_aside(damaged: str, why: str = "damaged") -> str:
    """Rename a damaged checkpoint of steps this run rolls back to ``<iter>.<why>[-N]`` (kept: a ``damaged`` one
    never deleted, a ``rolled-back`` one until the run saves its step again, ``drop_rolled_back``): under its
    ``iter_*`` name the rotation would count it among the newest and delete the intact ones behind it, and a
    later resume could mix its steps with the retrained ones."""
    for n in range(1, 1000):
        aside = f"{damaged}.{why}" + (f"-{n}" if n > 1 else "")
        if not os.path.lexists(aside):
            os.rename(damaged, aside)
            return aside
    raise MegatronCheckpointError(f"{damaged}: too many .{why} copies beside it; remove some")


def _set_aside_stale_companions(companions: tuple[str, ...], step: int) -> None:
    """Move aside the companions' (the value model's) checkpoints newer than the resumed ``step``: they belong to
    rolled-back steps (their policy checkpoint was damaged, moved aside or removed). Left in place, rotation
    counted them among the newest and deleted the value model's real ones, and a kill between the policy's and
    the value model's saves of that step again paired the new policy with the old timeline's value model."""
    for c in companions:
        for d in iteration_dirs(c):
            if iteration_step(os.path.basename(d)) > step:
                _say(
                    f"checkpoint: {d} is newer than the step resumed ({step}); moved it aside to {_move_aside(d, 'rolled-back')}"
                )


def _saved_adapters(ckpt: str) -> Optional[dict]:
    """The LoRA settings of a checkpoint's training ({"rank": ...}; None: full fine-tuning). A checkpoint of an
    older megadare, without them in its train state: rank and alpha from its meta, else whether its keys hold
    adapters ({} when they do, settings unknown)."""
    state = read_json(os.path.join(ckpt, TRAIN_STATE))
    if "lora" in state:
        return state["lora"]
    meta = read_json(os.path.join(ckpt, MEGADARE_META))
    if meta.get("lora"):
        return dict(meta["lora"])
    keys = FileSystemReader(ckpt).read_metadata().state_dict_metadata
    return {} if any(".lora_A" in k for k in keys) else None


def _adapters_in_words(lo: Optional[dict]) -> str:
    if lo is None:
        return "full fine-tuning (lora.rank=0)"
    said = [f"{k}={lo[k]}" for k in ("rank", "alpha", "targets") if k in lo]
    return f"LoRA ({', '.join('lora.' + s for s in said) or 'settings not recorded'})"


def check_same_adapters(ckpt: str, now: Optional[dict]) -> None:
    """Refuse (RunStateError, one line) resuming ``ckpt`` with other LoRA settings than it was trained with:
    adapters on or off, another rank or targets do not load (megatron named a missing key and told to move the
    checkpoint aside, which the checkpoints before it would repeat), another alpha rescales the adapters."""
    saved = _saved_adapters(ckpt)
    same = saved == now or (saved == {} and now is not None)  # {}: adapters of unrecorded settings
    if not same and saved is not None and now is not None:
        same = all(saved.get(k, now[k]) == now[k] for k in now)  # an older meta records rank and alpha only
    if not same:
        raise RunStateError(
            f"{ckpt} was trained with {_adapters_in_words(saved)}, this config has {_adapters_in_words(now)}: "
            "resuming needs the same adapters; set the lora.* keys back, or start a new run (logging.run_dir / "
            "checkpoint.save)"
        )


def _decided_on_rank0(make):
    """``make()`` on rank 0, the same object on every rank (one view of a shared filesystem)."""
    box = [make() if _rank() == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _report_damaged(root: str, pick, companions) -> None:
    """Say which checkpoints ``pick`` passed over; on rank 0 move them aside, point the tracker at the one picked
    and set aside companion checkpoints newer than it. Raises when every checkpoint under ``root`` is damaged."""
    if pick.tracker_problem:
        _say(f"checkpoint: {pick.tracker_problem}; using the newest intact iter_* directory instead")
    for d, problem in pick.skipped:
        _say(f"checkpoint: passing over {d}: {problem}")
    if pick.path is not None and _rank() == 0:
        for d, _ in pick.skipped:
            _say(f"checkpoint: moved it aside to {_move_aside(d)} (rename it back if the damage was passing)")
        if pick.skipped:  # checkpoint.load=<root> of another run reads the tracker: it names what is there
            _write_tracker(root, iteration_step(os.path.basename(pick.path)))
    if (pick.path is not None or not pick.skipped) and _rank() == 0:
        _set_aside_stale_companions(companions, iteration_step(os.path.basename(pick.path)) if pick.path else 0)
    if pick.path is None and pick.skipped:
        raise MegatronCheckpointError(
            f"no intact checkpoint under {root} ({len(pick.skipped)} damaged, listed "
            "above); move them aside to start the run over"
        )


def _check_same_run(root: str, ckpt: str, written_by: str, source: Optional[str], algo: Optional[str]) -> None:
    """Refuse to resume ``ckpt`` when another command wrote it, or it trains another model source or algorithm."""
    meta = read_json(os.path.join(ckpt, MEGADARE_META))
    if meta.get("written_by") and meta["written_by"] != written_by:
        raise RunStateError(
            f"{ckpt} was written by {meta['written_by']}, this is {written_by}: start from it "
            f"with checkpoint.load={root} and a new logging.run_dir / checkpoint.save"
        )
    if source and meta.get("source") and os.path.realpath(meta["source"]) != os.path.realpath(source):
        raise RunStateError(
            f"the run in {root} was trained from {meta['source']}, this config names model.hf_path="
            f"{source}: resuming would keep the old model's weights; set model.hf_path back, or "
            "start a new run (logging.run_dir / checkpoint.save)"
        )
    if algo and meta.get("algo") and meta["algo"] != algo:
        raise RunStateError(
            f"the run in {root} trains {meta['algo']}, this config names algo.name={algo}: resuming would go on "
            f"from {meta['algo']}'s optimiser state and replay; set algo.name={meta['algo']}, or start a new run "
            "(logging.run_dir / checkpoint.save, with checkpoint.load to start from its weights)"
        )


def resume_run(
    root: str,
    trained: Trainable,
    src,
    written_by: str,
    source: Optional[str] = None,
    algo: Optional[str] = None,
) -> dict[str, Any]:
    """Resume a run from the newest intact checkpoint under ``root`` (collective); {} when there is none.

    Damaged checkpoints (manifest check) are passed over, saying which and why; a checkpoint of another model,
    another command (``written_by``, e.g. an SFT checkpoint under an RL run), another ``source`` checkpoint
    directory (model.hf_path) or another RL algorithm (``algo``) is refused. A checkpoint counts only when its
    namesakes under ``trained.companion_roots(root)`` (the value model's, when it has one) are intact too.
    Damaged checkpoints newer than the one resumed are moved aside (``_move_aside``). Prints ``resumed from <dir>
    at step N (lr schedule: ...)``, naming the schedule settings of this run that replace the checkpoint's (and
    random states left behind by a layout change)."""
    companions = trained.companion_roots(root) if hasattr(trained, "companion_roots") else ()
    pick = _decided_on_rank0(lambda: newest_intact(root, required=(TRAIN_STATE,), companions=companions))
    _report_damaged(root, pick, companions)
    if pick.path is None:
        return {}
    if pick.legacy:
        _say(f"checkpoint: {pick.path} predates checkpoint manifests; checked its shards against .metadata only")
    _check_same_run(root, pick.path, written_by, source, algo)
    if hasattr(trained, "adapters"):
        check_same_adapters(pick.path, trained.adapters())
    optimizer, scheduler = trained.optimizer, trained.scheduler
    state = load_train_checkpoint(pick.path, trained.model, optimizer, scheduler, src=src)
    changes = state.get("schedule_changes") or []
    applied = f"; this run's settings replace the checkpoint's: {', '.join(changes)}" if changes else ""
    schedule = describe_schedule(scheduler, optimizer) if scheduler is not None else "none"
    rng = f"; {state['rng_note']}" if state.get("rng_note") else ""
    _say(f"resumed from {pick.path} at step {state['step']} (lr schedule: {schedule}{applied}{rng})")
    return dict(state, resumed_from=pick.path)
