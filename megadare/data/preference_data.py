"""Preference records (prompt, chosen, rejected) -> tokenized pairs for offline DPO / VRPO (``megadare dpo``).

Accepted shapes (DARE's ultrafeedback layout, ``verl/utils/preprocess/preprocess_dpo.py``, and plain strings):

* ``prompt``: a string (rendered as one user message) or a list of {role, content} messages ending before the
  assistant's turn (rendered with ``tok.chat_prompt``);
* ``chosen`` / ``rejected``: a string, or a list holding exactly one assistant message (DARE's form).

Responses end with eos. Every error is a ``DataError`` naming ``source:record`` and the field.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

from megadare.data.sft_data import (OVERLONG_CHOICES, DataError, _check_messages, _render_prompt, _response_ids,
                                    _text_field)
from megadare.data.tokenizer import Tokenizer

__all__ = ["PreferenceExample", "record_to_preference", "build_preference_examples"]


@dataclass
class PreferenceExample:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]

    def __len__(self) -> int:
        return len(self.prompt_ids) + max(len(self.chosen_ids), len(self.rejected_ids))


def _prompt(rec: dict, tok: Tokenizer, where: str, key: str) -> list[int]:
    value = rec[key]
    if isinstance(value, str):
        return _render_prompt(tok, [{"role": "user", "content": value}], where, key)
    return _render_prompt(tok, _check_messages(value, where, key, ends_with_response=False), where, key)


def _response(rec: dict, tok: Tokenizer, where: str, key: str) -> list[int]:
    value: Any = rec[key]
    if isinstance(value, list):
        msg = value[0] if len(value) == 1 and isinstance(value[0], dict) else {}
        if msg.get("role") != "assistant" or not isinstance(msg.get("content"), str):
            raise DataError(f"{where}: field {key!r} must be a string or a list of exactly one assistant message "
                            "{role: assistant, content: <text>} (DARE's layout)")
        return _response_ids(tok, msg["content"], where, f"{key}[0].content")
    return _response_ids(tok, _text_field(rec, key, where), where, key)


def record_to_preference(rec: dict, tok: Tokenizer, where: str, *, prompt_key: str = "prompt",
                         chosen_key: str = "chosen", rejected_key: str = "rejected") -> PreferenceExample:
    """Tokenize one preference record; ``where`` prefixes every error."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a record object, got {type(rec).__name__}")
    missing = [k for k in (prompt_key, chosen_key, rejected_key) if k not in rec]
    if missing:
        raise DataError(f"{where}: missing field {' and '.join(repr(k) for k in missing)}; a preference record needs "
                        f"{prompt_key!r}, {chosen_key!r} and {rejected_key!r} (dpo.chosen_key / dpo.rejected_key / "
                        f"data.prompt_key name them); found keys {sorted(rec)}")
    return PreferenceExample(_prompt(rec, tok, where, prompt_key), _response(rec, tok, where, chosen_key),
                             _response(rec, tok, where, rejected_key))


def _fit(ex: PreferenceExample, max_len: int, overlong: str, where: str) -> Optional[PreferenceExample]:
    if len(ex) <= max_len:
        return ex
    if overlong == "error":
        raise DataError(f"{where}: prompt {len(ex.prompt_ids)} + longest response "
                        f"{max(len(ex.chosen_ids), len(ex.rejected_ids))} tokens, longer than max_len={max_len}")
    keep = max_len - len(ex.prompt_ids)
    if overlong == "drop" or keep < 1:
        return None
    return PreferenceExample(ex.prompt_ids, ex.chosen_ids[:keep], ex.rejected_ids[:keep])


def build_preference_examples(records: Iterable[dict], tok: Tokenizer, max_len: int, overlong: str = "truncate",
                              source: str = "<records>", **keys: str) -> tuple[list[PreferenceExample], dict]:
    """Tokenized pairs fitted into ``max_len`` (prompt + the longer response): 'truncate' cuts both responses
    (dropping pairs whose prompt fills max_len), 'drop' drops the pair, 'error' raises. Pairs whose chosen and
    rejected responses are identical are refused (no preference). Returns the pairs and {'records', 'kept',
    'dropped'}."""
    if overlong not in OVERLONG_CHOICES:
        raise ValueError(f"overlong={overlong!r} is not one of {', '.join(OVERLONG_CHOICES)}")
    examples: list[PreferenceExample] = []
    stats = {"records": 0, "kept": 0, "dropped": 0}
    for n, rec in enumerate(records, start=1):
        where = f"{source}:{n}"
        stats["records"] += 1
        ex = _fit(record_to_preference(rec, tok, where, **keys), max_len, overlong, where)
        if ex is None:
            stats["dropped"] += 1
            continue
        if ex.chosen_ids == ex.rejected_ids:
            raise DataError(f"{where}: the chosen and rejected responses are identical (no preference to learn)")
        examples.append(ex)
        stats["kept"] += 1
    return examples, stats
