"""RL prompt sets: prompt / messages / pre-tokenized records, the tokenizer's chat rendering (as SFT), errors that
name file:line and field, and synthetic train / held-out splits that never overlap."""

from __future__ import annotations

import json

import pytest

from megadare.data.prompt_data import PromptRules, build_prompts, load_rl_prompts, synthetic_split
from megadare.data.sft_data import DataError, load_records
from megadare.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def test_record_shapes_render_like_sft():
    recs = [
        {"prompt": "ab>", "answer": "ba"},
        {"messages": [{"role": "user", "content": "ab>"}], "answer": "ba"},
        {"prompt_ids": [1, 2, 3], "answer": "x", "tests": {"inputs": []}},
    ]
    out = build_prompts(recs, TOK, "mem")
    assert out[0].prompt_ids == TOK.chat_prompt([{"role": "user", "content": "ab>"}]) == out[1].prompt_ids
    assert out[2].prompt_ids == [1, 2, 3] and out[2].record["tests"] == {"inputs": []}


def test_errors_name_file_line_and_field(tmp_path):
    p = tmp_path / "train.jsonl"
    p.write_text(json.dumps({"prompt": "a", "answer": "b"}) + "\n" + json.dumps({"prompt": "c"}) + "\n")
    recs = load_records(str(p))
    with pytest.raises(DataError, match=r"train.jsonl:2: missing field 'answer'.*rewards.answer_key"):
        build_prompts(recs, TOK, str(p))
    with pytest.raises(DataError, match=r"mem:1: .*needs a message before an assistant prefill"):
        build_prompts([{"messages": [{"role": "assistant", "content": "b"}], "answer": "b"}], TOK, "mem")
    with pytest.raises(DataError, match=r"mem:1: no prompt: expected 'prompt', 'messages', 'prompt_ids'.*'question'"):
        build_prompts([{"query": "a", "answer": "b"}], TOK, "mem")
    (read,) = build_prompts([{"question": "a", "answer": "b"}], TOK, "mem")  # dLLM-RL's and gsm8k's prompt field
    assert read.prompt_ids == TOK.chat_prompt([{"role": "user", "content": "a"}])
    with pytest.raises(DataError, match=r"mem:1: field 'prompt' must be a string or a list of"):
        build_prompts([{"prompt": 3, "answer": "b"}], TOK, "mem")
    with pytest.raises(DataError, match=r"mem:1: prompt has 10 tokens, more than 4"):  # role tokens + 7 + NL
        build_prompts([{"prompt": "abcdefg", "answer": "b"}], TOK, "mem", PromptRules(max_prompt_length=4))


@pytest.mark.parametrize("task", ["reverse", "addition"])
def test_synthetic_held_out_split_is_disjoint(task):
    train, held = synthetic_split(task, 500, 50, seed=3)
    assert len(train) == 500 and len(held) == 50
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert synthetic_split(task, 500, 50, seed=3) == (train, held)


def test_noisy_reverse_demonstrations_keep_true_answers():
    train, _ = synthetic_split("reverse", 2000, 50, seed=0, correct_fraction=0.5)
    right = sum(r["response"] == r["answer"] for r in train) / len(train)
    assert 0.45 < right < 0.62  # palindromes are right either way (8 of 512 strings)
    assert all(r["answer"] == r["prompt"][:-1][::-1] for r in train)


def test_load_splits_from_files(tmp_path):
    from megadare.config import load_config

    tr, ev = tmp_path / "t.jsonl", tmp_path / "e.jsonl"
    tr.write_text("".join(json.dumps({"prompt": str(i), "answer": str(i)}) + "\n" for i in range(5)))
    ev.write_text("".join(json.dumps({"prompt": str(i), "answer": str(i)}) + "\n" for i in range(9)))
    cfg = load_config(None, [f"data.path={tr}", f"data.eval_path={ev}", "rl.eval_size=4"])
    train, held = load_rl_prompts(cfg, TOK)
    assert len(train) == 5 and len(held) == 4
    assert train[2].where == f"{tr}:3" and held[0].where == f"{ev}:1" and train[2].record["answer"] == "2"
