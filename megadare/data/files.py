"""Data files: .jsonl / .json / .parquet records, each with where it came from, and the one error type of the data layer.

``load_records(path)`` reads every record of one file; ``load_rows(path)`` pairs each with its location
(``file:line`` for JSONL, ``file:row N`` for parquet, 1-based) so that every later error can name it;
``load_many(paths)`` does that over a list of files (``data.path`` may be one file or a list: DARE's recipes mix
math + gsm8k).
"""

from __future__ import annotations

import json
import os
from typing import Sequence, Union

__all__ = ["DataError", "check_record", "SUPPORTED_EXTENSIONS", "load_records", "load_rows", "load_many", "as_paths"]

SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet")
BOM = b"\xef\xbb\xbf"  # the UTF-8 byte order mark some editors put at the start of a file


class DataError(ValueError):
    """A data file or record that cannot be used; the message says where and why."""


def check_record(rec: object, where: str) -> dict:
    """``rec`` if it is a record (a JSON object); else a DataError naming ``where``."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a record object, got {type(rec).__name__}")
    return rec


def load_records(path: str) -> list[dict]:
    """All records of a .jsonl, .json or .parquet file, as dicts."""
    return [rec for _, rec in load_rows(path)]


def missing_file(path: str, key: str = "") -> str:
    """Why ``path`` (named by ``key``, an option or config key, when given) is not a data file here, and what to do:
    a relative path is named with the directory it is relative to (the current one); DARE's example paths
    (``data/preprocessed/...``) are relative to a DARE checkout."""
    by = f" ({key})" if key else ""
    if os.path.isdir(path):
        return f"{path}: is a directory, not a data file{by}; name a .jsonl / .json / .parquet file in it"
    fix = f"point {key} at an existing file" if key else "check the path"
    if os.path.isabs(path):
        return f"{path}: data file not found{by}; {fix}"
    where = f"{path}: data file not found{by} in the current directory {os.getcwd()}"
    if os.path.normpath(path).startswith(os.path.join("data", "preprocessed")):
        return (
            f"{where}; DARE's example paths are relative to a DARE checkout: run from the DARE checkout or give "
            "the file's absolute path"
        )
    return f"{where}; {fix} (relative to that directory, or absolute)"


def load_rows(path: str) -> list[tuple[str, dict]]:
    """``(location, record)`` of every record of a .jsonl / .json / .parquet file (one read of the file)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in SUPPORTED_EXTENSIONS:
        raise DataError(
            f"{path}: unsupported data file extension {ext or '(none)'!r}; supported: {', '.join(SUPPORTED_EXTENSIONS)}"
        )
    if not os.path.isfile(path):
        raise DataError(missing_file(path))
    if ext == ".jsonl":
        return _load_jsonl(path)
    if ext == ".json":
        return _load_json(path)
    return [(f"{path}:row {i + 1}", r) for i, r in enumerate(_load_parquet(path))]


def _load_jsonl(path: str) -> list[tuple[str, dict]]:
    records = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(BOM):  # written by Windows tools / Excel: the file is fine
                raw = raw[len(BOM) :]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid UTF-8 ({e.reason})") from e
            if not line.strip():
                continue
            try:
                rec = json.loads(line, object_pairs_hook=_unique_keys)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
            except _DuplicateKey as e:
                raise e.error(f"{path}:{lineno}") from None
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            records.append((f"{path}:{lineno}", rec))
    return records


def _load_json(path: str) -> list[tuple[str, dict]]:
    """A .json file: one JSON array of records (dLLM-RL's data), or JSON lines under a .json name (what
    ``datasets.Dataset.to_json`` writes)."""
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(BOM).lstrip()
    if not head.startswith(b"["):
        return _load_jsonl(path)
    try:
        with open(path, encoding="utf-8-sig") as f:
            records = json.load(f, object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 ({e.reason})") from e
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
    except _DuplicateKey as e:
        raise e.error(path) from None
    rows = [(f"{path}:row {i + 1}", rec) for i, rec in enumerate(records)]
    for where, rec in rows:
        check_record(rec, where)
    return rows


class _DuplicateKey(Exception):
    def error(self, where: str) -> DataError:
        return DataError(
            f"{where}: key {self.args[0]!r} appears twice in one object (JSON readers keep one of them silently); "
            "keep the one you mean"
        )


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's dict; _DuplicateKey naming a key it holds twice (``json`` would keep the last)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def _load_parquet(path: str) -> list[dict]:
    try:
        import pyarrow.parquet as pq  # heavy: pyarrow, for parquet files only
    except ImportError as e:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from e
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise DataError(f"{path}: cannot read parquet file ({e})") from e
    return table.to_pylist()


def as_paths(value: Union[None, str, Sequence[str]], key: str = "data.path") -> list[str]:
    """A path setting as a list of files (one string, or a list of strings); DataError naming ``key`` otherwise."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise DataError(f"{key}={value!r}: give a file or a list of files (e.g. {key}=[math.parquet,gsm8k.parquet])")


RecordSource = Union[str, Sequence[str]]  # a name for all records ("f.jsonl": f.jsonl:1, ...), or one per record


def row_name(source: RecordSource, n: int) -> str:
    """What errors call record ``n`` (1-based): ``source[n - 1]`` when ``source`` names each record (``file:row``,
    as :func:`load_many` gives them), else ``source:n``."""
    return f"{source}:{n}" if isinstance(source, str) else source[n - 1]


def load_many(paths: Union[str, Sequence[str]], key: str = "data.path") -> list[tuple[str, dict]]:
    """``(location, record)`` of every record of every file, in the order given; an empty file is an error."""
    out: list[tuple[str, dict]] = []
    for path in as_paths(paths, key):
        rows = load_rows(path)
        if not rows:
            raise DataError(f"{path}: the file holds no records ({key})")
        out.extend(rows)
    return out
