"""RL resume refusals are one line (megadare's own error), not a traceback."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from megadare.config import load_config
from megadare.errors import RunStateError
from megadare.trainer.data_order import StepSampler
from megadare.trainer.rl_setup import _resume

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_missing_weight_snapshots_on_resume_is_a_run_state_error(tmp_path):
    """A checkpoint without this rank's weight snapshots (another layout) while stale rollouts are queued: the
    run cannot correct them. This raised a bare RuntimeError (a traceback); it is a one-line RunStateError."""
    ckpt = tmp_path / "ckpt" / "iter_0000002"
    ckpt.mkdir(parents=True)
    (ckpt / "metadata.json").write_text("{}")
    cfg = load_config(os.path.join(ROOT, "megadare", "configs", "demo_rl.yaml"), [])
    sampler = StepSampler(8, cfg.rl.prompts_per_step, cfg.seed, cfg.data.shuffle)
    state = {"step": 2, "resumed_from": str(ckpt), "data_order": sampler.settings()}
    run = SimpleNamespace(
        cfg=cfg,
        policy=SimpleNamespace(resume=lambda *a, **k: state),
        spec=SimpleNamespace(source=None),
        algo=SimpleNamespace(name=cfg.algo.name),
        save_root=str(tmp_path / "ckpt"),
        rollouts=SimpleNamespace(sampler=sampler),
        snapshots=SimpleNamespace(load_state_dict=lambda s: None),
        ahead=1,
        buffer=None,
    )
    with pytest.raises(RunStateError, match=f"{ckpt} has no weight snapshots for this rank"):
        _resume(run)
