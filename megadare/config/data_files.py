"""The data files a command reads, checked before torch loads: each one a file of a known extension that exists and
can be read. A missing file is then refused in a second, not after the ~8 CPU-seconds of the full stack; what the
rows hold is checked when they load (megadare/data/, and ``--dry-run``'s first rows: preflight.py)."""

from __future__ import annotations

import os

from megadare.config.sections import Config
from megadare.data.files import SUPPORTED_EXTENSIONS, as_paths, missing_file
from megadare.errors import ConfigError

FILE_TASK_EXTENSIONS = (".jsonl", ".parquet")  # an eval.tasks entry ending so is a file (eval/tasks.py task_spec)


def data_files(cfg: Config, job: str) -> list[tuple[str, str]]:
    """(key, path) of every data file ``job`` reads: data.path (and RL's data.eval_path) unless a synthetic task
    replaces them; for eval, the files named in eval.tasks and eval.paths of the tasks it runs."""
    d = cfg.data
    if job in ("sft", "dpo", "rl") and not d.synthetic:
        keys = ("data.path", "data.eval_path") if job == "rl" else ("data.path",)
        return [(k, p) for k in keys for p in as_paths(getattr(d, k.split(".")[1]), k)]
    if job != "eval":
        return []
    tasks = [str(t) for t in cfg.eval.tasks]
    out = [("eval.tasks", t) for t in tasks if t.lower().endswith(FILE_TASK_EXTENSIONS)]
    return out + [(f"eval.paths.{t}", str(p)) for t, p in cfg.eval.paths.items() if p and t in tasks]


def check_data_files(cfg: Config, job: str) -> None:
    """Each data file of ``job`` has a known extension, exists, is a file and can be read; else one line naming
    the file, the key that names it and the fix."""
    for key, path in data_files(cfg, job):
        ext = os.path.splitext(path)[1].lower()
        if ext not in SUPPORTED_EXTENSIONS:
            raise ConfigError(
                f"{path}: unsupported data file extension {ext or '(none)'!r} ({cfg.as_written(key)}); supported: "
                f"{', '.join(SUPPORTED_EXTENSIONS)}"
            )
        if not os.path.isfile(path):
            raise ConfigError(missing_file(path, cfg.as_written(key)))
        if not os.access(path, os.R_OK):
            raise ConfigError(
                f"{path}: data file cannot be read (permission denied) ({cfg.as_written(key)}); fix its permissions"
            )
