"""The end of the local Ray a run started, when the run itself is SIGKILLed (kill -9, the OOM killer).

Ray fate-shares its GCS and raylet with the driver that started them (``PR_SET_PDEATHSIG``), and the workers follow
their raylet; but the raylet's children, Ray's dashboard and runtime-env agents, wait for the dead GCS a minute or
more before they give up. Under ``--nproc`` the launcher adopts them (a child subreaper) and ends them; a run in one
process has no such parent. So a process that starts a local Ray also starts a guard (``start``): a small child
that notes the driver's Ray processes (its descendants, never another Ray's on the node) each ``PROBE_S`` and,
once the driver is gone, SIGKILLs those still there. It ignores SIGINT / SIGTERM (the run stops Ray itself then)
and ends with its driver. A Ray process started after its last look is missed, which does not matter: a worker
(an engine's) is ended by its raylet as that dies (Ray 2.60: within 0.5 s, a SIGSTOPped one too); the agents
start within ``ray.init``, and one missed by a kill then gives up after ~60 s. No mark finds them once orphaned:
the agents' /proc environ reads empty (their retitling), they share the driver's process group and session.

    python -m megadare.rollout.ray_guard <driver pid>
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Optional

PROBE_S = 0.5  # seconds between two looks at the driver's Ray processes

_GUARD: list[subprocess.Popen] = []  # this process's guard, started once


def is_ray(p) -> bool:
    """``p`` (a psutil.Process) is one of Ray's processes: raylet, gcs_server, a worker or agent (``ray::...``),
    the dashboard. Raises psutil.Error when it is gone."""
    cmd = p.cmdline()
    name = os.path.basename(cmd[0]) if cmd else p.name()
    return name in ("raylet", "gcs_server") or name.startswith("ray::") or "ray/dashboard" in " ".join(cmd)


def start() -> None:
    """Start this process's guard (once; later calls keep the first: it watches every Ray this process starts)."""
    if _GUARD and _GUARD[0].poll() is None:
        return
    _GUARD[:] = [
        subprocess.Popen(
            [sys.executable, "-m", "megadare.rollout.ray_guard", str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
    ]


def _watch(driver: int) -> list:
    """The Ray processes seen among ``driver``'s descendants until it is gone (psutil.Process objects)."""
    import psutil  # heavy: only in the guard

    seen: dict[int, psutil.Process] = {}
    try:
        parent = psutil.Process(driver)
    except psutil.Error:
        return []
    while os.getppid() == driver:
        try:
            found = parent.children(recursive=True)
        except psutil.Error:  # the driver is gone
            break
        for p in found:
            try:
                if p.pid not in seen and is_ray(p):
                    seen[p.pid] = p
            except psutil.Error:
                continue
        seen = {pid: p for pid, p in seen.items() if p.is_running()}
        time.sleep(PROBE_S)
    return list(seen.values())


def main(argv: Optional[list[str]] = None) -> int:
    import psutil  # heavy: only in the guard

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    for p in _watch(int((argv or sys.argv[1:])[0])):
        try:
            p.kill()  # psutil checks the pid is still that process (not reused)
        except psutil.Error:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
