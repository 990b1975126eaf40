"""The real Qwen tokenizer of SDAR / TraDo and Dream, built offline from the dashscope wheel (no model hub), checked
against what the publishers published; DARE's rows through it; ``megadare data inspect`` on any UTF-8 text.

Published references used (cited where used):
* git blob ids of vocab.json / merges.txt of SDAR-1dot7B-Chat (= SDAR-4B/8B-Chat; merges.txt also SDAR-30B-A3B-Chat
  and Dream-v0-Instruct-7B) as yjyddq/DARE @83ae8a3 ships them under models/;
* transformers tests/models/qwen2/test_tokenization_qwen2.py, test_tokenizer_integration (Qwen/Qwen-tokenizer);
* transformers tests/models/qwen2_audio/test_modeling_qwen2_audio.py, test_small_model_integration_test_single
  (Qwen2.5's ChatML template with its default system prompt, the template Dream ships);
* alibaba/rtp-llm rtp_llm/test/tokenizer_test/qwen2_tokenizer_test.py (special tokens inside text);
* the mask ids of SDAR's and Dream's config.json (151669, 151666).
"""

from __future__ import annotations

import hashlib
import os

import pytest

from dare_files import mbpp_fewshot_row, rl_row, unicode_rl_rows, unicode_sft_rows, write_parquet
from qwen_files import IM_END, IM_START, chat_text_ids, qwen_dir, sdar_user_prompt, tiktoken_ids
from megadare.data.files import DataError
from megadare.data.prompt_data import build_prompts
from megadare.data.sft_data import record_to_example
from megadare.data.tokenizer import HFTokenizer, Utf8ByteTokenizer
from megadare.eval.data_inspect import inspect_command

ENDOFTEXT = 151643


def _git_blob_id(path: str) -> str:
    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


SDAR_VOCAB_BLOB = "4783fe10ac3adce15ac8f358ef5462739852c569"  # vocab.json of SDAR-1dot7B/4B/8B-Chat
MERGES_BLOB = "31349551d90c7606f325fe0f11bbb8bd5fa0d7c7"  # merges.txt of every SDAR and Dream-v0-Instruct-7B


@pytest.fixture(scope="module")
def sdar() -> HFTokenizer:
    return HFTokenizer(qwen_dir("sdar"))


@pytest.fixture(scope="module")
def dream_dir(tmp_path_factory) -> str:
    """Dream's layout written by the command (not from the cache: the builder itself runs in this session)."""
    from megadare.cli import main

    out = str(tmp_path_factory.mktemp("tok") / "dream")
    assert main(["data", "tokenizer", out, "--family", "dream"]) == 0
    return out


@pytest.fixture(scope="module")
def dream(dream_dir) -> HFTokenizer:
    return HFTokenizer(dream_dir)


def test_the_publishers_vocab_and_merges_byte_for_byte(dream_dir, capsys):
    """git blob ids of the files SDAR and Dream publish (yjyddq/DARE @83ae8a3, models/*/): the cached SDAR
    directory, and Dream's as ``megadare data tokenizer --family dream`` writes it (Dream ships the same vocabulary
    as indented JSON; written compact here, as SDAR ships it)."""
    from megadare.cli import main

    for d in (qwen_dir("sdar"), dream_dir):
        assert _git_blob_id(os.path.join(d, "vocab.json")) == SDAR_VOCAB_BLOB
        assert _git_blob_id(os.path.join(d, "merges.txt")) == MERGES_BLOB
    assert sorted(os.listdir(qwen_dir("sdar"))) == [
        "added_tokens.json",
        "chat_template.jinja",
        "merges.txt",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
    ]
    assert "tokenizer.json" not in os.listdir(dream_dir)  # as Dream-v0-Instruct-7B: vocab.json + merges.txt
    assert main(["data", "tokenizer", dream_dir, "--family", "dream"]) == 2  # never replaces files
    assert "already holds vocab.json, merges.txt, tokenizer_config.json" in capsys.readouterr().err
    mine = os.path.join(os.path.dirname(dream_dir), "a_file")
    with open(mine, "w") as f:
        f.write("mine")
    assert main(["data", "tokenizer", mine]) == 2  # a file: one line (was a FileExistsError traceback), untouched
    err = capsys.readouterr().err
    assert f"{mine}: is a file, not a directory" in err and "Traceback" not in err
    assert open(mine).read() == "mine"


def test_published_ids(sdar):
    # transformers tests/models/qwen2/test_tokenization_qwen2.py, test_tokenizer_integration (padding dropped)
    published = {
        "Transformers (formerly known as pytorch-transformers and pytorch-pretrained-bert) provides general-purpose "
        "architectures (BERT, GPT-2, RoBERTa, XLM, DistilBert, XLNet...) for Natural Language Understanding (NLU) and "
        "Natural Language Generation (NLG) with over 32+ pretrained models in 100+ languages and deep "
        "interoperability between Jax, PyTorch and TensorFlow.": [
            8963,
            388,
            320,
            69514,
            3881,
            438,
            4510,
            27414,
            32852,
            388,
            323,
            4510,
            27414,
            21334,
            35722,
            1455,
            529,
            8,
            5707,
            4586,
            58238,
            77235,
            320,
            61437,
            11,
            479,
            2828,
            12,
            17,
            11,
            11830,
            61437,
            64,
            11,
            1599,
            10994,
            11,
            27604,
            321,
            33,
            529,
            11,
            29881,
            6954,
            32574,
            369,
            18448,
            11434,
            45451,
            320,
            45,
            23236,
            8,
            323,
            18448,
            11434,
            23470,
            320,
            30042,
            38,
            8,
            448,
            916,
            220,
            18,
            17,
            10,
            80669,
            4119,
            304,
            220,
            16,
            15,
            15,
            10,
            15459,
            323,
            5538,
            94130,
            2897,
            1948,
            619,
            706,
            11,
            5355,
            51,
            21584,
            323,
            94986,
            13,
        ],
        "🤗 Transformers 提供了可以轻松地下载并且训练先进的预训练模型的 API 和工具。使用预训练模型可以减少计算消耗和碳排放，并且节省"
        "从头训练所需要的时间和资源。": [
            144834,
            80532,
            93685,
            83744,
            34187,
            73670,
            104261,
            29490,
            62189,
            103937,
            104034,
            102830,
            98841,
            104034,
            104949,
            9370,
            5333,
            58143,
            102011,
            1773,
            37029,
            98841,
            104034,
            104949,
            73670,
            101940,
            100768,
            104997,
            33108,
            100912,
            105054,
            90395,
            100136,
            106831,
            45181,
            64355,
            104034,
            113521,
            101975,
            33108,
            85329,
            1773,
        ],
        '```python\ntokenizer = AutoTokenizer.from_pretrained("Qwen/Qwen-tokenizer")\ntokenizer("世界，你好！")```': [
            73594,
            12669,
            198,
            85593,
            284,
            8979,
            37434,
            6387,
            10442,
            35722,
            445,
            48,
            16948,
            45274,
            16948,
            34841,
            3135,
            1138,
            85593,
            445,
            99489,
            3837,
            108386,
            6313,
            899,
            73594,
        ],
    }
    for text, ids in published.items():
        assert sdar.encode(text) == ids
        assert sdar.decode(ids) == text
    # rtp-llm's Qwen2 tokenizer test: special tokens written in the text are the special ids
    assert sdar.encode("<|im_start|>hello<|im_end|>") == [IM_START, 14990, IM_END]


def test_tiktoken_agrees_on_dare_text(sdar):
    """tiktoken (an independent BPE implementation) over the same ranks gives the same ids on text in the scripts
    DARE's files hold; the SFT rows' answers and the RL rows' prompts."""
    texts = [r["extra_info"]["answer"] for r in unicode_sft_rows()]
    texts += [r["prompt"][0]["content"] for r in unicode_rl_rows()]
    texts += [
        "e\u0301t\u00e9 \u03d2\u0301",
        "   spaces\t\ttabs\r\n\n\nend",  # NFC; whitespace runs; digits
        "12345678 + 0.5e-3 = x_{10}",
    ]
    for text in texts:
        ids = sdar.encode(text)
        assert ids == tiktoken_ids(text), text
        assert max(ids) < ENDOFTEXT


def test_family_specials_and_chat_templates(sdar, dream):
    assert (sdar.eos_token_id, sdar.pad_token_id, sdar.mask_token_id, sdar.vocab_size) == (
        151643,
        151643,
        151669,
        151670,
    )
    assert sdar.tok.convert_ids_to_tokens([151669, 151667, 151668]) == ["<|MASK|>", "<think>", "</think>"]
    assert (dream.eos_token_id, dream.pad_token_id, dream.mask_token_id, dream.tok.bos_token_id) == (
        151643,
        151643,
        151666,
        151665,
    )
    assert type(dream.tok).__name__ == "Qwen2Tokenizer"  # Dream names its remote DreamTokenizer; no remote code ran
    # transformers' Qwen2-Audio test: "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    # ... "What's that sound?<|im_end|>\n<|im_start|>assistant\n" (without its audio segment)
    system = [IM_START, 8948, 198, 2610, 525, 264, 10950, 17847, 13, IM_END, 198, IM_START, 872, 198]
    question = [3838, 594, 429, 5112, 30]
    turn_end = [IM_END, 198, IM_START, 77091, 198]
    msgs = [{"role": "user", "content": "What's that sound?"}]
    assert dream.chat_prompt(msgs) == system + question + turn_end  # Qwen2.5's default system prompt
    assert sdar.chat_prompt(msgs) == system[-3:] + question + turn_end  # Qwen3's template: none
    prefill = msgs + [{"role": "assistant", "content": "[BEGIN]\n"}]
    # SDAR's template renders the last assistant turn with an empty think block; the prefill stays open
    think, end_think = 151667, 151668
    assert sdar.chat_prompt(prefill, continue_final=True) == system[-3:] + question + turn_end + [think] + tiktoken_ids(
        "\n\n"
    ) + [end_think] + tiktoken_ids("\n\n") + tiktoken_ids("[BEGIN]\n")


def test_dare_rows_through_sdar_template(sdar):
    rl = build_prompts(unicode_rl_rows(), sdar, "mem")
    for p, row in zip(rl, unicode_rl_rows()):
        assert p.prompt_ids == sdar_user_prompt(row["prompt"][0]["content"])
    for row in unicode_sft_rows():
        ex = record_to_example(row, sdar, "mem")
        assert ex.prompt_ids == sdar_user_prompt(row["extra_info"]["question"])  # DARE's SFT recipe fields
        assert ex.response_ids == tiktoken_ids(row["extra_info"]["answer"]) + [ENDOFTEXT]


def _verl_ids(tok: HFTokenizer, messages: list[dict]) -> list[int]:
    """DARE's prompt ids, by its calls (verl/utils/dataset/rl_dataset.py:221-222 @83ae8a3)."""
    raw_prompt = tok.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.tok(raw_prompt, add_special_tokens=False)["input_ids"]


def test_dare_mbpp_row_renders_dares_ids(sdar, dream):
    """DARE renders its MBPP rows (3 shots, the task, an assistant "[BEGIN]\\n") with add_generation_prompt=True:
    the "[BEGIN]" turn is closed and a new assistant turn opened; megadare's prompt ids are those, and the response
    is scored alone (DARE's reward manager decodes the response only)."""
    row = mbpp_fewshot_row()
    msgs = row["prompt"]
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs[:-1])
    generation = "<|im_start|>assistant\n"
    # SDAR's chat_template.jinja: the assistant turn after the last user turn gets an empty think block
    sdar_text = turns + "<|im_start|>assistant\n<think>\n\n</think>\n\n[BEGIN]\n<|im_end|>\n" + generation
    dream_text = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" + turns
    dream_text += "<|im_start|>assistant\n[BEGIN]\n<|im_end|>\n" + generation  # Qwen2.5's template
    for tok, text in ((sdar, sdar_text), (dream, dream_text)):
        assert tok.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == text
        prompt = build_prompts([row], tok, "mem")[0]
        assert prompt.prompt_ids == chat_text_ids(text) == _verl_ids(tok, msgs)
        assert prompt.prefill == "" and prompt.reward_text("[BEGIN]\n 'x' \n[DONE]") == "[BEGIN]\n 'x' \n[DONE]"
    check = "def check(candidate):\n    assert candidate(2) == 4\n"
    humaneval = rl_row("humaneval", 'Complete the following python code:\ndef f(x):\n    """Twice x."""\n', check, 0)
    lcb = rl_row("lcbv5", "Read n from stdin and print n * 2.\n\nInput: 3\nOutput: 6", "[]", 1)
    for other in (humaneval, lcb):  # one user turn, as DARE's preprocess.py writes these: unchanged
        assert build_prompts([other], sdar, "mem")[0].prompt_ids == _verl_ids(sdar, other["prompt"])


# ----------------------------------------------------------------------------------------------- inspect
def _inspect(paths, **kw) -> tuple[int, list[str]]:
    lines: list[str] = []
    rc = inspect_command([str(p) for p in paths], out=lambda s: lines.extend(s.split("\n")), **kw)
    return rc, lines


def _percentiles(lengths: list[int]) -> str:
    """Nearest-rank p50 / p90 / p99 and max, computed here (ceil(q * n / 100)-th smallest)."""
    import math

    s = sorted(lengths)
    return "  ".join([f"p{q} {s[math.ceil(q * len(s) / 100) - 1]}" for q in (50, 90, 99)] + [f"max {s[-1]}"])


def test_inspect_without_a_model_counts_utf8_bytes(tmp_path):
    """On main this exited 1 with 'ByteTokenizer handles ASCII only' for every row holding ’, € or CJK."""
    rl = write_parquet(tmp_path / "rl.parquet", unicode_rl_rows())
    sft = write_parquet(tmp_path / "sft.parquet", unicode_sft_rows())
    rc, lines = _inspect([rl, sft])
    assert rc == 0, [x for x in lines if x.startswith("error")]
    assert lines[0].startswith("lengths: UTF-8 bytes") and not any(x.startswith("error") for x in lines)
    # <|user|> + content bytes + "\n" + <|assistant|>
    rl_bytes = [len(r["prompt"][0]["content"].encode()) + 3 for r in unicode_rl_rows()]
    assert lines[lines.index(f"== {rl}") + 4] == f"prompt bytes: {_percentiles(rl_bytes)}"
    answers = [len(r["extra_info"]["answer"].encode()) + 1 for r in unicode_sft_rows()]  # + eos
    assert f"response bytes: {_percentiles(answers)}" in lines
    assert lines[-1] == "reward of gold answers: 1.000 over 8 records (auto)"
    assert Utf8ByteTokenizer().decode(Utf8ByteTokenizer().encode("Janet’s 小明 🍎")) == "Janet’s 小明 🍎"


def test_inspect_with_the_qwen_tokenizer_directory(tmp_path):
    rl = write_parquet(tmp_path / "rl.parquet", unicode_rl_rows())
    sft = write_parquet(tmp_path / "sft.parquet", unicode_sft_rows())
    rc, lines = _inspect([rl, sft], model=qwen_dir("sdar"))
    assert rc == 0 and lines[0] == f"lengths: tokens of {qwen_dir('sdar')} (Qwen2Tokenizer, 151670 ids)"
    prompts = [len(sdar_user_prompt(r["prompt"][0]["content"])) for r in unicode_rl_rows()]
    assert lines[lines.index(f"== {rl}") + 4] == f"prompt tokens: {_percentiles(prompts)}"
    answers = [len(tiktoken_ids(r["extra_info"]["answer"])) + 1 for r in unicode_sft_rows()]
    assert f"response tokens: {_percentiles(answers)}" in lines
    assert "<|im_start|>user" in lines and lines[-1] == "reward of gold answers: 1.000 over 8 records (auto)"
    with pytest.raises(DataError, match=r"--model .*nowhere: not a directory"):
        _inspect([rl], model=str(tmp_path / "nowhere"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(DataError, match=r"--model .*empty: no tokenizer files \(none of tokenizer.json"):
        _inspect([rl], model=str(tmp_path / "empty"))
    os.makedirs(tmp_path / "broken")
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match=r"--model .*broken: its tokenizer does not load"):
        _inspect([rl], model=str(tmp_path / "broken"))


_KILLED_MID_BUILD = """
import sys, time
from megadare.data import qwen_tokenizer as q
def build(tmp, *a):
    print(tmp, flush=True)
    time.sleep(300)
q.write_qwen_tokenizer = build
q.cached_qwen_tokenizer("sdar", sys.argv[1])
"""


def test_a_tokenizer_build_killed_mid_way_leaves_nothing_after_the_next(tmp_path, monkeypatch):
    """The cached tokenizer is built in a hidden ``.qwen-*`` folder beside its target: a build SIGKILLed mid-way
    left it for good, one more per killed build. Its name now carries pid@host; the next build removes it (and
    keeps a live build's)."""
    import signal
    import socket
    import subprocess
    import sys

    from megadare.data import qwen_tokenizer as q

    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_MID_BUILD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    left = child.stdout.readline().strip()
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert os.path.isdir(left), left
    live = tmp_path / f".qwen-sdar.{os.getpid()}@{socket.gethostname()}-abcd1234"  # a build of a live process
    live.mkdir()
    monkeypatch.setattr(
        q, "write_qwen_tokenizer", lambda tmp, *a: open(os.path.join(tmp, "tokenizer_config.json"), "w")
    )
    built = q.cached_qwen_tokenizer("sdar", str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(built), live.name]), os.listdir(tmp_path)
