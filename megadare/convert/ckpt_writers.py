"""megatron-core's checkpoint writer processes, kept from outliving the trainer.

megatron's torch_dist save (``FileSystemWriterAsync``, on the synchronous path too) forks one writer process per
file bucket, each holding a copy-on-write image of the trainer, and collects their results through a queue
served by a spawned multiprocessing Manager (which starts multiprocessing's resource tracker). When the trainer
is SIGKILLed during a save, the writers block for good on a queue nobody reads and the Manager and the tracker
wait for a parent that is gone; and the writers inherited the trainer's SIGTERM handler (which only sets a flag
for the training loop), so ``kill`` does not end them either.

``writers_die_with_trainer()`` (around ``dist_checkpointing.save``): every process this one forks meanwhile gets
``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (it dies with the thread that forked it; Linux), SIGTERM back to its default
action, and SIGINT ignored (a Ctrl-C reaches the whole process group: the trainer finishes the step and saves,
the writers finish writing); and megatron's results queue is an in-process ``queue.Queue`` (a synchronous save
puts and gets in this very process), so no Manager and no resource tracker are started.
"""

from __future__ import annotations

import os
import queue
import signal
from contextlib import contextmanager
from typing import Iterator, Optional

from megadare.lifetime import die_with_parent

_saving_pid: Optional[int] = None  # the trainer's pid while a save forks writers, else None


def _in_forked_writer() -> None:
    """os.register_at_fork hook: runs in every child forked while a save is in progress."""
    global _saving_pid
    parent, _saving_pid = _saving_pid, None
    if parent is None:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)  # a trainer that died before the death signal was armed: the writer exits now


os.register_at_fork(after_in_child=_in_forked_writer)


@contextmanager
def writers_die_with_trainer() -> Iterator[None]:
    """Around a synchronous megatron checkpoint save: see the module docstring."""
    global _saving_pid
    from megatron.core.dist_checkpointing.strategies import filesystem_async  # heavy: megatron

    previous = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    _saving_pid = os.getpid()
    try:
        yield
    finally:
        _saving_pid = None
        filesystem_async._results_queue = previous
