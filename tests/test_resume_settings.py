"""A resumed run whose config changed since its checkpoint says which settings changed (they apply from the resumed
step on): another algorithm or objective setting used to go on without a word, a silently different run. The
data order, model, LoRA and queued-rollout settings are refused before (test_checkpoint_safety.py,
test_rl_resume_errors.py)."""

from __future__ import annotations

import pytest

from test_checkpoint_safety import megadare

pytestmark = pytest.mark.timeout(300)


def test_a_resume_with_changed_settings_names_them(tmp_path):
    run = tmp_path / "run"
    first = megadare(run, "train.steps=2")  # a checkpoint at step 2 (checkpoint.save_interval=2)
    assert first.returncode == 0, first.stderr
    changed = megadare(run, "train.steps=4", "sft.noise_low=0.2", "logging.log_interval=2")
    assert changed.returncode == 0, changed.stderr
    said = [line for line in changed.stderr.splitlines() if line.startswith("resume: ")]
    assert said == [
        f"resume: this run's settings differ from those {run}/ckpt/iter_0000002 was trained with and apply from "
        "step 2 on: sft.noise_low 0.001 -> 0.2"
    ], changed.stderr  # the steps and where it logs are no change to what it trains
    again = megadare(run, "train.steps=6", "sft.noise_low=0.2")
    assert again.returncode == 0, again.stderr
    assert f"resumed from {run}/ckpt/iter_0000004 at step 4" in again.stderr
    assert "resume: " not in again.stderr
