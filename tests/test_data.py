"""SFT data: tokenizers, record loading and tokenization, overlong handling, synthetic tasks."""

from __future__ import annotations

import json

import pytest

from megadare.data import (
    ByteTokenizer,
    DataError,
    HFTokenizer,
    SFTExample,
    Tokenizer,
    addition_task,
    build_sft_examples,
    exact_match,
    load_records,
    record_to_example,
)
from megadare.eval.files import write_jsonl_atomic

TOK = ByteTokenizer()
NL = ord("\n")


def _pair_prompt(text: str) -> list[int]:
    return [250, *map(ord, text), NL, 251]


# ------------------------------------------------------------------------------------------ tokenizer


def test_byte_tokenizer_round_trip():
    text = "Hello, world! 12+7=19\n\t~"
    ids = TOK.encode(text)
    assert ids == [ord(c) for c in text]
    assert TOK.decode(ids) == text
    assert isinstance(TOK, Tokenizer)
    assert (TOK.vocab_size, TOK.eos_token_id, TOK.pad_token_id, TOK.mask_token_id) == (256, 253, 254, 255)


def test_byte_tokenizer_rejects_non_ascii():
    with pytest.raises(ValueError, match="'é'"):
        TOK.encode("café")


def test_byte_tokenizer_decode_specials():
    ids = [250, ord("a"), 251, ord("b"), 253, 254, 255, 252]
    assert TOK.decode(ids) == "ab"
    assert TOK.decode(ids, render_roles=True) == "<|user|>a<|assistant|>b<|system|>"
    # unused ids (a model may sample them) render as U+FFFD; ids outside the vocabulary are errors
    assert TOK.decode([ord("a"), 200, ord("b")]) == "a\ufffdb"
    with pytest.raises(ValueError, match="300"):
        TOK.decode([300])


def test_chat_prompt_layout():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert TOK.chat_prompt(msgs) == [252, ord("S"), NL, 250, ord("h"), ord("i"), NL, 251]
    assert TOK.chat_prompt([]) == [251]
    with pytest.raises(ValueError, match="'robot'"):
        TOK.chat_prompt([{"role": "robot", "content": "x"}])


def _save_hf_tokenizer(path, chat_template):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<unk>": 0, "<eos>": 1, "<mask>": 2, "hello": 3, "world": 4, "user": 5, "assistant": 6, ":": 7}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))


def test_hf_tokenizer(tmp_path):
    template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
    _save_hf_tokenizer(tmp_path / "with", template)
    tok = HFTokenizer(str(tmp_path / "with"), mask_token_id=2)
    assert (tok.eos_token_id, tok.pad_token_id, tok.mask_token_id, tok.vocab_size) == (1, 1, 2, 8)
    assert tok.encode("hello world") == [3, 4]
    assert tok.decode([3, 1, 4]) == "hello world"
    assert tok.chat_prompt([{"role": "user", "content": "hello"}]) == [5, 7, 3, 6, 7]

    _save_hf_tokenizer(tmp_path / "without", None)
    bare = HFTokenizer(str(tmp_path / "without"), mask_token_id=2)
    with pytest.raises(ValueError, match="no chat template"):
        bare.chat_prompt([{"role": "user", "content": "hello"}])


# -------------------------------------------------------------------------------------------- loading


RECORDS = [
    {"prompt": "1+1=", "response": "2"},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
]


def test_load_jsonl(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n\n   \n" + json.dumps(RECORDS[1]) + "\n")
    assert load_records(str(path)) == RECORDS


def test_load_rows_names_each_records_line(tmp_path):
    """Locations are the lines the records were read from: blank lines count (a no-break space too, blank to
    str.strip though not to bytes.strip), parquet rows are numbered from 1."""
    from megadare.data.files import load_rows

    path = tmp_path / "data.jsonl"
    path.write_text('{"a": 1}\n\u00a0\n\n{"a": 2}\n', encoding="utf-8")
    assert load_rows(str(path)) == [(f"{path}:1", {"a": 1}), (f"{path}:4", {"a": 2})]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"a": 1}, {"a": 2}]), str(tmp_path / "d.parquet"))
    assert [w for w, _ in load_rows(str(tmp_path / "d.parquet"))] == [
        f"{tmp_path}/d.parquet:row 1",
        f"{tmp_path}/d.parquet:row 2",
    ]


def test_load_json_array_and_json_lines_named_json(tmp_path):
    """dLLM-RL ships its data as .json arrays of records ('unsupported extension' before); datasets' to_json
    writes JSON lines under a .json name. Both read, each record named by its place; bad files fail in one line."""
    from megadare.data.files import load_rows

    arr = tmp_path / "dllm_rl.json"
    arr.write_text("\ufeff" + json.dumps(RECORDS, indent=2), encoding="utf-8")
    assert load_rows(str(arr)) == [(f"{arr}:row 1", RECORDS[0]), (f"{arr}:row 2", RECORDS[1])]
    lines = tmp_path / "hf.json"
    lines.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps(RECORDS[1]) + "\n")
    assert load_rows(str(lines)) == [(f"{lines}:1", RECORDS[0]), (f"{lines}:2", RECORDS[1])]
    bad = {"broken": '[{"a": 1},\n {"a": oops}]', "twice": '[{"a": 1, "a": 2}]', "scalar": '[{"a": 1}, 3]'}
    expected = {"broken": r"broken\.json: invalid JSON .* line 2", "twice": "key 'a' appears twice",
                "scalar": r"scalar\.json:row 2: expected a record object, got int"}  # fmt: skip
    for name, text in bad.items():
        (tmp_path / f"{name}.json").write_text(text)
        with pytest.raises(DataError, match=expected[name]):
            load_rows(str(tmp_path / f"{name}.json"))


def test_load_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "data.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}]), str(path)
    )
    assert load_records(str(path)) == [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}]


def test_load_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": oops}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3: invalid JSON"):
        load_records(str(bad))
    arr = tmp_path / "arr.jsonl"
    arr.write_text("[1, 2]\n")
    with pytest.raises(DataError, match=r"arr\.jsonl:1: expected a JSON object"):
        load_records(str(arr))
    with pytest.raises(DataError, match=r"data\.csv.*\.jsonl, \.json, \.parquet"):
        load_records(str(tmp_path / "data.csv"))
    with pytest.raises(DataError, match=r"missing\.jsonl: data file not found"):
        load_records(str(tmp_path / "missing.jsonl"))
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"not parquet")
    pytest.importorskip("pyarrow")
    with pytest.raises(DataError, match=r"corrupt\.parquet"):
        load_records(str(corrupt))


# ----------------------------------------------------------------------------------------- conversion


def test_record_to_example_pair_and_chat():
    ex = record_to_example(RECORDS[0], TOK, "d.jsonl:1")
    assert ex == SFTExample(_pair_prompt("1+1="), [ord("2"), 253])
    ex = record_to_example(RECORDS[1], TOK, "d.jsonl:2")
    assert ex == SFTExample([250, ord("h"), ord("i"), NL, 251], [ord("y"), ord("o"), 253])
    custom = record_to_example({"q": "a", "a": "b"}, TOK, "x", prompt_key="q", response_key="a")
    assert custom == SFTExample(_pair_prompt("a"), [ord("b"), 253])
    chat = record_to_example({"conv": RECORDS[1]["messages"]}, TOK, "x", messages_key="conv")
    assert chat.response_ids == [ord("y"), ord("o"), 253]


def _msgs(*pairs):
    return {"messages": [{"role": r, "content": c} for r, c in pairs]}


BAD_RECORDS = [
    ({"prompt": "a"}, ["'response'", "'messages'", "'prompt' + 'response'"]),
    ({"response": "a"}, ["missing field 'prompt'"]),
    ({"text": "a"}, ["missing field 'prompt' and 'response'", "'messages' (chat format)"]),
    ({"prompt": "a", "response": "  \n"}, ["'response'", "empty"]),
    ({"prompt": 3, "response": "a"}, ["'prompt' must be a string"]),
    ({"prompt": "é", "response": "a"}, ["'prompt'", "'é'"]),
    ({"prompt": "a", "response": "é"}, ["'response'", "'é'"]),
    (_msgs(("user", "a"), ("user", "b")), ["'messages'", "last message", "'assistant'"]),
    (_msgs(("user", "a"), ("assistant", " ")), ["'messages[-1].content'", "empty"]),
    (_msgs(("assistant", "a")), ["'messages'", "at least one message before"]),
    ({"messages": [{"content": "a"}, {"role": "assistant", "content": "b"}]}, ["'messages'[0]", "'role'"]),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "b"}]}, ["'messages'[0]", "'content'"]),
    ({"messages": []}, ["'messages'", "non-empty list"]),
    (_msgs(("robot", "a"), ("assistant", "b")), ["'messages'", "'robot'"]),
]


@pytest.mark.parametrize("rec,fragments", BAD_RECORDS)
def test_record_errors(rec, fragments):
    with pytest.raises(DataError) as err:
        record_to_example(rec, TOK, "data.jsonl:17")
    msg = str(err.value)
    assert msg.startswith("data.jsonl:17: ")
    for frag in fragments:
        assert frag in msg


# -------------------------------------------------------------------------------------------- overlong

# lengths: prompt "hi" -> 5 + response "hello" -> 6 = 11; prompt of 10 chars -> 13; "a"/"b" -> 4 + 2 = 6
OVERLONG = [
    {"prompt": "hi", "response": "hello"},
    {"prompt": "0123456789", "response": "x"},
    {"prompt": "a", "response": "b"},
    {"prompt": "abcd", "response": "xyz"},  # 7 + 4 = 11, prompt 7 = max_len - 1
    {"prompt": "abcde", "response": "xyz"},  # prompt 8 = max_len
]


def test_overlong_truncate():
    exs, stats = build_sft_examples(OVERLONG, TOK, max_len=8)
    assert stats == {"records": 5, "kept": 3, "truncated": 2, "dropped": 2}
    assert [len(e) for e in exs] == [8, 6, 8]
    assert exs[0] == SFTExample(_pair_prompt("hi"), [ord("h"), ord("e"), ord("l")])
    assert exs[1].response_ids == [ord("b"), 253]
    assert exs[2] == SFTExample(_pair_prompt("abcd"), [ord("x")])


def test_overlong_drop():
    exs, stats = build_sft_examples(OVERLONG, TOK, max_len=8, overlong="drop")
    assert stats == {"records": 5, "kept": 1, "truncated": 0, "dropped": 4}
    assert exs == [SFTExample(_pair_prompt("a"), [ord("b"), 253])]
    exs, stats = build_sft_examples(OVERLONG, TOK, max_len=15, overlong="drop")
    assert stats == {"records": 5, "kept": 5, "truncated": 0, "dropped": 0}
    assert [len(e) for e in exs] == [11, 15, 6, 11, 12]


def test_overlong_error():
    with pytest.raises(DataError, match=r"train\.jsonl:1: example is 11 tokens .*max_len=8"):
        build_sft_examples(OVERLONG, TOK, max_len=8, overlong="error", source="train.jsonl")
    exs, stats = build_sft_examples(OVERLONG[2:3], TOK, max_len=8, overlong="error")
    assert stats == {"records": 1, "kept": 1, "truncated": 0, "dropped": 0} and len(exs) == 1


def test_build_errors():
    with pytest.raises(ValueError, match="truncate, drop, error"):
        build_sft_examples(OVERLONG, TOK, max_len=8, overlong="clip")
    with pytest.raises(DataError, match=r"src:2: .*'response'"):
        build_sft_examples([OVERLONG[0], {"prompt": "a"}], TOK, max_len=8, source="src")
    exs, _ = build_sft_examples([{"q": "a", "a": "b"}], TOK, max_len=8, prompt_key="q", response_key="a")
    assert exs == [SFTExample(_pair_prompt("a"), [ord("b"), 253])]


def test_file_to_examples(tmp_path):
    path = str(tmp_path / "add.jsonl")
    write_jsonl_atomic(path, addition_task(20, seed=0))
    exs, stats = build_sft_examples(load_records(path), TOK, max_len=64, source=path)
    assert stats == {"records": 20, "kept": 20, "truncated": 0, "dropped": 0}
    assert all(e.response_ids[-1] == TOK.eos_token_id for e in exs)


# ------------------------------------------------------------------------------------------- synthetic


def test_addition_task_deterministic_and_correct():
    a, b, c = addition_task(50, seed=1), addition_task(50, seed=1), addition_task(50, seed=2)
    assert a == b and a != c
    for rec in a:
        x, y = rec["prompt"].rstrip("=").split("+")
        assert rec["prompt"].endswith("=") and rec["response"] == rec["answer"]
        assert int(x) + int(y) == int(rec["response"])
        assert 0 <= int(x) <= 99 and 0 <= int(y) <= 99
    assert all(int(r["answer"]) <= 6 for r in addition_task(30, seed=3, max_operand=3))
    assert addition_task(0, seed=0) == []


def test_addition_task_leaves_global_rng_alone():
    import random

    random.seed(123)
    expected = random.random()
    random.seed(123)
    addition_task(10, seed=5)
    assert random.random() == expected


def test_exact_match():
    assert exact_match(" 19\n", "19")
    assert not exact_match("190", "19")
    assert not exact_match("", "19")


def test_pad_responses_pads_to_max_length_as_dares_sft_datasets():
    """DARE's SFT datasets (@83ae8a3) pad input_ids to data.max_length, LLaDA's with eos and attended
    (verl/utils/dataset/llada_sft_dataset.py:214-218), SDAR's with the pad id (sdar_sft_dataset.py:214-218), and score
    the pads as answer tokens (LLaDA: every position >= prompt_length may be masked, :169-171; SDAR: labels keep them,
    :239-240). ``sft.pad_response`` gives the same canvas; ``none`` leaves the examples alone."""
    from megadare.data.sft_data import SFTExample, pad_responses

    examples = [SFTExample([1, 2, 3], [4, 5, TOK.eos_token_id]), SFTExample([1], [6, TOK.eos_token_id])]
    eos = pad_responses(examples, "eos", TOK, 8)
    assert [len(ex) for ex in eos] == [8, 8]
    assert eos[0].response_ids == [4, 5] + [TOK.eos_token_id] * 3
    assert eos[1].response_ids == [6] + [TOK.eos_token_id] * 6 and eos[1].prompt_ids == [1]
    pad = pad_responses(examples, "pad", TOK, 8)
    assert pad[0].response_ids == [4, 5, TOK.eos_token_id, TOK.pad_token_id, TOK.pad_token_id]
    assert pad_responses(examples, "none", TOK, 8) is examples
    with pytest.raises(ValueError, match="sft.pad_response='zeros'"):
        pad_responses(examples, "zeros", TOK, 8)
