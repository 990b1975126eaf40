"""What a SIGTERM (Slurm's preemption or time limit, ``scancel``) does to a run's process, by the phase it is in:

* set-up (from the start of ``megadare sft|dpo|rl``, of a launched rank, before the loop): the set-up unwinds by
  ``StoppedBeforeTheLoop`` (once), its cleanup run, and the command says so in one line, exit 0; ``megadare eval``
  and ``megadare convert``, which have no loop, are in this phase throughout (what they wrote half is removed,
  what they finished is kept, and they say which in one line), ``megadare demo`` outside its stages' loops (its
  set-up, between SFT and RL: one line naming the checkpoints its stages kept) and the quantize tool likewise;
* the loop: trainer/signals.py's ``StopSignal`` takes over (finish the step, save, stop);
* after the loop (its last checkpoint written): the cleanup finishes and the summary says the SIGTERM came after
  the checkpoint; nothing is lost, so the run is not turned into an error;
* outside any run (``watching`` not entered): what SIG_DFL does.

A run entered after another one finished in the same command (the demo's RL after its SFT) has a set-up phase of
its own; a SIGTERM between the two stops it as it enters.

Torch-free, on the floor: the command installs it before its heavy imports (cli.py), a rank before its own
(parallel/launch.py), the trainer around its set-up (trainer/signals.py). ``watching`` nests: the outermost one
installs the handler and puts back what was there before.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from megadare.errors import StoppedBeforeTheLoop

SET_UP, LOOP, FINISHED = "set-up", "loop", "finished"

# depth: nested ``watching``; stopped: the set-up's StoppedBeforeTheLoop was raised; late: a SIGTERM came after
# the loop; notes: what each level asked to be told of a SIGTERM (trainer/signals.py: Ray's health check)
_STATE: dict = {"depth": 0, "phase": None, "previous": None, "stopped": False, "late": False, "notes": []}


def _on_sigterm(signum, frame) -> None:
    """The handler while ``watching``: by the phase (module doc)."""
    phase = _STATE["phase"] if _STATE["depth"] else None
    if phase is None:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)
        return
    for note in list(_STATE["notes"]):
        note()
    if phase == SET_UP and not _STATE["stopped"]:  # once: the launcher passing the job's SIGTERM on must not
        _STATE["stopped"] = True  # break the unwinding
        raise StoppedBeforeTheLoop(signum)
    if phase != SET_UP:
        _STATE["late"] = True


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def watching(note: Optional[Callable[[], None]] = None) -> Iterator[None]:
    """A SIGTERM meanwhile acts by the phase (module doc); the outermost level starts the set-up phase. ``note``:
    called on each SIGTERM while this level lasts. Outside the main thread (no handler can be set): nothing."""
    if not _main_thread():
        yield
        return
    if _STATE["depth"] == 0:
        _STATE.update(previous=signal.getsignal(signal.SIGTERM), phase=SET_UP, stopped=False, late=False)
    elif _STATE["phase"] == FINISHED:  # a run after one that finished (the demo's RL after its SFT): its own set-up
        _STATE.update(phase=SET_UP, stopped=_STATE["late"])
        if _STATE["late"]:  # the job's SIGTERM came between the two: this one does not start
            raise StoppedBeforeTheLoop(signal.SIGTERM)
    _STATE["depth"] += 1
    if note is not None:
        _STATE["notes"].append(note)
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        if note is not None:
            _STATE["notes"].remove(note)
        _STATE["depth"] -= 1
        if _STATE["depth"] == 0:
            signal.signal(signal.SIGTERM, _STATE["previous"])
            _STATE.update(phase=None, previous=None)
        else:  # the level outside goes on watching (ray.init put in a handler of its own meanwhile)
            signal.signal(signal.SIGTERM, _on_sigterm)


@contextmanager
def held() -> Iterator[None]:
    """A SIGTERM meanwhile waits (blocked) until the block ends, then acts: around renames that must not be cut
    between two steps (an export put in place: convert/outputs.py ``publish``). Outside the main thread:
    nothing (a thread's mask does not hold the signal back from the main thread)."""
    if not _main_thread():
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def setting_up() -> bool:
    """Whether this process is watched and still sets up (no loop began)."""
    return bool(_STATE["depth"]) and _STATE["phase"] == SET_UP


def loop_began() -> None:
    """The loop takes SIGTERM over (trainer/signals.py ``StopSignal``)."""
    _STATE["phase"] = LOOP


def loop_ended() -> bool:
    """The loop ended (its checkpoint written, or an error on its way): a SIGTERM from here on lets the cleanup
    finish. Puts the handler back if watched (True), else leaves it to the caller (False)."""
    if not (_STATE["depth"] and _main_thread()):
        return False
    _STATE["phase"] = FINISHED
    signal.signal(signal.SIGTERM, _on_sigterm)
    return True


def sigterm_after_the_loop() -> bool:
    """Whether a SIGTERM came after the loop ended (``loop_ended``): the summary says that nothing was lost."""
    return _STATE["late"]
