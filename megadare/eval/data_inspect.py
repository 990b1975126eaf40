"""``megadare data inspect FILE... [--reward NAME] [--model DIR]``: what megadare reads from data files, before a run.

For every file: the schema detected and the fields used (RL prompts, SFT examples, preference pairs; megadare's or
verl / DARE's), the record count, prompt (and response) length percentiles in tokens, one rendered prompt (the chat
template visible), and the reward of each record's gold answer stated as a correct response states it (boxed, in
``<answer>`` tags; :func:`~megadare.rewards.gold_response`) over the first ``--limit`` records. That mean should be
about 1.0; a lower one is the sign of a wrong key or a wrong reward. Records without a checkable gold (a countdown
target, code tests) are not counted. Lengths are in the tokens of ``--model`` (a checkpoint, or a tokenizer directory
such as ``megadare data tokenizer`` writes); without it they are in UTF-8 bytes (:class:`Utf8ByteTokenizer`, any
script), and the report says so. The last line is

    reward of gold answers: <mean> over <n> records (<reward name>)

and the exit status is 1 when any record could not be read, tokenized or scored; each such error names
``file:row`` and the field.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

from megadare.data.fields import MISSING, get_field, is_verl_row, renders_as_verl
from megadare.data.files import DataError, load_rows, missing_file
from megadare.data.preference_data import record_to_preference
from megadare.data.prompt_data import build_prompts, rl_keys
from megadare.data.sft_data import record_to_example, sft_keys
from megadare.data.tokenizer import VOCABULARY_FILES, ByteTokenizer, HFTokenizer, Tokenizer, Utf8ByteTokenizer
from megadare.models import family_of, read_hf_config
from megadare.rewards import RewardSpecError, auto_rule, gold_response, load_reward, score_batch

__all__ = ["inspect_command", "inspect_file", "percentiles", "load_tokenizer"]

PERCENTILES = (50, 90, 99)
MAX_SHOWN_ERRORS = 20


def load_tokenizer(model: Optional[str]) -> Tokenizer:
    """UTF-8 bytes without ``model``; else the HF tokenizer at ``model``: a checkpoint (its family's mask id) or a
    tokenizer directory without config.json (the tokenizer's own mask token)."""
    if not model:
        return Utf8ByteTokenizer()
    if not os.path.isdir(model):
        raise DataError(f"--model {model}: not a directory (a checkpoint or a tokenizer directory)")
    if not any(os.path.isfile(os.path.join(model, f)) for f in VOCABULARY_FILES):  # transformers 5 would build
        # an empty tokenizer of the model type, and every prompt would fail for want of a chat template
        raise DataError(
            f"--model {model}: no tokenizer files (none of {', '.join(VOCABULARY_FILES)}); copy the model's into "
            "it, or leave --model out for lengths in UTF-8 bytes (a tiny model's export, the demo's, has none)"
        )
    mask = None
    if os.path.isfile(os.path.join(model, "config.json")):
        hf = read_hf_config(model)
        mask = family_of(hf).arch(hf).mask_token_id
    try:
        return HFTokenizer(model, mask_token_id=mask)
    except (OSError, ValueError) as e:
        raise DataError(f"--model {model}: its tokenizer does not load: {e}") from e


def tokenizer_line(tok: Tokenizer) -> str:
    """What the lengths count."""
    if isinstance(tok, HFTokenizer):
        return f"lengths: tokens of {tok.path} ({type(tok.tok).__name__}, {tok.vocab_size} ids)"
    return (
        "lengths: UTF-8 bytes, roles as one byte each (no --model given: pass --model DIR, a checkpoint or a "
        "tokenizer directory, for token counts)"
    )


def percentiles(lengths: list[int]) -> str:
    """``p50 a  p90 b  p99 c  max d`` (nearest rank) of token counts."""
    if not lengths:
        return "none"
    s = sorted(lengths)
    parts = [f"p{q} {s[min(len(s) - 1, max(0, -(-q * len(s) // 100) - 1))]}" for q in PERCENTILES]
    return "  ".join(parts + [f"max {s[-1]}"])


def _unit(tok: Tokenizer) -> str:
    return "bytes" if isinstance(tok, Utf8ByteTokenizer) else "tokens"


def _rendered(tok: Tokenizer, ids: list[int]) -> str:
    if isinstance(tok, ByteTokenizer):
        return tok.decode(ids, render_roles=True)
    if isinstance(tok, HFTokenizer):
        return tok.tok.decode([int(i) for i in ids], skip_special_tokens=False)
    return tok.decode(ids)


def _each(rows: list[tuple[str, dict]], build: Callable[[str, dict], object], errors: list[str]) -> list:
    """``build(where, record)`` for every row; a DataError is recorded (it names file:row and the field)."""
    out = []
    for where, rec in rows:
        try:
            out.append(build(where, rec))
        except DataError as e:
            errors.append(str(e))
    return out


def _schema_line(rows: list[tuple[str, dict]], views: list[str]) -> str:
    rec = rows[0][1]
    if "preference" in views:
        dare = isinstance(rec.get("prompt"), list) and isinstance(rec.get("chosen"), list)
        return "preference rows" + (" (verl / DARE: prompt, chosen and rejected as messages)" if dare else "")
    if is_verl_row(rec):
        sources = {}
        for _, r in rows:
            sources[str(r.get("data_source"))] = sources.get(str(r.get("data_source")), 0) + 1
        return "verl / DARE rows; data_source: " + ", ".join(f"{k} {v}" for k, v in sources.items())
    keys = ", ".join(sorted(rec))
    return f"megadare rows; keys {keys}" if views else f"none megadare reads (keys {keys})"


def _views(rec: dict) -> list[str]:
    views = []
    if all(get_field(rec, k) is not MISSING for k in ("prompt", "chosen", "rejected")):
        views.append("preference")
    if all(k is not None for k in rl_keys(rec)):
        views.append("rl")
    if sft_keys(rec) and "preference" not in views:
        views.append("sft")
    return views


QUESTION_KEYS = ("question", "problem", "query", "instruction", "input", "text")  # benchmarks' prompt fields


def _question_hint(rec: dict) -> str:
    """For a row with a benchmark's question field (gsm8k's ``question``, MATH's ``problem``): how to read it."""
    key = next((k for k in QUESTION_KEYS if isinstance(rec.get(k), str)), None)
    if key is None:
        return ""
    return (
        f"; to train on it, name its prompt field: data.prompt_key={key} (megadare eval reads benchmark files "
        "like this as they are, eval.data_dir)"
    )


def _gold_hint(rec: dict) -> str:
    """For a verl / DARE RL row (``data_source`` + ``prompt``) with no gold answer: where the gold goes."""
    if "data_source" not in rec or "prompt" not in rec:
        return ""
    return (
        "; a verl / DARE RL row holds its gold answer in reward_model.ground_truth, which this row lacks: add it "
        "(a run reads another field with rewards.answer_key=FIELD)"
    )


def _assistant_ends(built: list, key: Optional[str]) -> str:
    """How many prompts end with an assistant message: a prefill the response continues, or (verl / DARE rows) a
    turn closed before the generation prompt, as verl renders it."""
    prefills = sum(bool(p.prefill) for p in built)
    closed = sum(
        key is not None and renders_as_verl(p.record, key) and p.record[key][-1]["role"] == "assistant" for p in built
    )
    parts = [f"{prefills} end in an assistant prefill"] if prefills else []
    parts += [f"{closed} end in an assistant turn, closed as verl renders it"] if closed else []
    return f" ({'; '.join(parts)})" if parts else ""


def _gold_scores(prompts: list, reward: str, limit: int, errors: list[str], low: list[str]) -> list[float]:
    """Rewards of the gold answers of the first ``limit`` prompts that have one. Rows without a checkable gold are
    scored on an empty response instead (not counted): their fields must still let the reward compute a value.
    A reward that fails is a record error; a gold scoring below 1 is put in ``low`` (``file:row (gold ...)``)."""
    texts, records, wheres, counted = [], [], [], []
    for p in prompts[:limit]:
        try:
            text = gold_response(auto_rule(p.record) if reward == "auto" else reward, p.record)
        except (KeyError, ValueError) as e:
            errors.append(f"{p.where}: field 'answer' (reward_model.ground_truth) / data_source: {e}")
            continue
        texts.append("" if text is None else text)
        records.append(p.record)
        wheres.append(p.where)
        counted.append(text is not None)
    scores, stats = score_batch(load_reward(reward), texts, records)
    for i, message in sorted(stats.failed.items()):
        errors.append(f"{wheres[i]}: field 'answer': reward {reward!r} could not score the record: {message}")
    kept = [i for i in range(len(scores)) if counted[i] and i not in stats.failed]
    low += [f"{wheres[i]} (gold {texts[i]!r:.60})" for i in kept if scores[i] < 1.0]
    return [scores[i] for i in kept]


def inspect_file(
    path: str, tok: Tokenizer, reward: str, limit: int, out: Callable[[str], None]
) -> tuple[list[float], list[str]]:
    """Print the report of one file; returns (gold-answer rewards, record errors)."""
    rows = load_rows(path)
    errors: list[str] = []
    out(f"== {path}")
    if not rows:
        return [], [f"{path}: the file holds no records"]
    views = _views(rows[0][1])
    out(f"schema: {_schema_line(rows, views)}")
    out(f"records: {len(rows)}")
    if not views:
        return [], [
            f"{rows[0][0]}: no known schema (RL prompt + gold, SFT prompt + response, or prompt + chosen + "
            f"rejected); found keys {sorted(rows[0][1])}{_question_hint(rows[0][1]) or _gold_hint(rows[0][1])}"
        ]
    gold: list[float] = []
    unit = _unit(tok)
    if "preference" in views:
        pairs = _each(rows, lambda w, r: record_to_preference(r, tok, w), errors)
        out("preference pairs: prompt <- prompt, chosen <- chosen, rejected <- rejected")
        out(f"prompt {unit}: {percentiles([len(p.prompt_ids) for p in pairs])}")
        out(f"chosen {unit}: {percentiles([len(p.chosen_ids) for p in pairs])}")
        out(f"rejected {unit}: {percentiles([len(p.rejected_ids) for p in pairs])}")
        if pairs:
            out(f"rendered prompt ({pairs[0].where}):\n{_rendered(tok, pairs[0].prompt_ids)}")
    if "rl" in views:
        pkey, gkey = rl_keys(rows[0][1])
        built = _each(rows, lambda w, r: build_prompts([r], tok, [w])[0], errors)
        out(f"RL prompts: prompt <- {pkey}{_assistant_ends(built, pkey)}, gold <- {gkey}, reward {reward}")
        out(f"prompt {unit}: {percentiles([len(p.prompt_ids) for p in built])}")
        if built:
            out(f"rendered prompt ({built[0].where}):\n{_rendered(tok, built[0].prompt_ids)}")
        low: list[str] = []
        gold = _gold_scores(built, reward, limit, errors, low)
        if low:
            shown = ", ".join(low[:5]) + (f" and {len(low) - 5} more" if len(low) > 5 else "")
            out(
                f"warning: {len(low)} gold answers score below 1 under their own reward {reward!r}, so no response "
                f"to them can either (a wrong key or reward, or a malformed gold?): {shown}"
            )
    if "sft" in views:
        keys = sft_keys(rows[0][1])
        examples = _each(rows, lambda w, r: record_to_example(r, tok, w), errors)
        out(f"SFT examples: {' + '.join(keys[1:]) or keys[0]}")
        out(f"prompt {unit}: {percentiles([len(e.prompt_ids) for e in examples])}")
        out(f"response {unit}: {percentiles([len(e.response_ids) for e in examples])}")
    return gold, errors


def inspect_command(
    paths: list[str],
    reward: str = "auto",
    model: Optional[str] = None,
    limit: int = 100,
    out: Callable[[str], None] = print,
) -> int:
    """The command: a report per file, every record error, then the gold-answer line; 1 on record errors."""
    try:  # an unknown reward fails before any file is read
        load_reward(reward)
    except RewardSpecError as e:
        raise RewardSpecError(f"--reward {reward}: {e}") from None
    for path in paths:  # a missing file is the whole answer, before any report line
        if not os.path.isfile(path):
            raise DataError(missing_file(path))
    tok = load_tokenizer(model)
    out(tokenizer_line(tok))
    scores: list[float] = []
    errors: list[str] = []
    for path in paths:
        file_scores, file_errors = inspect_file(path, tok, reward, limit, out)
        scores += file_scores
        errors += file_errors
    for e in errors[:MAX_SHOWN_ERRORS]:
        out(f"error: {e}")
    if len(errors) > MAX_SHOWN_ERRORS:
        out(f"error: ... and {len(errors) - MAX_SHOWN_ERRORS} more records with errors")
    mean = f"{sum(scores) / len(scores):.3f}" if scores else "n/a"
    out(f"reward of gold answers: {mean} over {len(scores)} records ({reward})")
    return 1 if errors else 0
