"""Prompt datasets for RL and evaluation: records with a prompt (or chat messages) and a gold answer field.

A record is ``{"prompt": "...", "answer": "..."}`` (keys configurable, dotted for nested fields), or
``{"messages": [...], "answer": ...}``, or pre-tokenized ``{"prompt_ids": [...], "answer": ...}``, or a verl / DARE
row ``{"data_source", "prompt": [messages], "reward_model": {"ground_truth"}, "extra_info"}``, recognised with the
default keys (:mod:`.fields`). The prompt is rendered with the tokenizer's chat template (the same rendering SFT
uses, so an SFT model sees the format it was trained on); messages may end with an assistant prefill, which the
response continues and the reward sees in front of it. A verl / DARE row renders as verl renders it, a trailing
assistant message (DARE's MBPP ``[BEGIN]``) closed and the response scored alone, as DARE scores it
(:func:`~megadare.data.fields.renders_as_verl`).

The record handed to the reward is the row itself with the gold copied to ``answer`` (so the built-in rewards
read the configured field); other fields (``tests``, ``data_source``, ``extra_info`` ...) ride along. Every
record keeps its source (``file:row``) for errors.

The generated tasks of ``data.synthetic`` produce a train and a held-out split from one place, so SFT, RL
and evaluation agree on what is held out.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

from megadare.data.fields import (
    GOLD_FALLBACKS,
    MISSING,
    PROMPT_FALLBACKS,
    get_field,
    prompt_messages,
    render_prompt,
    renders_as_verl,
)
from megadare.data.files import DataError, RecordSource, check_record, load_many, row_name
from megadare.data.sft_data import int_list
from megadare.data.synthetic import addition_task, reverse_task
from megadare.data.tokenizer import Tokenizer

__all__ = ["PromptRecord", "PromptRules", "build_prompts", "synthetic_split", "load_rl_prompts", "rl_keys"]


@dataclass
class PromptRecord:
    prompt_ids: list[int]
    record: dict[str, Any]  # the source record with its gold under "answer", handed to the reward function
    where: str = ""  # file:row (or source:N) of the record
    prefill: str = ""  # an assistant prefill ending the prompt: the response continues it

    def reward_text(self, response: str) -> str:
        """What the reward scores: the prefill and the model's continuation."""
        return self.prefill + response


@dataclass(frozen=True)
class PromptRules:
    """How RL prompt rows are read: where a row keeps its prompt, gold answer and chat messages (dotted for nested
    fields) and what happens to a prompt longer than ``max_prompt_length`` tokens (None: no budget): ``overlong``
    'error' raises, 'drop' leaves it out, 'truncate' keeps its last ``max_prompt_length`` tokens (the question's
    end and the generation prompt)."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"
    messages_key: str = "messages"
    max_prompt_length: Optional[int] = None
    overlong: str = "error"

    @classmethod
    def of(cls, data_cfg, reward_cfg, max_prompt_length: Optional[int] = None) -> "PromptRules":
        """The rules of a run: data.prompt_key / data.messages_key / rewards.answer_key, data.overlong, and the prompt
        budget (data.max_length minus rollout.max_new_tokens)."""
        return cls(
            data_cfg.prompt_key, reward_cfg.answer_key, data_cfg.messages_key, max_prompt_length, data_cfg.overlong
        )


def rl_keys(
    rec: dict, prompt_key: str = "prompt", answer_key: str = "answer", messages_key: str = "messages"
) -> tuple[Optional[str], Optional[str]]:
    """(prompt field, gold field) of an RL record: ``prompt_ids`` / ``messages_key`` / ``prompt_key``, and
    ``answer_key``; where a key is the default and the record lacks it, the field other publishers use (verl /
    DARE's ``reward_model.ground_truth``, dLLM-RL's ``question``, ``ground_truth_answer`` and ``test_method``);
    None if absent."""
    prompts = ("prompt_ids", messages_key, prompt_key) + (PROMPT_FALLBACKS if prompt_key == "prompt" else ())
    golds = (answer_key,) + (GOLD_FALLBACKS if answer_key == "answer" else ())
    prompt = next((k for k in prompts if get_field(rec, k) is not MISSING), None)
    gold = next((k for k in golds if get_field(rec, k) is not MISSING), None)
    return prompt, gold


def _prompt_ids(rec: dict, key: str, tok: Tokenizer, where: str) -> tuple[list[int], str]:
    if key == "prompt_ids":
        return int_list(rec, "prompt_ids", where, tok.vocab_size), ""
    msgs = prompt_messages(get_field(rec, key), where, key)
    return render_prompt(tok, msgs, where, key, prefill=not renders_as_verl(rec, key))


def _gold_missing(rec: dict, key: Optional[str]) -> bool:
    if key is None:
        return True
    gold = get_field(rec, key)
    is_nan = isinstance(gold, float) and math.isnan(gold)  # a missing value of a numeric column (pandas, JSON NaN)
    return gold is None or is_nan or (isinstance(gold, str) and not gold.strip())


def build_prompts(
    records: list[dict],
    tok: Tokenizer,
    source: RecordSource,
    rules: PromptRules = PromptRules(),
    *,
    skipped: Optional[list] = None,
    overlong_rows: Optional[list] = None,
) -> list[PromptRecord]:
    """Tokenized prompts read by ``rules`` (:class:`PromptRules`); errors name the record's ``source[i]`` when
    ``source`` is a list (else ``source:N``) and the field. With a ``skipped`` list, records without a gold answer
    (absent, null or empty) are left out and their sources put there instead of raising. Prompts over the budget
    that are dropped or truncated are listed in ``overlong_rows``."""
    prompt_key, answer_key, messages_key = rules.prompt_key, rules.answer_key, rules.messages_key
    max_prompt_length, overlong = rules.max_prompt_length, rules.overlong
    out = []
    for i, rec in enumerate(records):
        where = row_name(source, i + 1)
        check_record(rec, where)
        pkey, gkey = rl_keys(rec, prompt_key, answer_key, messages_key)
        if skipped is not None and _gold_missing(rec, gkey):
            skipped.append(where)
            continue
        if gkey is None:
            raise DataError(
                f"{where}: missing field {answer_key!r} (the reference answer the reward checks; set "
                f"rewards.answer_key if the file calls it differently, dotted for nested fields); found "
                f"keys {sorted(rec)}"
            )
        if pkey is None:
            raise DataError(
                f"{where}: no prompt: expected {prompt_key!r}, {messages_key!r}, 'prompt_ids'"
                f"{''.join(f', {k!r}' for k in PROMPT_FALLBACKS) if prompt_key == 'prompt' else ''} (set "
                f"data.prompt_key to the field holding it); found keys {sorted(rec)}"
            )
        ids, prefill = _prompt_ids(rec, pkey, tok, where)
        if not ids:
            raise DataError(f"{where}: the prompt is empty")
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            if overlong == "error":
                raise DataError(
                    f"{where}: prompt has {len(ids)} tokens, more than {max_prompt_length} (data.max_length "
                    "minus rollout.max_new_tokens); shorten it, raise data.max_length, or set "
                    "data.overlong=truncate (keep its end) or drop"
                )
            if overlong_rows is not None:
                overlong_rows.append(f"{where} ({len(ids)} tokens)")
            if overlong == "drop":
                continue
            ids = ids[-max_prompt_length:]
        gold = get_field(rec, gkey)
        if _gold_missing(rec, gkey):
            raise DataError(
                f"{where}: field {gkey!r} (the reference answer) is {'empty' if isinstance(gold, str) else 'null' if gold is None else 'NaN'}; "
                "drop the row, or set rewards.skip_rows_without_answer=true to leave such rows out"
            )
        out.append(PromptRecord(ids, dict(rec, answer=gold), where, prefill))
    return out


def synthetic_split(
    name: str, size: int, eval_size: int, seed: int, correct_fraction: float = 1.0
) -> tuple[list[dict], list[dict]]:
    """(train records, held-out records) of a generated task; held-out records are always correct."""
    if name == "reverse":
        held = reverse_task(eval_size, seed=seed + 1)
        train = reverse_task(
            size, seed=seed, correct_fraction=correct_fraction, exclude={r["prompt"][:-1] for r in held}
        )
        return train, held
    if name == "addition":
        held = addition_task(eval_size, seed=seed + 1)
        seen = {r["prompt"] for r in held}
        train = [r for r in addition_task(size + eval_size, seed=seed) if r["prompt"] not in seen][:size]
        return train, held
    raise DataError(f"data.synthetic={name!r} unknown; choose addition or reverse")


def _located(data_cfg, eval_size: int, seed: int) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """(train, held-out) ``(source, record)`` pairs from data.path / data.eval_path or a synthetic task."""
    if data_cfg.synthetic:
        train, held = synthetic_split(data_cfg.synthetic, data_cfg.synthetic_size, eval_size, seed)
        name = f"synthetic:{data_cfg.synthetic}"
        return (
            [(f"{name}:{i + 1}", r) for i, r in enumerate(train)],
            [(f"{name} (held-out):{i + 1}", r) for i, r in enumerate(held)],
        )
    if not data_cfg.path:
        raise DataError(
            "no prompts: set data.path (.jsonl / .parquet with prompt + answer fields, or a list of "
            "files) or data.synthetic"
        )
    held = load_many(data_cfg.eval_path, "data.eval_path")[:eval_size] if data_cfg.eval_path else []
    return load_many(data_cfg.path, "data.path"), held


def load_rl_prompts(
    cfg, tok: Tokenizer, max_prompt_length: Optional[int] = None
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(train prompts, held-out prompts) of a run's config (data.path / data.eval_path, a file or a list of files,
    or a synthetic task; rl.eval_size held-out), with the keys data.prompt_key / data.messages_key /
    rewards.answer_key. Prompts longer than ``max_prompt_length`` (data.max_length minus rollout.max_new_tokens)
    follow data.overlong, naming file and row."""
    data_cfg, out = cfg.data, []
    for pairs in _located(data_cfg, cfg.rl.eval_size, cfg.seed):
        skipped: Optional[list] = [] if cfg.rewards.skip_rows_without_answer else None
        overlong: list = []
        out.append(
            build_prompts(
                [r for _, r in pairs],
                tok,
                [w for w, _ in pairs],
                PromptRules.of(data_cfg, cfg.rewards, max_prompt_length),
                skipped=skipped,
                overlong_rows=overlong,
            )
        )
        _report(skipped, "left out {n} rows without a gold answer (rewards.skip_rows_without_answer)")
        verb = "left out" if data_cfg.overlong == "drop" else "kept the last tokens of"
        _report(
            overlong,
            f"{verb} {{n}} prompts longer than {max_prompt_length} tokens (data.max_length minus "
            f"rollout.max_new_tokens; data.overlong={data_cfg.overlong})",
        )
    return out[0], out[1]


def _report(rows: Optional[list], what: str) -> None:
    """One line on rank 0: what happened to how many rows, the first few named."""
    if rows and os.environ.get("RANK", "0") == "0":
        shown = ", ".join(rows[:5]) + (f" and {len(rows) - 5} more" if len(rows) > 5 else "")
        print(f"data: {what.format(n=len(rows))}: {shown}", file=sys.stderr)
