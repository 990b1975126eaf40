"""Run a function in N local processes with torch.distributed env vars set (CPU gloo runs, tests, the demo).

``spawn(fn, world_size, *args)`` starts ``world_size`` processes (start method 'spawn'), calls
``fn(rank, world_size, *args)`` in each, and returns the per-rank results. An exception in any rank is raised in
the parent with that rank's traceback (megadare's own one-line errors as themselves, the traceback as their cause); a hung collective fails after ``timeout_s`` instead of hanging.
"""

from __future__ import annotations

import os
import pickle
import queue as _q
import socket
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    """A rank raised; the message carries its traceback."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    try:
        # plain pickle copies tensor data: torch's fd sharing would die with this process
        queue.put((rank, True, pickle.dumps(fn(rank, world, *args))))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, (traceback.format_exc(), _one_line_error(e))))


def _one_line_error(e: BaseException):
    """megadare's own one-line errors (ValueError subclasses defined in megadare: ConfigError, DataError, ...),
    pickled to be raised again in the parent as they are; None for anything else."""
    if isinstance(e, ValueError) and type(e).__module__.startswith("megadare."):
        try:
            return pickle.dumps(e)
        except Exception:  # noqa: BLE001 - an unpicklable error is reported by its traceback
            return None
    return None


def spawn(fn: Callable, world_size: int, *args: Any, timeout_s: float = 600) -> list[Any]:
    """``fn`` in ``world_size`` fresh processes. ``free_port`` releases the port it found before rank 0 binds it, so
    another process can take it in between (EADDRINUSE at rank 0's TCPStore): then the launch starts again on a new
    port, up to three times, before the error is raised."""
    for attempt in range(3):
        results, errors, own = _spawn_once(fn, world_size, args, timeout_s)
        port_taken = errors and not results and "EADDRINUSE" in errors[0]
        if not (port_taken and attempt < 2):
            break
    if own:
        raise own[0] from WorkerError("\n".join(errors))
    if errors:
        raise WorkerError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def _spawn_once(fn: Callable, world_size: int, args: tuple, timeout_s: float):
    """One launch: (results by rank, error texts, megadare's own errors)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue), daemon=False) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    own: list[BaseException] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, val = queue.get(timeout=timeout_s)
            except _q.Empty:
                waiting = sorted(set(range(world_size)) - set(results))
                errors.append(f"timed out after {timeout_s}s waiting for ranks {waiting}")
                break
            if ok:
                results[rank] = pickle.loads(val)
            else:
                tb, err = val
                errors.append(f"rank {rank} failed:\n{tb}")
                if err is not None:
                    own.append(pickle.loads(err))
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return results, errors, own
