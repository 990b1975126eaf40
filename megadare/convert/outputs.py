"""Where an export may write (``megadare convert``, tools/checkpoint_convert/quantize.py): it replaces nothing it
did not write, and its output never overlaps its source.

``check_export_target(out, kind, sources)`` refuses, in one line naming the path and the fix, an ``out`` that
* equals, contains or lies inside a source (a source checkpoint's run root counts as a source: converting
  ``runs/x/ckpt/iter_0000500`` into ``runs/x`` would replace the run's checkpoints, logs and metrics);
* lies inside any run's checkpoint root (a directory holding ``latest_checkpointed_iteration.txt``), which the
  run prunes and replaces;
* is a file, or a non-empty directory that is not a previous export of the same kind (its ``EXPORT_MARK`` says
  which; a Megatron checkpoint that ``hf-to-megatron`` wrote before the mark existed is recognised by its
  megadare.json).
The writers then assemble the output in a fresh sibling (``staging_dir``), put the mark in (``mark_export``) and
rename it into place (``publish``); a previous export is removed only after the new one is in place.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import sys
from collections.abc import Iterable

from megadare import stopping
from megadare.console import end_open_line
from megadare.errors import OutputError
from megadare.models.safetensors_io import fresh_sibling, sweep_dead_siblings

EXPORT_MARK = ".megadare-export.json"
TRACKER = "latest_checkpointed_iteration.txt"
HF_SUBDIR = "hf"  # a Megatron checkpoint's (and export's) config and tokenizer files
KINDS = ("megatron", "hf", "hf-fp8", "hf-nvfp4", "hf-fp8-block")


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def _within(inner: str, outer: str) -> bool:
    """``inner`` equals ``outer`` or lies below it (both real paths)."""
    return os.path.commonpath([inner, outer]) == outer


def checkpoint_root_of(path: str) -> str | None:
    """The run checkpoint root ``path`` is or lies in (the nearest directory holding the tracker), else None."""
    p = _real(path)
    while True:
        if os.path.isfile(os.path.join(p, TRACKER)):
            return p
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent


def read_export_mark(path: str) -> dict | None:
    """The export mark of the directory ``path`` (``mark_export``'s JSON object), None without one. A mark that
    cannot be read or holds no kind raises OutputError in one line naming it: megadare cannot tell what the
    directory holds, so it neither reuses nor replaces it."""
    mark = os.path.join(path, EXPORT_MARK)
    if not os.path.isfile(mark):
        return None
    try:
        with open(mark) as f:
            found = json.load(f)
        why = "it holds no export kind"
    except (OSError, ValueError) as e:
        found, why = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if isinstance(found, dict) and isinstance(found.get("kind"), str):
        return found
    raise OutputError(
        f"{mark} is damaged ({why}); megadare cannot tell what {path} holds, so it neither reuses nor replaces it: "
        "if it is an export you no longer need, remove the directory (it is exported again), else choose another"
    )


def export_kind(path: str) -> str | None:
    """The kind of the megadare export at ``path`` (its mark; megadare.json for older Megatron exports), else None.
    A damaged mark raises OutputError (``read_export_mark``)."""
    mark = read_export_mark(path)
    if mark is not None:
        return mark["kind"]
    meta = os.path.join(path, "megadare.json")
    if os.path.isfile(meta) and not os.path.exists(os.path.join(path, "train_state.json")):
        try:
            with open(meta) as f:
                m = json.load(f)
        except (OSError, ValueError):
            return None
        if isinstance(m, dict) and m.get("format") == "megadare-torch_dist-v1" and m.get("source"):
            return "megatron"
    return None


def check_export_target(out: str, kind: str, sources: Iterable[str]) -> None:
    """Refuse (OutputError) an ``out`` that overlaps a source, lies in a checkpoint root, or holds something that is
    not a previous ``kind`` export; see the module docstring."""
    assert kind in KINDS, kind
    target = _real(out)
    roots = set()
    for s in sources:
        src = _real(s)
        roots.add(src)
        root = checkpoint_root_of(src)
        if root:
            roots.add(root)
    for src in sorted(roots):
        if _within(target, src) or _within(src, target):
            how = "is" if target == src else ("lies inside" if _within(target, src) else "contains")
            raise OutputError(
                f"--out {out} {how} the source {src}; an export must not overlap what it reads: "
                "choose a directory outside it"
            )
    root = checkpoint_root_of(target)
    if root:
        how = "is" if root == target else "lies inside"
        raise OutputError(
            f"--out {out} {how} the checkpoint root {root}, which a training run prunes and "
            "replaces; choose a directory outside it"
        )
    if os.path.lexists(target) and not os.path.isdir(target):
        raise OutputError(f"--out {out} is a file; choose a directory")
    if os.path.isdir(target) and os.listdir(target):
        found = export_kind(target)
        if found != kind:
            what = f"a {found} export" if found else "not an export megadare wrote (no " + EXPORT_MARK + ")"
            raise OutputError(
                f"--out {out} is not empty and is {what}; megadare only replaces a previous {kind} "
                "export: choose a new directory, or empty this one yourself"
            )
        foreign = _not_written_by_an_export(target)
        if foreign:
            raise OutputError(
                f"--out {out} holds {os.path.join(out, foreign)}, which no {kind} export writes (was the export "
                "used as a run directory?); replacing the export would delete it: move it out, or choose a new "
                "directory"
            )


# what a training run writes into its directory: never part of an export (an export holds files, and hf/)
RUN_FILES = (TRACKER, "metrics.jsonl", "metrics.rolled_back.jsonl", "megadare.lock", "config.yaml", "train_state.json")
# the kinds of file an export writes: tensors, configs and marks, tokenizer files, remote code, DCP storage
EXPORT_SUFFIXES = (".safetensors", ".json", ".txt", ".model", ".jinja", ".py", ".distcp", ".pt", ".metadata")


def _not_written_by_an_export(path: str) -> str | None:
    """The first entry of a previous export at ``path`` that no export writes (a directory other than hf/, a run's
    file, a file of a kind no export writes), else None."""
    for name in sorted(os.listdir(path)):
        p = os.path.join(path, name)
        if os.path.isdir(p):
            if name != HF_SUBDIR or _has_subdir(p):
                return name
        elif name in RUN_FILES or not name.endswith(EXPORT_SUFFIXES):
            return name
    return None


def staging_dir(out: str) -> str:
    """A new, empty sibling of ``out`` to assemble it in (a unique name: never an existing path), once what killed
    exports of ``out`` left beside it is removed (``sweep_dead_siblings``)."""
    out = os.fspath(out).rstrip(os.sep)
    for d in sweep_dead_siblings(out):
        end_open_line(sys.stderr)  # the converter's progress bar has drawn its first frame: a line of its own
        print(f"export: removed {d}, left by a killed export of {out}", file=sys.stderr, flush=True)
    return fresh_sibling(out, "tmp", create=True)


def mark_export(staging: str, kind: str, sources: Iterable[str], **extra) -> None:
    """Write the export mark (kind, sources, anything else) into the staging directory."""
    with open(os.path.join(staging, EXPORT_MARK), "w") as f:
        json.dump({"kind": kind, "sources": [os.path.abspath(s) for s in sources], **extra}, f, indent=2)


def publish(staging: str, out: str) -> str:
    """Rename the finished ``staging`` to ``out``; a previous export there (checked by ``check_export_target``) is
    swapped with it in one step where the filesystem can (Linux's RENAME_EXCHANGE), else moved aside first, and
    removed once the new one is in place. Returns ``out``. (Moving aside, then renaming, left no ``out`` at all
    when a kill fell between the two.)"""
    out = os.fspath(out).rstrip(os.sep)
    with stopping.held():  # a SIGTERM (megadare convert stops on it at once) waits until ``out`` is in place
        if not os.path.isdir(out):
            os.replace(staging, out)
        elif _exchange(staging, out):  # ``staging`` now holds the previous export
            shutil.rmtree(staging, ignore_errors=True)
        else:
            old = fresh_sibling(out, "old", create=False)
            os.replace(out, old)
            os.replace(staging, out)
            shutil.rmtree(old, ignore_errors=True)
    return out


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _exchange(a: str, b: str) -> bool:
    """Swap the paths ``a`` and ``b`` atomically (renameat2 RENAME_EXCHANGE); False where the C library or the
    filesystem cannot (nothing was changed then)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), a)


def _has_subdir(path: str) -> bool:
    with os.scandir(path) as it:
        return any(e.is_dir() for e in it)
