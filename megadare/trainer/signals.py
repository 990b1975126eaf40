"""Graceful stop on SIGTERM / SIGINT (Slurm preemption, scancel, Ctrl-C): finish the step, checkpoint, exit.

The flag is agreed on by all ranks (an all-reduce of MAX at each step end), so every rank stops after the same
step and takes part in the final checkpoint even if the signal reached only some of them.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megadare import stopping
from megadare.errors import StoppedBeforeTheLoop
from megadare.rollout.ray_health import note_sigterm


@contextmanager
def stopping_before_the_loop() -> Iterator[None]:
    """Around a run (``run_rl``, ``run_sft``): a SIGTERM before its loop (``StopSignal``) takes over ends the set-up
    by ``StoppedBeforeTheLoop``, its cleanup run, not by the default handler (exit 143, a silent death, the run
    lock left to go stale); one after the loop lets the cleanup finish (megadare/stopping.py). ``ray.init`` puts in
    Ray's own handler (``sys.exit(15)``): its SystemExit before the loop is the same stop."""
    with stopping.watching(note=note_sigterm):
        try:
            yield
        except SystemExit as e:
            if stopping.setting_up() and e.code == signal.SIGTERM:  # Ray's handler, from ray.init on
                note_sigterm()
                raise StoppedBeforeTheLoop(signal.SIGTERM) from None
            raise


class StopSignal:
    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.received: Optional[int] = None
        stopping.loop_began()  # from here on a SIGTERM finishes the step and saves
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
        """The handlers from before the loop; SIGTERM's, while the run is watched, the one that lets the cleanup
        after the loop finish (megadare/stopping.py): the previous one (SIG_DFL, Ray's ``sys.exit(15)``) turned a
        SIGTERM there, the checkpoint written, into a silent death."""
        for s, h in self._previous.items():
            if not (s == signal.SIGTERM and stopping.loop_ended()):
                signal.signal(s, h)
