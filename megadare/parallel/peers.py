"""Which trainer rank a failed collective was waiting for. Neither gloo nor NCCL names it: a lost peer reads
'Connection reset by peer', a hung one 'Timed out waiting 3600000ms for recv'. Each rank's pid and host are
gathered once at start-up (``record``); on such an error ``suspects`` looks at the peers on this host: gone (or a
zombie its launcher has not reaped) is dead, state 'T' is stopped (SIGSTOP, Ctrl-Z, a debugger). Peers on other
hosts cannot be looked at from here."""

from __future__ import annotations

import os
import socket
import time
from typing import Optional

import torch.distributed as dist

_PEERS: dict[int, tuple[int, str]] = {}  # rank -> (pid, host), this process's world


def record() -> None:
    """Gather every rank's (pid, host) (collective; after ``init_process_group``)."""
    world = dist.get_world_size()
    here = (os.getpid(), socket.gethostname())
    table: list = [None] * world
    if world > 1:
        dist.all_gather_object(table, here)
    else:
        table = [here]
    _PEERS.clear()
    _PEERS.update(enumerate(table))


def _state(pid: int) -> Optional[str]:
    """'died' (gone or a zombie), 'is stopped (SIGSTOP, Ctrl-Z, a debugger)', or None (alive, running)."""
    import psutil  # heavy: only on a failed collective

    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "died"
    except psutil.Error:
        return None
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) or exiting(pid):
        return "died"
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return "is stopped (SIGSTOP, Ctrl-Z, a debugger)"
    return None


_PF_EXITING = 0x4  # linux/sched.h: the process is in its exit (set before it closes its files)


def exiting(pid: int, proc: str = "/proc") -> bool:
    """Whether ``pid`` is in its exit (a SIGKILL delivered): its sockets may be closed already while it still
    shows as running, not a zombie (``/proc/PID/stat``'s flags; False where they cannot be read)."""
    try:
        with open(os.path.join(proc, str(pid), "stat")) as f:
            stat = f.read()
        flags = int(stat[stat.rindex(")") + 2 :].split()[6])  # field 9; the name before it may hold ') '
    except (OSError, ValueError, IndexError):
        return False
    return bool(flags & _PF_EXITING)


def suspects(rank: int) -> list[tuple[int, int, str, str]]:
    """The peers of ``rank`` on this host that are dead or stopped: (rank, pid, host, state), by rank."""
    host = socket.gethostname()
    found = []
    for r, (pid, h) in sorted(_PEERS.items()):
        if r == rank or h != host:
            continue
        state = _state(pid)
        if state is not None:
            found.append((r, pid, h, state))
    return found


def dead_within(rank: int, wait_s: float) -> list[int]:
    """The peers of ``rank`` on this host found dead, looking again for up to ``wait_s`` while none is. A SIGKILLed
    process's sockets close before it shows as dead (the kernel's exit closes its files, then makes it a zombie):
    a survivor that read 'Connection reset by peer' could look in between (a few ms, more on a loaded host), find
    every peer running and name none."""
    deadline = time.monotonic() + wait_s
    host = socket.gethostname()
    others_here = any(r != rank and h == host for r, (_, h) in _PEERS.items())
    while True:
        dead = [r for r, _, _, state in suspects(rank) if state == "died"]
        if dead or not others_here or time.monotonic() >= deadline:
            return dead
        time.sleep(0.01)


def named(found: list[tuple[int, int, str, str]]) -> str:
    """'trainer rank 2 (pid P on host) died; ...': the ``suspects`` in words."""
    return "; ".join(f"trainer rank {r} (pid {pid} on {host}) {state}" for r, pid, host, state in found)
