"""Processes that die with the process that started them (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``): the ranks
of a local launch (parallel/launch.py), megatron's checkpoint writers (convert/ckpt_writers.py), the reward
sandbox's keeper (rewards/sandbox_kernel.py). Below the models layer: every layer may use it.

The kernel sends the signal when the parent's *thread* that started this process ends, not its whole process:
start such a process from a thread that outlives it. A parent that died before the prctl sends nothing:
:func:`die_with_parent` then ends this process at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Optional

__all__ = ["PR_SET_PDEATHSIG", "die_with_parent"]

PR_SET_PDEATHSIG = 1


def _libc() -> Optional[ctypes.CDLL]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


# loaded once, here: die_with_parent also runs between fork and exec, where loading a library could take a lock
# another thread of the parent held
_LIBC = _libc()


def die_with_parent(parent: int, exit_code: int = 1) -> bool:
    """SIGKILL this process when ``parent`` (the pid that started it) ends; if it already did (this process's parent
    is no longer ``parent``: the kernel will send nothing), ``os._exit(exit_code)`` now. False where it cannot be
    armed (not Linux): nothing done. Takes no lock: safe between fork and exec."""
    if _LIBC is None or _LIBC.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:
        os._exit(exit_code)
    return True
