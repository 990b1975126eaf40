"""Checkpoint rotation: ``keep_last`` of the checkpoints a run's own saves wrote, never one it did not (each save
records its root's id in megadare.json; a directory copied in, a symbolic link or another run's checkpoint is left
alone, said once), and the checkpoints resume set aside as rolled back, once replaced. Deletion renames out of the
``iter_*`` names first, so a kill mid-delete leaves no half checkpoint that resume could take."""

from __future__ import annotations

import os
import re
import shutil
import sys
import uuid
from typing import Optional

from megadare.convert.mcore_ckpt import (
    MEGADARE_META,
    MegatronCheckpointError,
    _rank,
    iteration_dirs,
    iteration_step,
    read_json,
    read_tracker,
)

ROOT_ID = "root_id"  # megadare.json: the id of the checkpoint root whose saves wrote it (rotation deletes only those)


def _say(msg: str) -> None:
    if _rank() == 0:
        print(msg, file=sys.stderr, flush=True)


def iteration_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


def root_id(root: str) -> str:
    """The id the checkpoints of ``root`` carry: that of the one its tracker names (the run's last save, or the
    step it resumed: a directory copied in by hand never is), else a new one."""
    try:
        it = read_tracker(root)
        meta = read_json(os.path.join(iteration_dir(root, int(it)), MEGADARE_META)) if it and it.isdigit() else {}
    except (MegatronCheckpointError, OSError):
        meta = {}
    rid = meta.get(ROOT_ID) if isinstance(meta, dict) else None
    return rid if isinstance(rid, str) else uuid.uuid4().hex


def _not_this_roots(d: str, root_id: Optional[str]) -> Optional[str]:
    """Why rotation must leave ``d`` alone (None: a save under this root wrote it, or a megadare before root ids):
    a symbolic link, no megadare.json, or the id of another checkpoint root (copied or moved in by hand)."""
    if os.path.islink(d):
        return f"it is a symbolic link (to {os.readlink(d)})"
    try:
        meta = read_json(os.path.join(d, MEGADARE_META))
    except MegatronCheckpointError:
        return f"it has no readable {MEGADARE_META} (not a checkpoint megadare saved)"
    theirs = meta.get(ROOT_ID) if isinstance(meta, dict) else None
    if root_id and theirs and theirs != root_id:
        return "another checkpoint root saved it (copied or moved in)"
    return None


_KEPT_SAID: set[str] = set()


def prune_checkpoints(root: str, keep_last: int, current: int) -> None:
    """Remove all but the newest ``keep_last`` ``iter_*`` under ``root`` (never ``current``; 0 keeps all); rank 0.
    Only checkpoints this root's saves wrote count (``_not_this_roots``): the others are kept, said once."""
    if keep_last <= 0 or _rank() != 0:
        return
    names = os.listdir(root)
    for d in names:  # what a killed rotation left
        if d.startswith("iter_") and d.endswith(".pruning"):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    try:  # the id of the checkpoint just saved
        root_id = read_json(os.path.join(iteration_dir(root, current), MEGADARE_META)).get(ROOT_ID)
    except (MegatronCheckpointError, AttributeError):
        root_id = None
    its = []
    for d in iteration_dirs(root):
        why = _not_this_roots(d, root_id)
        if why is None:
            its.append(iteration_step(os.path.basename(d)))
        elif d not in _KEPT_SAID:
            _KEPT_SAID.add(d)
            _say(f"checkpoint: rotation leaves {d} alone: {why}; remove it yourself when it is not needed")
    for it in sorted(its)[:-keep_last]:
        if it != current:  # renamed out of the iter_* names first: a kill mid-delete leaves no half checkpoint
            doomed = iteration_dir(root, it) + ".pruning"  # that resume could take (its manifest gone first)
            try:
                os.rename(iteration_dir(root, it), doomed)
            except OSError:  # as a failed delete: kept, and tried again at the next save
                continue
            shutil.rmtree(doomed, ignore_errors=True)


_ROLLED_BACK = re.compile(r"iter_([0-9]{7,})\.rolled-back(?:-[0-9]+)?")


def drop_rolled_back(root: str, current: int) -> None:
    """Remove the checkpoints under ``root`` that resume set aside as rolled back (``iter_N.rolled-back[-k]``, a
    name only ``_set_aside_stale_companions`` gives) of steps N <= ``current``, once step ``current`` is saved
    complete: the run's new timeline has replaced them. Rank 0. Any other name (``.damaged``, yours) is kept."""
    if _rank() != 0 or not os.path.isdir(root):
        return
    for d in sorted(os.listdir(root)):
        m = _ROLLED_BACK.fullmatch(d)
        if m and int(m.group(1)) <= current:  # out of the way first, as rotation does (its .pruning cleanup)
            doomed = os.path.join(root, d + ".pruning")
            try:
                os.rename(os.path.join(root, d), doomed)
            except OSError:
                continue
            shutil.rmtree(doomed, ignore_errors=True)
