"""Preference records (prompt, chosen, rejected) -> tokenized pairs for offline DPO / VRPO (``megadare dpo``).

Accepted shapes (DARE's ultrafeedback layout, ``verl/utils/preprocess/preprocess_dpo.py``, and plain strings; keys
configurable and dotted for nested fields, :mod:`.fields`):

* ``prompt``: a string (rendered as one user message) or a list of {role, content} messages ending before the
  assistant's turn (rendered with the chat template up to that turn, as DARE's ``dLLMRMDataset`` does);
* ``chosen`` / ``rejected``: a string, or a list holding exactly one assistant message (DARE's form).

Responses end with eos. Every error is a ``DataError`` naming the record's ``file:row`` (or ``source:N``) and the
field.

    examples, stats = load_preference_examples(["ultrafeedback.parquet"], tok, max_len=1024)
    examples[0].prompt_ids, examples[0].chosen_ids, examples[0].rejected_ids, examples[0].where
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

from megadare.data.fields import MISSING, encode_text, get_field, prompt_messages, render_prompt, response_text
from megadare.data.files import DataError, RecordSource, check_record, load_many, row_name
from megadare.data.sft_data import OVERLONG_CHOICES
from megadare.data.tokenizer import Tokenizer

__all__ = ["PreferenceExample", "record_to_preference", "build_preference_examples", "load_preference_examples"]


@dataclass
class PreferenceExample:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    where: str = ""  # file:row of the record

    def __len__(self) -> int:
        return len(self.prompt_ids) + max(len(self.chosen_ids), len(self.rejected_ids))


def _response(rec: dict, tok: Tokenizer, where: str, key: str) -> list[int]:
    value = get_field(rec, key)
    if isinstance(value, list) and not (
        len(value) == 1 and isinstance(value[0], dict) and value[0].get("role") == "assistant"
    ):
        raise DataError(
            f"{where}: field {key!r} must be a string or a list of exactly one assistant message "
            "{role: assistant, content: <text>} (DARE's layout)"
        )
    return encode_text(tok, response_text(value, where, key), where, key) + [tok.eos_token_id]


def record_to_preference(
    rec: dict,
    tok: Tokenizer,
    where: str,
    *,
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
) -> PreferenceExample:
    """Tokenize one preference record; ``where`` prefixes every error."""
    check_record(rec, where)
    missing = [k for k in (prompt_key, chosen_key, rejected_key) if get_field(rec, k) is MISSING]
    if missing:
        raise DataError(
            f"{where}: missing field {' and '.join(repr(k) for k in missing)}; a preference record needs "
            f"{prompt_key!r}, {chosen_key!r} and {rejected_key!r} (dpo.chosen_key / dpo.rejected_key / "
            f"data.prompt_key name them); found keys {sorted(rec)}"
        )
    msgs = prompt_messages(get_field(rec, prompt_key), where, prompt_key)
    if msgs[-1]["role"] == "assistant":
        raise DataError(
            f"{where}: field {prompt_key!r}: a prompt must end before the assistant's turn (the chosen / "
            "rejected responses are that turn); drop the last message"
        )
    prompt_ids, _ = render_prompt(tok, msgs, where, prompt_key)
    return PreferenceExample(
        prompt_ids, _response(rec, tok, where, chosen_key), _response(rec, tok, where, rejected_key), where
    )


def _fit(ex: PreferenceExample, max_len: int, overlong: str, where: str) -> Optional[PreferenceExample]:
    if len(ex) <= max_len:
        return ex
    if overlong == "error":
        raise DataError(
            f"{where}: prompt {len(ex.prompt_ids)} + longest response "
            f"{max(len(ex.chosen_ids), len(ex.rejected_ids))} tokens, longer than max_len={max_len}"
        )
    keep = max_len - len(ex.prompt_ids)
    if overlong == "drop" or keep < 1:
        return None
    return PreferenceExample(ex.prompt_ids, ex.chosen_ids[:keep], ex.rejected_ids[:keep], ex.where)


def build_preference_examples(
    records: Iterable[dict],
    tok: Tokenizer,
    max_len: int,
    overlong: str = "truncate",
    source: RecordSource = "<records>",
    **keys: str,
) -> tuple[list[PreferenceExample], dict]:
    """Tokenized pairs fitted into ``max_len`` (prompt + the longer response): 'truncate' cuts both responses
    (dropping pairs whose prompt fills max_len), 'drop' drops the pair, 'error' raises. Pairs whose chosen and
    rejected responses are identical are refused (no preference). Errors name ``source[i]`` when ``source`` is a
    list (else ``source:N``). Returns the pairs and {'records', 'kept', 'dropped'}."""
    if overlong not in OVERLONG_CHOICES:
        raise ValueError(f"overlong={overlong!r} is not one of {', '.join(OVERLONG_CHOICES)}")
    examples: list[PreferenceExample] = []
    stats = {"records": 0, "kept": 0, "dropped": 0}
    for n, rec in enumerate(records, start=1):
        where = row_name(source, n)
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


def load_preference_examples(
    paths: Union[str, Sequence[str]], tok: Tokenizer, max_len: int, overlong: str = "truncate", **keys: str
) -> tuple[list[PreferenceExample], dict]:
    """:func:`build_preference_examples` over one file or a list of files (.jsonl / .json / .parquet), errors naming
    ``file:row``."""
    located = load_many(paths)
    return build_preference_examples(
        [r for _, r in located], tok, max_len, overlong, source=[w for w, _ in located], **keys
    )
