"""The RL learning-rate schedule follows the RL steps: a step whose filters kept fewer prompt groups than
``rl.mini_batches`` (or none) makes fewer optimizer updates than the schedule counts for it, and the schedule then
catches up at the step's end: after step t it stands where t x ppo_epochs x mini_batches updates put it, as in a
run where every update happened. Checked against megatron's own scheduler stepped once per update."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

import megadare.trainer.rl as rl_loop
from megadare.config import load_config

STEPS, MINI_BATCHES = 4, 2
UPDATES = STEPS * MINI_BATCHES


def _scheduler() -> OptimizerParamScheduler:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=1.0,
        min_lr=0.1,
        lr_warmup_steps=3,
        lr_decay_steps=UPDATES,
        lr_decay_style="linear",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=UPDATES,
        wd_incr_style="constant",
    )


def _lr(scheduler) -> float:
    return scheduler.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("kept", [[2, 0, 1, 2], [1, 1, 1, 1], [0, 0, 0, 0]])
def test_the_schedule_stands_where_the_rl_steps_put_it(monkeypatch, kept):
    """``kept[t]``: the mini-batches step t trained (2: all; 1: its filters kept one prompt group; 0: none)."""
    cfg = load_config(None, [f"rl.steps={STEPS}", f"rl.mini_batches={MINI_BATCHES}", "rl.prompts_per_step=2"])
    sched = _scheduler()

    def update(su, samples, objective, correction):
        for _ in range(len(samples)):  # one optimizer update per mini-batch kept
            sched.step(increment=1)
        return {"lr": _lr(sched)}

    monkeypatch.setattr(rl_loop, "_step_update", lambda run: None)
    policy = SimpleNamespace(scheduler=sched, update=update)
    run = SimpleNamespace(cfg=cfg, policy=policy, algo=SimpleNamespace(objective=lambda **kw: SimpleNamespace()))
    every_update = _scheduler()
    for step, n in enumerate(kept):
        run.step = step
        rl_loop.train(run, ["mini-batch"] * n, None)
        for _ in range(MINI_BATCHES):
            every_update.step(increment=1)
        assert sched.num_steps == every_update.num_steps == (step + 1) * MINI_BATCHES
        assert _lr(sched) == _lr(every_update), (step, kept)
    assert _lr(sched) == pytest.approx(0.1)  # the decay reached optim.min_lr at the run's end
