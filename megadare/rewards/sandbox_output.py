"""Collecting a sandboxed program's output: stdout and stderr read under a size cap until exit or the wall-clock
deadline (which starts when the child reports that its sandbox is up), then the whole process group killed and the
pipes drained; the program reaped for its exit code and CPU time.
"""

from __future__ import annotations

import fcntl
import os
import selectors
import signal
import subprocess
import time
from typing import List, NamedTuple, Optional, Tuple

__all__ = ["SETUP_LIMIT_S", "Collected", "collect", "reap", "drain", "kill_group"]

SETUP_LIMIT_S = 60.0  # the sandbox's own start (before the program's timeout_s begins), however loaded


def _exited(pid: int) -> bool:
    """Has ``pid`` exited? (without reaping it, so its process group id cannot be reused before killpg)"""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Collected(NamedTuple):
    stdout: bytes
    stderr: bytes
    report: List[str]  # the lines the child reported: layers in place, or the jail's "unavailable <why>"
    timed_out: bool
    truncated: bool
    started: bool  # the child closed its report pipe: the program itself ran


def collect(proc: subprocess.Popen, timeout_s: float, limit: int, report_fd: int) -> Collected:
    """Read stdout/stderr until exit, deadline or ``limit`` bytes; then kill the process group and drain.

    The program's ``timeout_s`` counts from the moment the child closes its report pipe (just before the user code
    runs): the sandbox's own start (namespaces, mounts, interpreter) never eats a program's time, however loaded
    the machine; that start has :data:`SETUP_LIMIT_S` of its own.
    """
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray(), report_fd: bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    total, timed_out, truncated, started = 0, False, False, False
    deadline = time.monotonic() + SETUP_LIMIT_S
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = not _exited(proc.pid)
                break
            if not sel.get_map():
                if _exited(proc.pid):
                    break
                time.sleep(min(0.005, remaining))
                continue
            events = sel.select(timeout=min(0.05, remaining))
            for key, _ in events:
                chunk = _read(key.fd)
                if chunk is None:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    if key.fd == report_fd:
                        started, deadline = True, time.monotonic() + timeout_s
                    continue
                bufs[key.fd] += chunk
                if key.fd != report_fd:
                    total += len(chunk)
                    truncated = truncated or total > limit
            if truncated:
                break
            if not events and _exited(proc.pid):  # exited, but something still holds the pipes
                break
        kill_group(proc.pid)
        total += _drain_pipes(sel, bufs, limit - total if not truncated else -1, report_fd)
        truncated = truncated or total > limit
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
    out_b, err_b = bufs[out_fd], bufs[err_fd]
    if truncated:
        out_b, err_b = out_b[:limit], err_b[:limit]
    report = [line for line in bufs[report_fd].decode(errors="replace").splitlines() if line]
    return Collected(bytes(out_b), bytes(err_b), report, timed_out, truncated, started)


def _drain_pipes(sel: selectors.BaseSelector, bufs: dict, room: int, report_fd: int) -> int:
    """After the kill: what is left in the pipes (half a second at most; nothing when ``room`` < 0, and no more
    once the output took more than ``room`` bytes); the bytes added to stdout and stderr."""
    added, until = 0, time.monotonic() + 0.5
    while sel.get_map() and time.monotonic() < until and 0 <= room and added <= room:
        for key, _ in sel.select(timeout=0.05):
            chunk = _read(key.fd)
            if chunk == b"":
                sel.unregister(key.fd)
            elif chunk:
                bufs[key.fd] += chunk
                added += 0 if key.fd == report_fd else len(chunk)
    return added


def reap(proc: subprocess.Popen) -> Tuple[int, float]:
    """Wait for the (already killed or exited) program: its exit code and the CPU seconds it used."""
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except ChildProcessError:
        return proc.wait(), 0.0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def _read(fd: int) -> Optional[bytes]:
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def drain(fd: int, limit: int = 4096) -> bytes:
    """What the (exited) child wrote to a pipe, up to ``limit`` bytes, without blocking."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    data = b""
    try:
        while len(data) < limit:
            chunk = os.read(fd, limit)
            if not chunk:
                break
            data += chunk
    except BlockingIOError:
        pass
    return data
