"""One training run per run directory: ``<run_dir>/megadare.lock`` names the holder (pid, host, start time, Slurm
job), created exclusively by rank 0 when a run starts and removed when it ends.

A second run on the same directory is refused in one line naming the holder: two runs would interleave
metrics.jsonl and trip over each other's temporary checkpoint directories. A lock left by a run that died
(SIGKILL, a node failure) is taken over, saying so, when it can be shown dead: its pid is gone from this host (or
is another process, by start time), or it belongs to this same Slurm job (a requeue, possibly on another node).
A lock from another host that cannot be checked is refused with the fix: remove the file once that run is gone.
The lock is written aside and linked into place, so it never exists half-written (a full disk or a SIGKILL
while writing it used to leave an empty lock that refused every later run); an empty or garbled lock names no
holder and is taken over. A run locks its checkpoint root too (``<run_dir>/ckpt`` or ``checkpoint.save``): two
runs sharing one checkpoint root would prune and replace each other's checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
import contextlib
from contextlib import contextmanager
from typing import Iterator, Optional

import torch.distributed as dist

from megadare.errors import RunStateError
from megadare.files import OWNER, owned_name, sweep_dead
from megadare.trainer.monitor import foreign_run_config

LOCK = "megadare.lock"
_TMP = re.escape(LOCK + ".") + OWNER + "-tmp"  # the private file a lock is written to before its link


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
    if not holder:
        return "it names no holder (an empty or damaged lock file)"
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


def _create(path: str, me: dict) -> None:
    """``path`` holding ``me``, created only if absent (FileExistsError otherwise), never seen half-written: written
    to a private file, then hard-linked into place (where links are refused: exclusive create, then write)."""
    sweep_dead(os.path.dirname(path), _TMP)  # what a writer killed between write and link left
    tmp = owned_name(path + ".", "tmp")  # <pid>@<host>: two hosts' runs on a shared filesystem never share one
    try:
        with open(tmp, "w") as f:
            json.dump(me, f)
        try:
            os.link(tmp, path)
            return
        except FileExistsError:
            raise
        except OSError:  # a filesystem without hard links
            pass
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
        except BaseException:
            os.remove(path)
            raise
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def acquire(run_dir: str, key: str = "logging.run_dir") -> str:
    """Create the lock (rank 0); returns a note when a dead run's lock was taken over, else ''. Raises
    RunStateError when another live (or uncheckable) run holds it (``key``: the setting that chose the directory)."""
    path = os.path.join(run_dir, LOCK)
    me, note = _me(), ""
    for _ in range(3):
        try:
            os.makedirs(run_dir, exist_ok=True)
            _create(path, me)
        except FileExistsError:
            holder = _read(path)
            why = _holder_dead(holder, me)
            if why is None:
                raise RunStateError(_in_use(run_dir, holder, key)) from None
            note = f"{path}: took over the lock of pid {holder.get('pid', '?')} on {holder.get('host', '?')}: {why}"
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            continue
        except OSError as e:  # a read-only or full filesystem, no permission: before any step is trained
            raise RunStateError(
                f"{path}: cannot take the run lock: {e.strerror or e}{f' ({e.filename})' if e.filename else ''}; "
                f"the run writes its checkpoints and logs under {run_dir}: make it writable (or free space), or "
                "point logging.run_dir / checkpoint.save elsewhere"
            ) from None
        return note
    raise RunStateError(f"{path}: could not take the run lock (another run is starting on {run_dir}?)")


def _in_use(run_dir: str, holder: dict, key: str = "logging.run_dir") -> str:
    return (
        f"{run_dir} is in use by pid {holder.get('pid', '?')} on {holder.get('host', '?')} (since "
        f"{holder.get('time', '?')}; {os.path.join(run_dir, LOCK)}): wait for that run, stop it, or use another "
        f"{key}; if it is gone, remove the lock file"
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


def lock_dirs(run_dir: str, *also: str) -> list[str]:
    """The directories a run locks: ``run_dir``, and each of ``also`` (its checkpoint root), inside it or not, that
    is another directory (by real path: a symlink or ``..`` does not hide one). A root inside the run directory
    went unlocked: a second run with ``checkpoint.save`` (or ``logging.run_dir``) at it wrote there alongside."""
    out = [run_dir]
    for d in also:
        if os.path.realpath(d) not in map(os.path.realpath, out):
            out.append(d)
    return out


@contextmanager
def run_dir_lock(run_dir: str, *also: str, key: str = "logging.run_dir") -> Iterator[None]:
    """Hold the lock of ``run_dir`` and of each directory in ``also`` outside it (the checkpoint root) for the run
    (collective: rank 0 takes them, every rank learns the outcome). ``key``: the setting that chose ``run_dir``;
    a training run's (``logging.run_dir``) is also refused where it would replace the user's config.yaml."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    dirs = lock_dirs(run_dir, *also)
    outcome, held = [None], []
    made = [d for d in dirs if not os.path.isdir(d)]  # a refused run leaves no directory behind it
    if rank0:
        try:
            for d in dirs:
                note = acquire(d, key)
                held.append(d)
                if note:
                    print(note, file=sys.stderr, flush=True)
            outcome[0] = foreign_run_config(run_dir) if key == "logging.run_dir" else None
        except RunStateError as e:
            outcome[0] = str(e)
        finally:
            if outcome[0] or len(held) < len(dirs):  # refused, or acquire raised: give back what was taken
                for d in held:
                    release(d)
                for d in reversed(made):  # the checkpoint root before the run directory holding it
                    with contextlib.suppress(OSError):
                        os.rmdir(d)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0]:
        raise RunStateError(outcome[0])
    try:
        yield
    finally:
        if rank0:
            for d in held:
                release(d)
