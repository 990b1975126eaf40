"""The step loop ends its progress bar and gives Ctrl-C back to Python however it ends: a step that raises left
the bar's line open (the one-line error printed after its last frame) and SIGINT caught by the stop handler, so a
Ctrl-C during the shutdown that follows (engines closing, up to 30 s for a hung one) did nothing."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from megadare.config import load_config
from megadare.trainer.sft_loop import train_steps


class _Bang(RuntimeError):
    pass


def _step_fn(fail_at: int):
    calls = []

    def step(indices):
        calls.append(indices)
        if len(calls) == fail_at:
            raise _Bang(f"step {fail_at} failed")
        return {"loss": 1.0}

    step.add_speed = lambda metrics, dt, epoch: None
    return step


@pytest.mark.parametrize("fail_at", [1, 3])
def test_a_step_that_raises_closes_the_bar_and_restores_sigint(tmp_path, monkeypatch, fail_at):
    cfg = load_config(
        None,
        [f"logging.run_dir={tmp_path}", "train.steps=5", "train.global_batch_size=2", "logging.tensorboard=false"],
    )
    run = SimpleNamespace(cfg=cfg, step=0, save_root=str(tmp_path / "ckpt"), examples=list(range(8)))
    bars = []
    real_progress_bar = __import__("megadare.trainer.monitor", fromlist=["progress_bar"]).progress_bar

    def recording_progress_bar(**kwargs):
        bars.append(real_progress_bar(**kwargs))
        return bars[-1]

    monkeypatch.setattr("megadare.trainer.monitor.progress_bar", recording_progress_bar)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(_Bang):
        train_steps(run, _step_fn(fail_at), lambda r: None, len(run.examples), "sft")
    assert signal.getsignal(signal.SIGINT) is before
    assert len(bars) == 1 and bars[0].disable  # tqdm.close() disables the bar once its line is ended
    assert run.step == fail_at - 1
