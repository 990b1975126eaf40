"""Graceful stop on SIGTERM / SIGINT (Slurm preemption, scancel, Ctrl-C): finish the step, checkpoint, exit.

The flag is agreed on by all ranks (an all-reduce of MAX at each step end), so every rank stops after the same
step and takes part in the final checkpoint even if the signal reached only some of them.
"""

from __future__ import annotations

import signal
from typing import Optional

import torch
import torch.distributed as dist

from megadare.rollout.ray_health import note_sigterm


class StopSignal:
    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.received: Optional[int] = None
        self._previous = {}
        for s in signals:
            try:
                self._previous[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread: leave handlers alone
                pass

    def _handle(self, signum, frame) -> None:
        self.received = signum
        if signum == signal.SIGTERM:
            note_sigterm()

    def should_stop(self) -> bool:
        """True on every rank once any rank received a signal (collective when distributed)."""
        flag = torch.tensor([1 if self.received is not None else 0], dtype=torch.int32)
        if dist.is_initialized():
            if dist.get_backend() == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
