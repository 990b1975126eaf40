"""The step loop of SFT, DPO and RL: how many steps, when a periodic action is due, when to stop.

    loop = Loop(cfg.rl.steps, run.step, monitor, max_steps)
    while loop.running(run.step):
        ...one step...; run.step += 1
        if loop.every(run.step, cfg.rl.eval_interval): evaluate()
        if loop.checkpoint_due(run.step, cfg.checkpoint.save_interval): save()
        if loop.done(run.step): break
    loop.close()

One rule for every periodic action (``every``: each ``interval`` steps and the last, as slime's
``should_run_periodic_action``); SIGTERM / SIGINT finish the current step, checkpoint and stop (signals.py);
``max_steps`` ends this invocation early (tests of resume) without the final checkpoint unless it falls there.
"""

from __future__ import annotations

from typing import Optional

from megadare.trainer.monitor import Monitor
from megadare.trainer.signals import StopSignal


def every(step: int, interval: Optional[int], last: int) -> bool:
    """A periodic action is due after ``step``: each ``interval`` steps (0 / None: never) and at the ``last``."""
    return step == last or bool(interval and step % interval == 0)


class Loop:
    """``steps`` steps in all from ``start``; the stop signal is watched from here on; ``monitor`` logs them."""

    def __init__(self, steps: int, start: int, monitor: Monitor, max_steps: Optional[int] = None):
        self.steps, self.start, self.monitor, self.max_steps = steps, start, monitor, max_steps
        self.stop_signal = StopSignal()
        self.stopped = False

    def running(self, step: int) -> bool:
        return step < self.steps

    def every(self, step: int, interval: Optional[int]) -> bool:
        return every(step, interval, self.steps)

    def checkpoint_due(self, step: int, interval: Optional[int]) -> bool:
        """Whether to checkpoint after ``step``: on a stop signal (agreed by every rank: collective) or by
        ``every``."""
        self.stopped = self.stop_signal.should_stop()
        return self.stopped or self.every(step, interval)

    def done(self, step: int) -> bool:
        """Stop after ``step``: a signal arrived, or this invocation took its ``max_steps``."""
        return self.stopped or (self.max_steps is not None and step - self.start >= self.max_steps)

    def close(self) -> None:
        self.monitor.close()
        self.stop_signal.restore()
