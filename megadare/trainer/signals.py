"""Graceful stop on SIGTERM / SIGINT (Slurm preemption, scancel, Ctrl-C): finish the step, checkpoint, exit.

The flag is agreed on by all ranks (an all-reduce of MAX at each step end), so every rank stops after the same
step and takes part in the final checkpoint even if the signal reached only some of them.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megadare.errors import StoppedBeforeTheLoop
from megadare.rollout.ray_health import note_sigterm

# set up and not yet in its loop (``stopping_before_the_loop``), and whether the SIGTERM came meanwhile
_SETTING_UP = {"on": False, "stopped": False}


def _stop_the_set_up(signum, frame) -> None:
    """SIGTERM while a run sets up: its set-up unwinds (once: a second SIGTERM, the launcher passing the job's on,
    must not break the unwinding); after it, what SIG_DFL does."""
    if not _SETTING_UP["on"]:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)
        return
    note_sigterm()
    if not _SETTING_UP["stopped"]:
        _SETTING_UP["stopped"] = True
        raise StoppedBeforeTheLoop(signum)


@contextmanager
def stopping_before_the_loop() -> Iterator[None]:
    """Around a run (``run_rl``, ``run_sft``): a SIGTERM before its loop (``StopSignal``) takes over ends the set-up
    by ``StoppedBeforeTheLoop``, its cleanup run, not by the default handler (exit 143, a silent death, the run
    lock left to go stale). ``ray.init`` puts in Ray's own handler (``sys.exit(15)``): its SystemExit before the
    loop is the same stop."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _stop_the_set_up)
    _SETTING_UP.update(on=True, stopped=False)
    try:
        yield
    except SystemExit as e:
        if _SETTING_UP["on"] and e.code == signal.SIGTERM:  # Ray's handler, from ray.init on
            note_sigterm()
            raise StoppedBeforeTheLoop(signal.SIGTERM) from None
        raise
    finally:
        _SETTING_UP["on"] = False
        signal.signal(signal.SIGTERM, previous)


class StopSignal:
    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.received: Optional[int] = None
        _SETTING_UP["on"] = False  # from here on a SIGTERM finishes the step and saves
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
