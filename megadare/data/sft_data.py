"""SFT records -> tokenized (prompt, response) examples.

Records come from .jsonl or .parquet files and take one of two shapes:

* chat: ``{"messages": [{"role": ..., "content": ...}, ..., {"role": "assistant", "content": ...}]}``; the last
  message is the response, everything before it the prompt (rendered with ``tok.chat_prompt``);
* pair: ``{"prompt": ..., "response": ...}``; the prompt is rendered as a single user message.

Every error is a ``DataError`` naming where it happened (``file:line`` or ``source:record``) and the field.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional, Any, Iterable

from megadare.data.tokenizer import Tokenizer

__all__ = ["DataError", "SFTExample", "load_records", "record_to_example", "build_sft_examples", "OVERLONG_CHOICES"]

SUPPORTED_EXTENSIONS = (".jsonl", ".parquet")
OVERLONG_CHOICES = ("truncate", "drop", "error")


class DataError(ValueError):
    """A data file or record that cannot be used; the message says where and why."""


@dataclass
class SFTExample:
    """One tokenized example; ``response_ids`` end with eos unless the example was truncated."""

    prompt_ids: list[int]
    response_ids: list[int]
    steps: Optional[list[int]] = None   # trace SFT: denoising step at which each response token was committed

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


# ----------------------------------------------------------------------------------------------- loading


def load_records(path: str) -> list[dict]:
    """All records of a .jsonl or .parquet file, as dicts."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in SUPPORTED_EXTENSIONS:
        raise DataError(
            f"{path}: unsupported data file extension {ext or '(none)'!r}; supported: {', '.join(SUPPORTED_EXTENSIONS)}"
        )
    if not os.path.isfile(path):
        raise DataError(f"{path}: data file not found")
    return _load_jsonl(path) if ext == ".jsonl" else _load_parquet(path)


def _load_jsonl(path: str) -> list[dict]:
    records = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid UTF-8 ({e.reason})") from e
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            records.append(rec)
    return records


def _load_parquet(path: str) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from e
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise DataError(f"{path}: cannot read parquet file ({e})") from e
    return table.to_pylist()


# ------------------------------------------------------------------------------------------- conversion


def _text_field(rec: dict, key: str, where: str) -> str:
    value = rec[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def _encode(tok: Tokenizer, text: str, where: str, field: str) -> list[int]:
    try:
        return list(tok.encode(text))
    except ValueError as e:
        raise DataError(f"{where}: field {field!r}: {e}") from e


def _render_prompt(tok: Tokenizer, messages: list[dict], where: str, field: str) -> list[int]:
    try:
        return list(tok.chat_prompt(messages))
    except ValueError as e:
        raise DataError(f"{where}: field {field!r}: {e}") from e


def _check_messages(msgs: Any, where: str, key: str, ends_with_response: bool = True) -> list[dict]:
    """A well-formed conversation; SFT records end with the assistant's response, RL prompts before it."""
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: field {key!r} must be a non-empty list of {{role, content}} messages")
    for n, msg in enumerate(msgs):
        if not isinstance(msg, dict):
            raise DataError(f"{where}: field {key!r}[{n}] must be an object with 'role' and 'content'")
        for part in ("role", "content"):
            if part not in msg:
                raise DataError(f"{where}: field {key!r}[{n}] is missing {part!r}")
            if not isinstance(msg[part], str):
                raise DataError(f"{where}: field {key!r}[{n}].{part} must be a string")
    last = msgs[-1]["role"]
    if not ends_with_response:
        if last == "assistant":
            raise DataError(f"{where}: field {key!r}: a prompt must end before the assistant's turn (the model "
                            "writes it); drop the last message")
        return msgs
    if last != "assistant":
        raise DataError(
            f"{where}: field {key!r}: the last message must have role 'assistant' (the response), got {last!r}"
        )
    if len(msgs) < 2:
        raise DataError(f"{where}: field {key!r}: needs at least one message before the assistant response")
    return msgs


def _response_ids(tok: Tokenizer, text: str, where: str, field: str) -> list[int]:
    if not text.strip():
        raise DataError(f"{where}: field {field!r}: the response is empty")
    return _encode(tok, text, where, field) + [tok.eos_token_id]


def record_to_example(
    rec: dict,
    tok: Tokenizer,
    where: str,
    *,
    prompt_key: str = "prompt",
    response_key: str = "response",
    messages_key: str = "messages",
) -> SFTExample:
    """Tokenize one record (chat or prompt/response shape); ``where`` prefixes every error message.

    A record may also be pre-tokenized -- ``prompt_ids`` + ``response_ids`` (lists of ints), as rollouts
    record them -- and carry ``steps`` (one committed-at denoising step per response token) for trace SFT.
    """
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a record object, got {type(rec).__name__}")
    if "prompt_ids" in rec or "response_ids" in rec:
        return _pretokenized(rec, tok, where)
    if messages_key in rec:
        msgs = _check_messages(rec[messages_key], where, messages_key)
        prompt = _render_prompt(tok, msgs[:-1], where, messages_key)
        return SFTExample(prompt, _response_ids(tok, msgs[-1]["content"], where, f"{messages_key}[-1].content"))
    has_p, has_r = prompt_key in rec, response_key in rec
    if not (has_p and has_r):
        missing = [k for k, has in ((prompt_key, has_p), (response_key, has_r)) if not has]
        raise DataError(
            f"{where}: missing field {' and '.join(repr(k) for k in missing)}; expected either {messages_key!r} "
            f"(chat format) or {prompt_key!r} + {response_key!r} (pair format); found keys {sorted(rec)}"
        )
    prompt_text = _text_field(rec, prompt_key, where)
    response_text = _text_field(rec, response_key, where)
    prompt = _render_prompt(tok, [{"role": "user", "content": prompt_text}], where, prompt_key)
    return SFTExample(prompt, _response_ids(tok, response_text, where, response_key))


def _int_list(rec: dict, key: str, where: str, vocab: Optional[int] = None) -> list[int]:
    v = rec.get(key)
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise DataError(f"{where}: field {key!r} must be a list of integers")
    if vocab is not None and any(x < 0 or x >= vocab for x in v):
        raise DataError(f"{where}: field {key!r} holds token ids outside [0, {vocab})")
    return v


def _pretokenized(rec: dict, tok: Tokenizer, where: str) -> SFTExample:
    for key in ("prompt_ids", "response_ids"):
        if key not in rec:
            raise DataError(f"{where}: a pre-tokenized record needs both 'prompt_ids' and 'response_ids' "
                            f"(missing {key!r})")
    prompt = _int_list(rec, "prompt_ids", where, tok.vocab_size)
    response = _int_list(rec, "response_ids", where, tok.vocab_size)
    if not response:
        raise DataError(f"{where}: field 'response_ids': the response is empty")
    steps = None
    if "steps" in rec:
        steps = _int_list(rec, "steps", where)
        if len(steps) != len(response):
            raise DataError(f"{where}: field 'steps' has {len(steps)} entries for {len(response)} response tokens; "
                            "a trace needs exactly one committed-at step per response token")
        if any(x < 0 for x in steps):
            raise DataError(f"{where}: field 'steps' holds negative steps")
    return SFTExample(prompt, response, steps)


def _fit(ex: SFTExample, max_len: int, overlong: str, where: str) -> tuple[SFTExample | None, str]:
    """(example or None, outcome) with outcome one of 'kept', 'truncated', 'dropped'."""
    if len(ex) <= max_len:
        return ex, "kept"
    if overlong == "error":
        raise DataError(
            f"{where}: example is {len(ex)} tokens (prompt {len(ex.prompt_ids)} + response "
            f"{len(ex.response_ids)}), longer than max_len={max_len}"
        )
    if overlong == "drop" or len(ex.prompt_ids) >= max_len:
        return None, "dropped"
    keep = max_len - len(ex.prompt_ids)
    steps = ex.steps[:keep] if ex.steps is not None else None
    return SFTExample(ex.prompt_ids, ex.response_ids[:keep], steps), "truncated"


def build_sft_examples(
    records: Iterable[dict],
    tok: Tokenizer,
    max_len: int,
    overlong: str = "truncate",
    source: str = "<records>",
    **keys: str,
) -> tuple[list[SFTExample], dict]:
    """Tokenize ``records`` and fit them into ``max_len`` tokens.

    ``overlong``: 'truncate' cuts the response (keeping at least one token; a truncated response loses its
    eos, since the text did not end there) and drops examples whose prompt alone fills ``max_len``; 'drop'
    drops every overlong example; 'error' raises DataError. Errors name ``source:N`` with N the 1-based record
    index (the line number for a .jsonl file without blank lines). ``keys`` are ``prompt_key``,
    ``response_key``, ``messages_key`` for ``record_to_example``. Returns the examples and stats
    ``{'records', 'kept', 'truncated', 'dropped'}`` ('kept' counts every returned example, truncated or not).
    """
    if overlong not in OVERLONG_CHOICES:
        raise ValueError(f"overlong={overlong!r} is not one of {', '.join(OVERLONG_CHOICES)}")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len={max_len!r} must be an integer >= 2")
    unknown = set(keys) - {"prompt_key", "response_key", "messages_key"}
    if unknown:
        raise TypeError(f"build_sft_examples: unknown keyword(s) {', '.join(sorted(unknown))}")
    examples: list[SFTExample] = []
    stats = {"records": 0, "kept": 0, "truncated": 0, "dropped": 0}
    for n, rec in enumerate(records, start=1):
        where = f"{source}:{n}"
        stats["records"] += 1
        ex, outcome = _fit(record_to_example(rec, tok, where, **keys), max_len, overlong, where)
        if ex is None:
            stats["dropped"] += 1
            continue
        examples.append(ex)
        stats["kept"] += 1
        if outcome == "truncated":
            stats["truncated"] += 1
    return examples, stats
