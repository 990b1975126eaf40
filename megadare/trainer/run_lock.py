"""One training run per run directory: ``<run_dir>/megadare.lock`` names the holder (pid, host, start time, Slurm
job), created exclusively by rank 0 when a run starts and removed when it ends.

A second run on the same directory is refused in one line naming the holder: two runs would interleave
metrics.jsonl and trip over each other's temporary checkpoint directories. A lock left by a run that died
(SIGKILL, a node failure) is taken over, saying so, when it can be shown dead: its pid is gone from this host (or
is another process, by start time), or it belongs to this same Slurm job (a requeue, possibly on another node).
A lock from another host that cannot be checked is refused with the fix: remove the file once that run is gone.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from typing import Iterator, Optional

import torch.distributed as dist

from megadare.errors import RunStateError

LOCK = "megadare.lock"


def _start_time(pid: int) -> Optional[float]:
    import psutil  # optional-heavy: only when a lock holder must be checked

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _me() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": _start_time(os.getpid()),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _holder_dead(holder: dict, me: dict) -> Optional[str]:
    """Why the holder of a lock is known to be gone, or None when it may be alive."""
    if holder.get("slurm_job") and holder["slurm_job"] == me["slurm_job"]:
        return f"it belongs to this Slurm job {me['slurm_job']} (requeued)"
    if holder.get("host") != me["host"]:
        return None
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return "it names no pid"
    started = _start_time(pid)
    if started is None:
        return f"pid {pid} is no longer running"
    if holder.get("started") is not None and abs(started - holder["started"]) > 1.0:
        return f"pid {pid} is now another process"
    return None


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            out = json.load(f)
        return out if isinstance(out, dict) else {}
    except (OSError, ValueError):
        return {}


def acquire(run_dir: str) -> str:
    """Create the lock (rank 0); returns a note when a dead run's lock was taken over, else ''. Raises
    RunStateError when another live (or uncheckable) run holds it."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK)
    me, note = _me(), ""
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(path)
            why = _holder_dead(holder, me)
            if why is None:
                raise RunStateError(_in_use(run_dir, holder)) from None
            note = f"{path}: took over the lock of pid {holder.get('pid', '?')} on {holder.get('host', '?')}: {why}"
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return note
    raise RunStateError(f"{path}: could not take the run lock (another run is starting on {run_dir}?)")


def _in_use(run_dir: str, holder: dict) -> str:
    return (
        f"{run_dir} is in use by pid {holder.get('pid', '?')} on {holder.get('host', '?')} (since "
        f"{holder.get('time', '?')}; {os.path.join(run_dir, LOCK)}): wait for that run, stop it, or use another "
        "logging.run_dir; if it is gone, remove the lock file"
    )


def holder_alive(run_dir: str) -> Optional[str]:
    """Why ``run_dir`` cannot be used now (a live or uncheckable run holds its lock), else None; takes nothing."""
    path = os.path.join(run_dir, LOCK)
    if not os.path.exists(path):
        return None
    holder = _read(path)
    return _in_use(run_dir, holder) if _holder_dead(holder, _me()) is None else None


def release(run_dir: str) -> None:
    """Remove the lock if this process holds it."""
    path = os.path.join(run_dir, LOCK)
    if _read(path).get("pid") == os.getpid() and _read(path).get("host") == socket.gethostname():
        os.remove(path)


@contextmanager
def run_dir_lock(run_dir: str) -> Iterator[None]:
    """Hold ``run_dir``'s lock for the run (collective: rank 0 takes it, every rank learns the outcome)."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    outcome = [None]
    if rank0:
        try:
            note = acquire(run_dir)
            if note:
                print(note, file=sys.stderr, flush=True)
        except RunStateError as e:
            outcome[0] = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0]:
        raise RunStateError(outcome[0])
    try:
        yield
    finally:
        if rank0:
            release(run_dir)
