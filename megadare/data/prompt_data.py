"""Prompt datasets for RL and evaluation: records with a prompt (or chat messages) and an answer field.

A record is ``{"prompt": "...", "answer": "..."}`` (keys configurable), or ``{"messages": [...], "answer": ...}``
whose messages end before the assistant turn, or pre-tokenized ``{"prompt_ids": [...], "answer": ...}``. The
prompt is rendered with the tokenizer's chat template (the same rendering SFT uses, so an SFT model sees
the format it was trained on). Other fields (tests for code rewards, ...) ride along to the reward function.

The generated tasks of ``data.synthetic`` produce a train and a held-out split from one place, so SFT, RL
and evaluation agree on what is held out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megadare.data.sft_data import DataError, _check_messages, _int_list, _render_prompt, load_records
from megadare.data.tokenizer import Tokenizer

__all__ = ["PromptRecord", "build_prompts", "synthetic_split", "load_prompt_splits"]


@dataclass
class PromptRecord:
    prompt_ids: list[int]
    record: dict[str, Any]     # the source record (answer, tests, ...), handed to the reward function
    where: str = ""


def build_prompts(records: list[dict], tok: Tokenizer, source: str, prompt_key: str = "prompt",
                  answer_key: str = "answer", messages_key: str = "messages",
                  max_prompt_length: Optional[int] = None) -> list[PromptRecord]:
    """Tokenized prompts; errors name ``source:line`` and the field."""
    out = []
    for i, rec in enumerate(records):
        where = f"{source}:{i + 1}"
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a record object, got {type(rec).__name__}")
        if answer_key not in rec:
            raise DataError(f"{where}: missing field {answer_key!r} (the reference answer the reward checks; set "
                            f"rl.answer_key if the file calls it differently); found keys {sorted(rec)}")
        if "prompt_ids" in rec:
            ids = _int_list(rec, "prompt_ids", where, tok.vocab_size)
        elif messages_key in rec:
            msgs = _check_messages(rec[messages_key], where, messages_key, ends_with_response=False)
            ids = _render_prompt(tok, msgs, where, messages_key)
        elif prompt_key in rec:
            if not isinstance(rec[prompt_key], str):
                raise DataError(f"{where}: field {prompt_key!r} must be a string")
            ids = _render_prompt(tok, [{"role": "user", "content": rec[prompt_key]}], where, prompt_key)
        else:
            raise DataError(f"{where}: no prompt: expected {prompt_key!r}, {messages_key!r} or 'prompt_ids'; found "
                            f"keys {sorted(rec)}")
        if not ids:
            raise DataError(f"{where}: the prompt is empty")
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            raise DataError(f"{where}: prompt has {len(ids)} tokens, more than {max_prompt_length}; shorten it or "
                            "raise data.max_length")
        out.append(PromptRecord(ids, rec, where))
    return out


def synthetic_split(name: str, size: int, eval_size: int, seed: int, correct_fraction: float = 1.0
                    ) -> tuple[list[dict], list[dict]]:
    """(train records, held-out records) of a generated task; held-out records are always correct."""
    from megadare.data.synthetic import addition_task, reverse_task

    if name == "reverse":
        held = reverse_task(eval_size, seed=seed + 1)
        train = reverse_task(size, seed=seed, correct_fraction=correct_fraction,
                             exclude={r["prompt"][:-1] for r in held})
        return train, held
    if name == "addition":
        held = addition_task(eval_size, seed=seed + 1)
        seen = {r["prompt"] for r in held}
        train = [r for r in addition_task(size + eval_size, seed=seed) if r["prompt"] not in seen][:size]
        return train, held
    raise DataError(f"data.synthetic={name!r} unknown; choose addition or reverse")


def load_prompt_splits(data_cfg, rl_cfg, seed: int) -> tuple[list[dict], list[dict], str]:
    """(train records, held-out records, source name) from data.path / data.eval_path or a synthetic task."""
    if data_cfg.synthetic:
        train, held = synthetic_split(data_cfg.synthetic, data_cfg.synthetic_size, rl_cfg.eval_size, seed)
        return train, held, f"synthetic:{data_cfg.synthetic}"
    if not data_cfg.path:
        raise DataError("no prompts: set data.path (.jsonl / .parquet with prompt + answer fields) or data.synthetic")
    train = load_records(data_cfg.path)
    held = load_records(data_cfg.eval_path)[: rl_cfg.eval_size] if data_cfg.eval_path else []
    return train, held, data_cfg.path
