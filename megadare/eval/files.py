"""Where a task's data lives, reading it with each row's location, and atomic output files.

A task's file is ``eval.paths.<task>`` when set, else ``<eval.data_dir>/<task>.jsonl`` or ``.parquet``; nothing is
ever downloaded. Rows are read by :func:`megadare.data.files.load_rows` (the SFT / RL reader, whose errors
name ``file:line``); each row keeps its location (``file:line`` for JSONL, ``file:row N`` for parquet) so a
missing or malformed field is reported where it is.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

from megadare.errors import ConfigError, OutputError
from megadare.files import write_text_atomic
from megadare.data.files import DataError
from megadare.data.files import load_rows as load_file_rows

__all__ = [
    "task_file",
    "load_rows",
    "write_text_atomic",
    "write_jsonl_atomic",
    "write_json_atomic",
    "claim_output_dir",
]

EXTENSIONS = (".jsonl", ".parquet")


def task_file(data_dir: str | None, paths: dict, task: str) -> str:
    """The data file of ``task``: ``eval.paths.<task>``, else the one ``<data_dir>/<task>.{jsonl,parquet}``."""
    if paths.get(task):
        path = str(paths[task])
        if not os.path.isfile(path):
            raise DataError(f"{path}: data file of task {task!r} not found (set by eval.paths.{task})")
        return path
    if not data_dir:
        raise ConfigError(
            f"no data for task {task!r}: set eval.data_dir (a directory holding {task}.jsonl or "
            f"{task}.parquet) or eval.paths.{task} (a file); nothing is downloaded"
        )
    found = [
        os.path.join(data_dir, task + ext) for ext in EXTENSIONS if os.path.isfile(os.path.join(data_dir, task + ext))
    ]
    if not found:
        tried = " or ".join(os.path.join(data_dir, task + ext) for ext in EXTENSIONS)
        raise DataError(
            f"{tried}: data file of task {task!r} not found (eval.data_dir={data_dir!r}); "
            f"put the benchmark there or point eval.paths.{task} at it"
        )
    if len(found) > 1:
        raise ConfigError(
            f"task {task!r}: both {found[0]} and {found[1]} exist in eval.data_dir; choose one with eval.paths.{task}"
        )
    return found[0]


def load_rows(path: str, limit: int | None = None) -> list[tuple[str, dict]]:
    """``(location, row)`` of the first ``limit`` rows (all when None) of a .jsonl / .parquet file."""
    rows = load_file_rows(path)
    if not rows:
        raise DataError(f"{path}: the file holds no rows")
    return rows if limit is None else rows[:limit]


def write_jsonl_atomic(path: str, rows: Iterable[dict[str, Any]]) -> None:
    """One JSON object per line, atomically."""
    write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def write_json_atomic(path: str, obj: Any) -> None:
    """Indented JSON, atomically."""
    write_text_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


EVAL_MARK = ".megadare-eval.json"  # an output directory megadare eval wrote into


def _written_by_eval(path: str) -> bool:
    """``path`` holds the mark, or (an eval of an older megadare) a summary.json of megadare eval's keys."""
    if os.path.isfile(os.path.join(path, EVAL_MARK)):
        return True
    try:
        with open(os.path.join(path, "summary.json")) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and {"model", "n_samples", "sampling", "tasks"} <= set(summary)


def claim_output_dir(out_dir: str, names: list[str], key: str = "eval.output_dir") -> None:
    """Refuse (OutputError, one line) an output directory where ``names`` would replace files that no megadare
    eval wrote (a file of the user's that happens to be called summary.json), or that is a file; otherwise create
    it and put the mark in, so a rerun may replace its own outputs."""
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise OutputError(f"{key}={out_dir} is a file; choose a directory")
    taken = [n for n in names if os.path.lexists(os.path.join(out_dir, n))]
    if taken and not _written_by_eval(out_dir):
        raise OutputError(
            f"{key}={out_dir} holds {os.path.join(out_dir, taken[0])}, which megadare eval did not write (no "
            f"{EVAL_MARK}); the outputs would replace it: choose a new directory, or move it out"
        )
    write_json_atomic(os.path.join(out_dir, EVAL_MARK), {"written_by": "megadare eval"})
