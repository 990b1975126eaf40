"""Files megadare writes so that no kill leaves them torn or lost: whole-file writes, and names that say whose.

* :func:`write_text_atomic`: a file replaced in one rename (a temp file beside it, on disk first), so a reader
  never sees it half-written; a kill leaves the previous version, and a ``<path>.tmp`` the next write replaces.
* :func:`owned_name` / :func:`sweep_dead`: a temp name carrying its writer's ``<pid>@<host>``, so that a later
  run removes what a killed writer (SIGKILL, an OOM kill) left, and never what a live process or another host
  still uses. Below the models layer: every layer may use them.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from typing import Optional

__all__ = [
    "write_text_atomic",
    "temp_of",
    "OWNER",
    "owner_tag",
    "owned_name",
    "owned_tempdir",
    "sweep_dead",
    "running",
    "inode_of",
]

OWNER = r"([0-9]+)@([^/]+?)"  # the ``<pid>@<host>`` of an owned name, as a regex (groups: pid, host)


def temp_of(path: str) -> str:
    """The temp file :func:`write_text_atomic` writes ``path`` through: ``<path>.tmp``."""
    return path + ".tmp"


def write_text_atomic(path: str, text: str) -> None:
    """``path`` holding ``text``, never seen half-written: :func:`temp_of` ``path``, on disk, renamed into place (a
    fixed temp name: what a killed write left is replaced by the next, never piles up beside it)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = temp_of(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    os.replace(tmp, path)


def owner_tag() -> str:
    """``<pid>@<host>`` of this process."""
    return f"{os.getpid()}@{socket.gethostname()}"


def owned_name(prefix: str, unique: str) -> str:
    """``<prefix><pid>@<host>-<unique>``: a name :func:`sweep_dead` (with the same prefix) can tell the owner of."""
    return f"{prefix}{owner_tag()}-{unique}"


def running(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's counts: it is alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: alive
        return True
    return True


def sweep_dead(directory: str, pattern: str) -> list[str]:
    """Remove the entries (files or directories) of ``directory`` whose name fully matches ``pattern`` (a regex
    whose first two groups are the owner's pid and host, e.g. built with :data:`OWNER`) and whose owner is a
    process of this host that is gone. Kept: another host's (its process cannot be checked), a live process's,
    names that do not match. Returns the paths removed."""
    mine, host, removed = re.compile(pattern), socket.gethostname(), []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
        m = mine.fullmatch(name)
        if not m or m.group(2) != host or running(int(m.group(1))):
            continue
        p = os.path.join(directory, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                os.remove(p)
            except FileNotFoundError:  # another sweeper was first
                pass
        removed.append(p)
    return removed


def owned_tempdir(prefix: str, parent: Optional[str] = None) -> str:
    """A new private directory ``<prefix><pid>@<host>-XXXXXXXX`` in ``parent`` (default: the temp dir, $TMPDIR),
    once those of ``prefix`` there whose owner on this host is gone (a SIGKILLed run: no clean-up ran) are
    removed; each killed run used to leave one more."""
    parent = parent or tempfile.gettempdir()
    sweep_dead(parent, re.escape(prefix) + OWNER + r"-[a-z0-9_]{8}")
    return tempfile.mkdtemp(prefix=owned_name(prefix, ""), dir=parent)


def inode_of(path: str) -> Optional[int]:
    """``path``'s inode, None where there is none: an output put in place by a rename (``publish``) changes it, so
    a command stopped at its end can tell whether its output landed."""
    try:
        return os.stat(path).st_ino
    except OSError:
        return None
