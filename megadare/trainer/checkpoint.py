"""Training checkpoints: model + optimizer + LR schedule + RNG + data position, saved atomically, resumable.

Layout of a run's checkpoint root (Megatron-LM's, so megatron tools and our converters read it):

    <root>/iter_0000006/            megatron distributed checkpoint (torch_dist): model keys as written by the
                                    converter ("model." / "model<i>.") plus "optimizer." (fully reshardable)
    <root>/iter_0000006/train_state.json   step, data position, scheduler state, config
    <root>/iter_0000006/rng/rank_00000.pt  per-rank torch + megatron RNG tracker states
    <root>/latest_checkpointed_iteration.txt

A save goes to ``iter_X.tmp`` and is renamed once every rank finished; the tracker file is replaced atomically
after that, so a crash at any point leaves the previous checkpoint loadable. ``keep_last`` old checkpoints are
kept.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

from megadare.convert.mcore_ckpt import (
    SHARDED_SD_METADATA,
    _barrier,
    _drop_extra_state,
    _finalise,
    _rank,
    _tmp,
    load_into_chunks,
    model_sharded_state_dict,
    resolve_checkpoint_dir,
    write_meta,
)

TRACKER = "latest_checkpointed_iteration.txt"
TRAIN_STATE = "train_state.json"
OPTIM_METADATA = {**SHARDED_SD_METADATA, "distrib_optim_sharding_type": "fully_reshardable"}


def _unwrap(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    return [getattr(c, "module", c) for c in chunks]


def iteration_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


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
            del state[p]         # allocates the state it restores, a fresh Adam allocates at its first step
    return _drop_extra_state(sd)


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def save_train_checkpoint(root: str, step: int, chunks: list[torch.nn.Module], optimizer, scheduler,
                          train_state: dict[str, Any], meta: Optional[dict] = None,
                          hf_files_from: Optional[str] = None, keep_last: int = 2,
                          objects: Optional[dict[str, Any]] = None,
                          rank_objects: Optional[dict[str, Any]] = None) -> str:
    """Save everything needed to resume at ``step`` (collective). Returns the checkpoint directory.

    ``objects``: picklable state saved by rank 0 as ``<name>.pt`` (e.g. the RL loop's queued rollouts and replay
    buffer); ``rank_objects``: per-rank state saved as ``<name>/rank_XXXXX.pt`` (e.g. weight snapshots of this
    rank's shards). Both land inside the same atomic rename; read them with ``load_checkpoint_object``."""
    from megatron.core import dist_checkpointing

    final = iteration_dir(root, step)
    tmp = _tmp(final)
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    dist_checkpointing.save(_sharded_state(chunks, optimizer, is_loading=False), tmp)
    world = dist.get_world_size() if dist.is_initialized() else 1
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{_rank():05d}.pt"))
    for name, obj in (rank_objects or {}).items():
        os.makedirs(os.path.join(tmp, name), exist_ok=True)
        torch.save(obj, os.path.join(tmp, name, f"rank_{_rank():05d}.pt"))
    if _rank() == 0:
        for name, obj in (objects or {}).items():
            torch.save(obj, os.path.join(tmp, f"{name}.pt"))
    _barrier()
    if _rank() == 0:
        state = dict(train_state, step=step, world_size=world,
                     scheduler=scheduler.state_dict() if scheduler is not None else None)
        with open(os.path.join(tmp, TRAIN_STATE), "w") as f:
            json.dump(state, f, indent=2, default=str)
        write_meta(tmp, meta or {}, hf_files_from)
        _finalise(tmp, final)
        tracker_tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tracker_tmp, "w") as f:
            f.write(str(step))
        os.replace(tracker_tmp, os.path.join(root, TRACKER))
        _prune(root, keep_last, step)
    _barrier()
    return final


def _prune(root: str, keep_last: int, current: int) -> None:
    if keep_last <= 0:
        return
    its = sorted(int(d[5:]) for d in os.listdir(root) if d.startswith("iter_") and d[5:].isdigit())
    for it in its[:-keep_last]:
        if it != current:
            shutil.rmtree(iteration_dir(root, it), ignore_errors=True)


def load_checkpoint_object(path: str, name: str, per_rank: bool = False) -> Any:
    """An object saved with ``save_train_checkpoint(objects=...)`` (or this rank's of ``rank_objects``); None
    when the checkpoint has none."""
    ckpt = resolve_checkpoint_dir(path)
    f = os.path.join(ckpt, name, f"rank_{_rank():05d}.pt") if per_rank else os.path.join(ckpt, f"{name}.pt")
    return torch.load(f, weights_only=False) if os.path.exists(f) else None


def latest_checkpoint(root: str) -> Optional[str]:
    """The newest complete checkpoint under a run's checkpoint root, or None."""
    if not root or not os.path.exists(os.path.join(root, TRACKER)):
        return None
    return resolve_checkpoint_dir(root)


def load_train_checkpoint(path: str, chunks: list[torch.nn.Module], optimizer, scheduler,
                          load_optimizer: bool = True) -> dict[str, Any]:
    """Restore model (+ optimizer, scheduler, RNG when present) from a checkpoint dir or root (collective).

    Returns the saved train state ({} for a model-only checkpoint, e.g. one written by the converter).
    """
    from megatron.core import dist_checkpointing

    ckpt = resolve_checkpoint_dir(path)
    state_file = os.path.join(ckpt, TRAIN_STATE)
    has_train_state = os.path.exists(state_file)
    with_opt = load_optimizer and has_train_state and optimizer is not None
    loaded = dist_checkpointing.load(_sharded_state(chunks, optimizer if with_opt else None, is_loading=True), ckpt)
    load_into_chunks(_unwrap(chunks), loaded, ckpt)
    if not has_train_state:
        return {}
    with open(state_file) as f:
        state = json.load(f)
    if with_opt:
        optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(optimizer)
        if scheduler is not None and state.get("scheduler"):
            scheduler.load_state_dict(state["scheduler"])
    rng_file = os.path.join(ckpt, "rng", f"rank_{_rank():05d}.pt")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if os.path.exists(rng_file) and state.get("world_size") == world:
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return state
