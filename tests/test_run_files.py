"""Nothing lost, nobody in: the files a run keeps beside its checkpoints (set-aside value checkpoints, metrics
rolled back on resume), the names rotation and resume count as checkpoints, the fp8 engines' export and the run
lock. Focused tests on the functions involved (no training run)."""

from __future__ import annotations

import json
import os

import pytest

from megadare.convert.manifest import write_manifest


def _fake_checkpoint(d, step: int) -> None:
    """An intact-looking checkpoint directory (train state, meta, manifest), no tensors."""
    d.mkdir(parents=True)
    (d / "train_state.json").write_text(json.dumps({"step": step}))
    (d / "megadare.json").write_text(json.dumps({"written_by": "megadare rl"}))
    write_manifest(str(d))


def test_resume_and_rotation_count_the_same_checkpoint_names(tmp_path):
    """Rotation counted only ``iter_%07d`` names, resume any ``iter_<str.isdigit()>``: a stray ``iter_6`` was a
    checkpoint to resume but never rotated, and a name of non-ASCII digits (``iter_²``) made every resume and
    rotation die in int()'s ValueError traceback. One rule now (``iteration_step``): the names the trainer writes."""
    from megadare.convert.mcore_ckpt import MegatronCheckpointError, iteration_dirs, iteration_step, read_tracker
    from megadare.trainer import checkpoint

    for step in (2, 4, 6):
        _fake_checkpoint(tmp_path / f"iter_{step:07d}", step)
    for stray in ("iter_8", "iter_00000009", "iter_²", "iter_0000010.tmp"):
        (tmp_path / stray).mkdir()
    assert [os.path.basename(d) for d in iteration_dirs(str(tmp_path))] == [
        "iter_0000006",
        "iter_0000004",
        "iter_0000002",
    ]
    assert iteration_step("iter_12345678") == 12345678 and iteration_step("iter_0000006.rolled-back") is None
    checkpoint.prune_checkpoints(str(tmp_path), 2, 6)
    assert sorted(os.listdir(tmp_path)) == [
        "iter_00000009",
        "iter_0000004",
        "iter_0000006",
        "iter_0000010.tmp",
        "iter_8",
        "iter_²",
    ]
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("²")
    with pytest.raises(MegatronCheckpointError, match="holds '²', not a step number"):
        read_tracker(str(tmp_path))
