"""SFT records -> tokenized (prompt, response) examples.

Records come from .jsonl or .parquet files and take one of these shapes (keys configurable, dotted for nested
fields; :mod:`.fields`):

* chat: ``{"messages": [{"role": ..., "content": ...}, ..., {"role": "assistant", "content": ...}]}``; the last
  message is the response, everything before it the prompt (rendered with ``tok.chat_prompt``);
* pair: ``{"prompt": ..., "response": ...}``; the prompt is text (one user message) or a list of messages, the
  response text or one assistant message;
* DARE's SFT schema (verl): when the pair keys are the defaults and absent, ``extra_info.question`` and
  ``extra_info.answer`` (the fields DARE's SFT recipes read: ``data.prompt_key=extra_info``,
  ``data.prompt_dict_keys=['question']``, ...);
* pre-tokenized ``prompt_ids`` + ``response_ids`` (+ ``steps`` for trace SFT).

Every error is a ``DataError`` naming where it happened (``file:line`` / ``file:row N``) and the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from megadare.data.fields import (
    DARE_SFT_PROMPT,
    DARE_SFT_RESPONSE,
    MISSING,
    check_messages,
    encode_text,
    get_field,
    prompt_messages,
    render_prompt,
    response_text,
)
from megadare.data.files import DataError, RecordSource, check_record, load_records, row_name
from megadare.data.tokenizer import Tokenizer

__all__ = [
    "DataError",
    "SFTExample",
    "load_records",
    "record_to_example",
    "build_sft_examples",
    "sft_keys",
    "int_list",
    "OVERLONG_CHOICES",
]

OVERLONG_CHOICES = ("truncate", "drop", "error")


@dataclass
class SFTExample:
    """One tokenized example; ``response_ids`` end with eos unless the example was truncated."""

    prompt_ids: list[int]
    response_ids: list[int]
    steps: Optional[list[int]] = None  # trace SFT: denoising step at which each response token was committed

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


# ------------------------------------------------------------------------------------------- conversion


def _response_ids(tok: Tokenizer, text: str, where: str, field: str) -> list[int]:
    if not text.strip():
        raise DataError(f"{where}: field {field!r}: the response is empty")
    return encode_text(tok, text, where, field) + [tok.eos_token_id]


def sft_keys(
    rec: dict, prompt_key: str = "prompt", response_key: str = "response", messages_key: str = "messages"
) -> tuple[str, ...]:
    """The fields an SFT record is read from: ``("pretokenized",)``, ``("chat", messages)`` or ``("pair", prompt,
    response)`` (DARE's ``extra_info.question`` / ``extra_info.answer`` when the default pair keys are absent);
    an empty tuple when none fits."""
    if "prompt_ids" in rec or "response_ids" in rec:
        return ("pretokenized",)
    if get_field(rec, messages_key) is not MISSING:
        return ("chat", messages_key)
    if get_field(rec, prompt_key) is not MISSING and get_field(rec, response_key) is not MISSING:
        return ("pair", prompt_key, response_key)
    if (
        (prompt_key, response_key) == ("prompt", "response")
        and get_field(rec, DARE_SFT_PROMPT) is not MISSING
        and get_field(rec, DARE_SFT_RESPONSE) is not MISSING
    ):
        return ("pair", DARE_SFT_PROMPT, DARE_SFT_RESPONSE)
    return ()


def record_to_example(
    rec: dict,
    tok: Tokenizer,
    where: str,
    *,
    prompt_key: str = "prompt",
    response_key: str = "response",
    messages_key: str = "messages",
) -> SFTExample:
    """Tokenize one record (chat, pair, DARE or pre-tokenized shape); ``where`` prefixes every error message.

    A pre-tokenized record -- ``prompt_ids`` + ``response_ids`` (lists of ints), as rollouts record them -- may
    carry ``steps`` (one committed-at denoising step per response token) for trace SFT.
    """
    check_record(rec, where)
    keys = sft_keys(rec, prompt_key, response_key, messages_key)
    if not keys:
        missing = [k for k in (prompt_key, response_key) if get_field(rec, k) is MISSING]
        raise DataError(
            f"{where}: missing field {' and '.join(repr(k) for k in missing)}; expected either {messages_key!r} "
            f"(chat format), {prompt_key!r} + {response_key!r} (pair format) or DARE's {DARE_SFT_PROMPT!r} + "
            f"{DARE_SFT_RESPONSE!r}; found keys {sorted(rec)}"
        )
    if keys[0] == "pretokenized":
        return _pretokenized(rec, tok, where)
    if keys[0] == "chat":
        msgs = check_messages(get_field(rec, messages_key), where, messages_key, ends_with_response=True)
        prompt, _ = render_prompt(tok, msgs[:-1], where, messages_key)
        return SFTExample(prompt, _response_ids(tok, msgs[-1]["content"], where, f"{messages_key}[-1].content"))
    _, pkey, rkey = keys
    prompt, _ = render_prompt(tok, prompt_messages(get_field(rec, pkey), where, pkey), where, pkey)
    return SFTExample(prompt, _response_ids(tok, response_text(get_field(rec, rkey), where, rkey), where, rkey))


def int_list(rec: dict, key: str, where: str, vocab: Optional[int] = None) -> list[int]:
    v = rec.get(key)
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise DataError(f"{where}: field {key!r} must be a list of integers")
    if vocab is not None and any(x < 0 or x >= vocab for x in v):
        raise DataError(f"{where}: field {key!r} holds token ids outside [0, {vocab})")
    return v


def _pretokenized(rec: dict, tok: Tokenizer, where: str) -> SFTExample:
    for key in ("prompt_ids", "response_ids"):
        if key not in rec:
            raise DataError(
                f"{where}: a pre-tokenized record needs both 'prompt_ids' and 'response_ids' (missing {key!r})"
            )
    prompt = int_list(rec, "prompt_ids", where, tok.vocab_size)
    response = int_list(rec, "response_ids", where, tok.vocab_size)
    if not response:
        raise DataError(f"{where}: field 'response_ids': the response is empty")
    steps = None
    if "steps" in rec:
        steps = int_list(rec, "steps", where)
        if len(steps) != len(response):
            raise DataError(
                f"{where}: field 'steps' has {len(steps)} entries for {len(response)} response tokens; "
                "a trace needs exactly one committed-at step per response token"
            )
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
    source: RecordSource = "<records>",
    **keys: str,
) -> tuple[list[SFTExample], dict]:
    """Tokenize ``records`` and fit them into ``max_len`` tokens.

    ``overlong``: 'truncate' cuts the response (keeping at least one token; a truncated response loses its
    eos, since the text did not end there) and drops examples whose prompt alone fills ``max_len``; 'drop'
    drops every overlong example; 'error' raises DataError. Errors name ``source[i]`` when ``source`` is a list (a
    record's ``file:row``, :func:`~megadare.data.files.load_many`) or else ``source:N`` with N the 1-based record
    index. ``keys`` are ``prompt_key``,
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
        where = row_name(source, n)
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


PAD_RESPONSE = ("none", "eos", "pad")


def pad_responses(examples: list[SFTExample], pad: str, tok: Tokenizer, max_len: int) -> list[SFTExample]:
    """Every response padded to ``max_len`` prompt + response tokens with eos or the pad id, trained on as answer
    tokens (``sft.pad_response``): what DARE's SFT datasets do (verl/utils/dataset/llada_sft_dataset.py pads with
    eos, sdar_sft_dataset.py with the pad id, both counted as answer tokens; LLaDA's paper pads with eos so that the
    model learns to fill a fixed-length canvas). ``none`` leaves the examples as they are."""
    if pad not in PAD_RESPONSE:
        raise ValueError(f"sft.pad_response={pad!r} is not one of {', '.join(PAD_RESPONSE)}")
    if pad == "none":
        return examples
    pad_id = tok.eos_token_id if pad == "eos" else tok.pad_token_id
    return [SFTExample(ex.prompt_ids, ex.response_ids + [pad_id] * (max_len - len(ex)), ex.steps) for ex in examples]
