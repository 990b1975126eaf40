"""Megatron distributed checkpoints (torch_dist): save/load live sharded models, stream tensors in and out.

Every checkpoint is written with ``singleton_local_shards`` metadata, so each key is one plain tensor with a
global shape that does not depend on TP/PP/EP/VPP: a checkpoint saved under one layout loads under any other.

* ``save_checkpoint`` / ``load_checkpoint``: megatron's ``dist_checkpointing`` on live model chunks (all ranks).
  Saves go to a temp directory that rank 0 renames into place after every rank finished: a crash never leaves
  a half-written checkpoint under the final name.
* ``write_tensors``: one process writes a checkpoint tensor by tensor (the HF -> Megatron converter). It uses
  torch.distributed.checkpoint directly with a planner that produces each tensor only when the writer asks
  for it, so peak memory stays near the largest tensor, not the model.
* ``read_tensors`` / ``checkpoint_keys``: read only the named tensors (the Megatron -> HF converter).

The checkpoint directory also holds ``hf/`` (the source config.json and tokenizer files) so an export needs
nothing but the checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _item_size
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megadare.convert.manifest import Verdict, check_checkpoint, write_manifest
from megadare.convert.outputs import HF_SUBDIR, TRACKER, publish, staging_dir
from megadare.errors import MegatronCheckpointError
from megadare.models.safetensors_io import copy_passthrough_files

SHARDED_SD_METADATA = {"singleton_local_shards": True}

MEGADARE_META = "megadare.json"
# What megatron's dist_checkpointing writes as metadata.json for the torch_dist backend.
_MCORE_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


@contextlib.contextmanager
def _one_process():
    """torch's DCP warns on every single-process save / load, even one asked for with ``no_dist=True``: noise on
    every conversion."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is .*assuming the intent is to (save|load)")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _tmp(path: str) -> str:
    """``iter_X.tmp``: a training save's staging inside its (locked) checkpoint root."""
    return path.rstrip(os.sep) + ".tmp"


def _shared_staging(ckpt_dir: str) -> str:
    """Rank 0's ``staging_dir`` of ``ckpt_dir`` (a fresh pid@host sibling; what killed saves left is removed),
    the same path on every rank. A fixed ``<ckpt_dir>.tmp`` was removed and reused whatever it held: a user's
    own ``X.tmp`` beside ``X`` was deleted."""
    name = [staging_dir(ckpt_dir) if _rank() == 0 else None]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return name[0]


def _finalise(tmp: str, final: str) -> None:
    """Write tmp's manifest (last), then move tmp into place (replacing an older checkpoint of the same name)."""
    write_manifest(tmp)
    publish(tmp, final)


def write_meta(ckpt_dir: str, meta: dict[str, Any], hf_files_from: Optional[str] = None) -> None:
    """megadare.json (family, architecture, what wrote it) and hf/ (config.json + tokenizer files)."""
    with open(os.path.join(ckpt_dir, MEGADARE_META), "w") as f:
        json.dump(meta, f, indent=2)
    if hf_files_from:
        copy_hf_files(ckpt_dir, hf_files_from)


def copy_hf_files(ckpt_dir: str, hf_dir: str) -> None:
    """hf/ of a checkpoint: the config.json and tokenizer files of the HF checkpoint ``hf_dir``."""
    os.makedirs(os.path.join(ckpt_dir, HF_SUBDIR), exist_ok=True)
    copy_passthrough_files(hf_dir, os.path.join(ckpt_dir, HF_SUBDIR))


def read_meta(ckpt_dir: str) -> dict[str, Any]:
    p = os.path.join(ckpt_dir, MEGADARE_META)
    if not os.path.exists(p):
        raise MegatronCheckpointError(f"{ckpt_dir}: no {MEGADARE_META}; not a checkpoint written by megadare")
    return read_json(p)


def read_json(path: str) -> Any:
    """A JSON file of a checkpoint; a damaged one raises MegatronCheckpointError naming the file."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise MegatronCheckpointError(f"{path}: cannot be read as JSON ({e})") from None


def read_tracker(root: str) -> Optional[str]:
    """The iteration named by ``<root>/latest_checkpointed_iteration.txt`` ("release" or a step number as text);
    None without the file. A garbled file raises MegatronCheckpointError naming it."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        return None
    with open(tracker, errors="replace") as f:
        it = f.read().strip()
    if it != "release" and not (it.isascii() and it.isdigit()):
        raise MegatronCheckpointError(
            f"{tracker} holds {it[:40]!r}, not a step number; write the newest complete "
            "step into it (the iter_* directory names), or remove it"
        )
    return it


def resolve_checkpoint_dir(path: str) -> str:
    """A checkpoint dir itself, or a run's checkpoint root holding latest_checkpointed_iteration.txt."""
    if not os.path.exists(path):
        raise MegatronCheckpointError(
            f"{path} does not exist: give a checkpoint a megadare run wrote (its <run_dir>/ckpt, or an iter_* "
            "in it); train one first (megadare sft / megadare demo)"
        )
    if os.path.exists(os.path.join(path, "metadata.json")):
        return path
    it = read_tracker(path)
    if it is not None:
        tracker = os.path.join(path, TRACKER)
        sub = os.path.join(path, "release" if it == "release" else f"iter_{int(it):07d}")
        if os.path.exists(os.path.join(sub, "metadata.json")):
            return sub
        raise MegatronCheckpointError(f"{tracker} points to {sub}, which is not a checkpoint")
    raise MegatronCheckpointError(
        f"{path}: not a Megatron distributed checkpoint (no metadata.json, no latest_checkpointed_iteration.txt)"
        + _what_to_give_instead(path)
    )


def _what_to_give_instead(path: str) -> str:
    """The fix for the usual mix-ups: a run directory given for its checkpoint root, an HF checkpoint."""
    root = os.path.join(path, "ckpt")
    if os.path.exists(os.path.join(root, TRACKER)) or os.path.exists(os.path.join(root, "metadata.json")):
        return f"; it is a run directory: give its checkpoints, {root}"
    if os.path.exists(os.path.join(path, "config.json")):
        return "; it is an HF checkpoint (model.hf_path takes it; megadare convert hf-to-megatron makes a Megatron one)"
    return "; give a run's <run_dir>/ckpt or an iter_* in it"


@dataclass
class Resumable:
    """The newest intact checkpoint under a run's root, and what was passed over on the way (newest first)."""

    path: Optional[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (iter dir, what is wrong with it)
    legacy: bool = False  # chosen one has no manifest (older megadare)
    tracker_problem: str = ""  # the tracker file could not be used


_ITERATION_NAME = re.compile(r"iter_([0-9]{7,})")


def iteration_step(name: str) -> Optional[int]:
    """The step of a checkpoint directory's base ``name`` when it is one the trainer writes (``iter_%07d``), else
    None: ``.tmp`` / ``.pruning`` / moved-aside names and other spellings (``iter_6``, ``iter_00000006``, non-ASCII
    digits) are not checkpoints. The one rule for resume, rotation and the companions' checks."""
    m = _ITERATION_NAME.fullmatch(name)
    return int(m.group(1)) if m and name == f"iter_{int(m.group(1)):07d}" else None


def iteration_dirs(root: str) -> list[str]:
    """The checkpoint directories under ``root`` (``iteration_step``), newest first."""
    names = [d for d in os.listdir(root) if iteration_step(d) is not None] if os.path.isdir(root) else []
    return [os.path.join(root, d) for d in sorted(names, key=iteration_step, reverse=True)]


def newest_intact(root: str, required: tuple[str, ...] = (), companions: tuple[str, ...] = ()) -> Resumable:
    """The newest ``iter_*`` checkpoint under ``root`` whose manifest holds (``convert.manifest``), that has the
    ``required`` files and whose namesake under each of the ``companions`` roots (TraceRL's value model, saved
    before the policy) is intact too; the tracker is only a hint (a crash between the rename and the tracker
    update leaves a newer complete checkpoint). ``path`` is None when there is no checkpoint at all."""
    out = Resumable(None)
    try:
        read_tracker(root)
    except MegatronCheckpointError as e:
        out.tracker_problem = str(e)
    for d in iteration_dirs(root):
        v = check_checkpoint(d)
        missing = [f for f in required if not os.path.exists(os.path.join(d, f))]
        if v.intact and missing:
            v.intact, v.problem = False, f"{os.path.join(d, missing[0])} is missing"
        for c in companions if v.intact else ():
            twin = os.path.join(c, os.path.basename(d))
            w = check_checkpoint(twin) if os.path.isdir(twin) else Verdict(False, f"{twin} is missing")
            if not w.intact:
                v.intact, v.problem = False, f"its companion checkpoint is not intact: {w.problem}"
                break
        if v.intact:
            out.path, out.legacy = d, v.legacy
            return out
        out.skipped.append((d, v.problem))
    return out


def intact_checkpoint_dir(path: str) -> str:
    """``resolve_checkpoint_dir(path)``, verified against its manifest: a damaged checkpoint raises
    MegatronCheckpointError naming the damaged file (and the newest intact one of the same root, if any)."""
    ckpt = resolve_checkpoint_dir(path)
    v = check_checkpoint(ckpt)
    if v.intact:
        return ckpt
    root = os.path.dirname(os.path.abspath(ckpt))
    alt = newest_intact(root).path if os.path.basename(ckpt).startswith("iter_") else None
    hint = f"; {alt} is intact: pass it explicitly" if alt else ""
    raise MegatronCheckpointError(f"{ckpt} is damaged: {v.problem}{hint}")


# ============================================================== live sharded models (every rank calls these)
def model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict:
    """The sharded state dict of this rank's model chunks; keys inside are layout-independent. Each call gets its
    own metadata dict: megatron stores the current data-parallel group in it (``ensure_metadata_has_dp_cp_group``),
    which must not outlive a change of layout."""
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict(metadata=dict(SHARDED_SD_METADATA))}
    return {f"model{i}": c.sharded_state_dict(metadata=dict(SHARDED_SD_METADATA)) for i, c in enumerate(chunks)}


def _drop_extra_state(sd: dict) -> dict:
    """Drop ``_extra_state`` entries of non-TE layers (always None): converted checkpoints carry none."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject  # heavy: megatron

    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _drop_extra_state(v)
        elif isinstance(v, ShardedObject) and k.endswith("_extra_state") and v.data is None:
            continue
        else:
            out[k] = v
    return out


def save_checkpoint(
    chunks: list[torch.nn.Module], ckpt_dir: str, meta: Optional[dict] = None, hf_files_from: Optional[str] = None
) -> str:
    """Save this rank's model chunks (collective). Returns the final directory."""
    from megatron.core import dist_checkpointing  # heavy: megatron

    tmp = _shared_staging(ckpt_dir)
    dist_checkpointing.save(_drop_extra_state(model_sharded_state_dict(chunks)), tmp)
    _barrier()
    if _rank() == 0:
        write_meta(tmp, meta or {}, hf_files_from)
        _finalise(tmp, ckpt_dir)
    _barrier()
    return ckpt_dir


def load_checkpoint(chunks: list[torch.nn.Module], ckpt_dir: str) -> None:
    """Load a checkpoint saved under any layout into this rank's model chunks (collective)."""
    from megatron.core import dist_checkpointing  # heavy: megatron

    ckpt_dir = resolve_checkpoint_dir(ckpt_dir)
    sd = _drop_extra_state(model_sharded_state_dict(chunks))
    load_into_chunks(chunks, dist_checkpointing.load(sd, ckpt_dir), ckpt_dir)


def load_into_chunks(chunks: list[torch.nn.Module], state: dict, source: str) -> None:
    """Load a (merged) state dict shaped like ``model_sharded_state_dict`` into the chunks, strictly."""
    for i, c in enumerate(chunks):
        part = state["model"] if len(chunks) == 1 else state[f"model{i}"]
        missing, unexpected = c.load_state_dict(part, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise MegatronCheckpointError(f"{source}: model chunk {i}: missing {missing}, unexpected {unexpected}")


# ============================================================== single-process streaming IO (converters)
class _LazySavePlanner(DefaultSavePlanner):
    """Plans with meta tensors; produces each real tensor only when the writer asks for it."""

    def __init__(self, produce: Callable[[str], torch.Tensor]):
        super().__init__()
        self._produce = produce

    def resolve_data(self, write_item):
        key = write_item.index.fqn
        t = self._produce(key)
        want = self.state_dict[key]
        if tuple(t.shape) != tuple(want.shape) or t.dtype != want.dtype:
            raise MegatronCheckpointError(
                f"{key}: produced {tuple(t.shape)} {t.dtype}, planned {tuple(want.shape)} {want.dtype}"
            )
        return t.contiguous()


class _BoundedFileWriter(FileSystemWriter):
    """FileSystemWriter that packs tensors into files of at most ``file_bytes``.

    torch's writer keeps every tensor of a file alive until the file is closed, so one file per rank would hold
    the whole model; bounded files keep at most ``file_bytes`` (or one tensor, if larger) in memory.
    """

    def __init__(self, path: str, file_bytes: int):
        super().__init__(path, single_file_per_rank=True, thread_count=1, sync_files=True)
        self.file_bytes = file_bytes

    def write_data(self, plan, planner):
        files: list[list] = [[]]
        size = 0
        for item in plan.items:
            n = _item_size(item)
            if files[-1] and size + n > self.file_bytes:
                files.append([])
                size = 0
            files[-1].append(item)
            size += n
        q: queue.Queue = queue.Queue()
        for i, bucket in enumerate(f for f in files if f):
            name = f"{plan.storage_data.prefix}{i}{DEFAULT_SUFFIX}"
            q.put((self.fs.concat_path(self.path, name), name, bucket))
        return self._write_data(planner, q)


def write_tensors(
    ckpt_dir: str,
    shapes: dict[str, tuple[list[int], torch.dtype]],
    produce: Callable[[str], torch.Tensor],
    meta: Optional[dict] = None,
    file_bytes: int = 256 << 20,
    before_publish: Optional[Callable[[str], None]] = None,
) -> str:
    """Write a torch_dist checkpoint from one process; at most ``file_bytes`` (or one tensor) in memory.

    shapes: key -> (global shape, dtype); produce(key) returns that tensor when the writer reaches it. The
    checkpoint is assembled in a fresh sibling of ``ckpt_dir`` (``meta`` in its megadare.json;
    ``before_publish(staging)`` adds files to it, e.g. :func:`copy_hf_files`) and renamed into place; on any error
    the sibling is removed and ``ckpt_dir`` is untouched.
    """
    tmp = staging_dir(ckpt_dir)
    try:
        state = {k: torch.empty(s, dtype=d, device="meta") for k, (s, d) in shapes.items()}
        try:
            with _one_process():
                dcp.save(
                    state,
                    storage_writer=_BoundedFileWriter(tmp, file_bytes),
                    planner=_LazySavePlanner(produce),
                    no_dist=True,
                )
        except CheckpointException as e:  # DCP wraps per-rank errors; surface the real one
            for f in getattr(e, "failures", {}).values():
                err = f[0] if isinstance(f, tuple) else f  # (exception, stack summary) in torch >= 2.1
                if isinstance(err, BaseException):
                    raise err from None
            raise
        torch.save({}, os.path.join(tmp, "common.pt"))
        with open(os.path.join(tmp, "metadata.json"), "w") as f:
            json.dump(_MCORE_METADATA, f)
        write_meta(tmp, meta or {})
        if before_publish is not None:
            before_publish(tmp)
        _finalise(tmp, ckpt_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ckpt_dir


def checkpoint_keys(ckpt_dir: str) -> dict[str, tuple[list[int], torch.dtype]]:
    """Tensor keys of a checkpoint with their global shapes and dtypes (reads metadata only)."""
    md = FileSystemReader(resolve_checkpoint_dir(ckpt_dir)).read_metadata()
    out = {}
    for k, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            out[k] = (list(m.size), m.properties.dtype)
    return out


def read_tensors(
    ckpt_dir: str, keys: Iterable[str], known: Optional[dict[str, tuple[list[int], torch.dtype]]] = None
) -> dict[str, torch.Tensor]:
    """Read the given keys (full global tensors) from a checkpoint; only those bytes are read."""
    ckpt_dir = resolve_checkpoint_dir(ckpt_dir)
    known = known or checkpoint_keys(ckpt_dir)
    state = {}
    for k in keys:
        if k not in known:
            raise MegatronCheckpointError(f"{ckpt_dir}: checkpoint has no tensor {k!r}")
        shape, dtype = known[k]
        state[k] = torch.empty(shape, dtype=dtype)
    with _one_process():
        dcp.load(state, storage_reader=FileSystemReader(ckpt_dir), no_dist=True)
    return state
