"""DARE's data files work as they are: RL / SFT / preference rows in verl's schema with no key overrides, dotted keys
into nested fields, lists of files, assistant prefills through the chat template, ``megadare data inspect`` on each
schema, and DARE's test files as ``megadare eval`` tasks (table + csv, and the stop on rewards that fail)."""

from __future__ import annotations

import argparse
import csv
import json

import pytest

from dare_files import (
    countdown_rows,
    math_rows,
    mbpp_rows,
    preference_rows,
    rl_row,
    sft_rows,
    sudoku_rows,
    write_parquet,
)
from megadare import cli
from megadare.config import load_config
from megadare.data.files import DataError, load_many
from megadare.data.preference_data import load_preference_examples
from megadare.data.prompt_data import PromptRules, build_prompts, load_rl_prompts
from megadare.data.sft_data import build_sft_examples, record_to_example
from megadare.data.tokenizer import ByteTokenizer, HFTokenizer
from megadare.eval.data_inspect import inspect_command
from megadare.eval.runner import load_task_prompts, score_samples, write_summary
from megadare.eval.tasks import task_spec
from megadare.rewards import RewardError
from megadare.rollout.engine import SamplingParams, Trajectory
from tiny import write_tiny_hf

TOK = ByteTokenizer()


def _files(tmp_path) -> dict[str, str]:
    return {
        "math": write_parquet(tmp_path / "rl" / "math.parquet", math_rows()),
        "countdown": write_parquet(tmp_path / "rl" / "countdown.parquet", countdown_rows()),
        "sudoku": write_parquet(tmp_path / "rl" / "sudoku.parquet", sudoku_rows()),
        "mbpp": write_parquet(tmp_path / "rl" / "mbpp.parquet", mbpp_rows()),
        "sft": write_parquet(tmp_path / "sft" / "gsm8k.parquet", sft_rows()),
        "dpo": write_parquet(tmp_path / "dpo" / "ultrafeedback.parquet", preference_rows()),
    }


# ------------------------------------------------------------------------------------------------ datasets
def test_rl_rows_load_with_no_overrides_from_a_list_of_files(tmp_path):
    f = _files(tmp_path)
    cfg = load_config(None, [f"data.path=[{f['math']},{f['countdown']}]", f"data.eval_path={f['sudoku']}"])
    train, held = load_rl_prompts(cfg, TOK)
    assert len(train) == 6 and len(held) == 1
    assert [p.where for p in train[2:4]] == [f"{f['math']}:row 3", f"{f['countdown']}:row 1"]
    first = train[0]
    assert first.prompt_ids == TOK.chat_prompt([{"role": "user", "content": "What is 0 + 2?"}])
    assert first.record["answer"] == "2" and first.record["data_source"] == "math" and first.prefill == ""
    assert train[3].record["extra_info"]["numbers"] == "[1, 3]"  # rides along to the reward


def test_dotted_keys_and_their_errors(tmp_path):
    rows = sft_rows(2)
    out = build_prompts(
        rows,
        TOK,
        "mem",
        PromptRules(prompt_key="extra_info.question", answer_key="reward_model.ground_truth", messages_key="none"),
    )
    assert out[1].prompt_ids == TOK.chat_prompt([{"role": "user", "content": rows[1]["extra_info"]["question"]}])
    assert out[1].record["answer"] == "3"
    with pytest.raises(DataError, match=r"mem:1: missing field 'reward_model.truth'"):
        build_prompts(rows, TOK, "mem", PromptRules(answer_key="reward_model.truth"))
    path = write_parquet(
        tmp_path / "x.parquet", [rl_row("math", "q", "1", 0), {**rl_row("math", "q", "1", 1), "prompt": []}]
    )
    cfg = load_config(None, [f"data.path={path}"])
    with pytest.raises(DataError, match=r"x.parquet:row 2: field 'prompt' must be a non-empty list"):
        load_rl_prompts(cfg, TOK)
    with pytest.raises(DataError, match=r"data.path=\[\]: give a file or a list"):
        load_many([], "data.path")


def _hf_tokenizer(tmp_path) -> HFTokenizer:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<unk>": 0, "<eos>": 1, "<mask>": 2, "hello": 3, "world": 4, "user": 5, "assistant": 6, ":": 7, "<end>": 8}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <end> {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
    fast.save_pretrained(str(tmp_path / "tok"))
    return HFTokenizer(str(tmp_path / "tok"), mask_token_id=2)


def test_assistant_prefill_is_continued_and_dare_rows_render_as_verl(tmp_path):
    rec = mbpp_rows()[0]
    p = build_prompts([rec], TOK, "mem")[0]  # a DARE row: its "[BEGIN]\n" turn closed, a new one opened
    assert p.prefill == "" and p.prompt_ids == TOK.chat_prompt(rec["prompt"])
    assert p.prompt_ids[-3:] == [*TOK.encode("\n\n"), TOK.ASSISTANT]
    assert p.reward_text("[BEGIN]\n 'def add(a, b): return a + b' \n[DONE]").startswith("[BEGIN]\n 'def add")
    p = build_prompts([{"messages": rec["prompt"], "answer": "x"}], TOK, "mem")[0]  # not a verl row: continued
    assert p.prefill == "[BEGIN]\n"
    assert p.prompt_ids == TOK.chat_prompt(rec["prompt"][:1]) + TOK.encode("[BEGIN]\n")  # the open assistant turn
    assert p.reward_text(" 'def add(a, b): return a + b' \n[DONE]").startswith("[BEGIN]\n 'def add")
    hf = _hf_tokenizer(tmp_path)
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    assert hf.chat_prompt(msgs[:1]) == [5, 7, 3, 8, 6, 7]  # a new assistant turn
    assert hf.chat_prompt(msgs, continue_final=True) == [5, 7, 3, 8, 6, 7, 4]  # "world" left open: no <end>
    assert build_prompts([{"messages": msgs, "answer": "x"}], hf, "mem")[0].prompt_ids == [5, 7, 3, 8, 6, 7, 4]
    verl = rl_row("mbpp", msgs, "x", 0)
    assert build_prompts([verl], hf, "mem")[0].prompt_ids == [5, 7, 3, 8, 6, 7, 4, 8, 6, 7]  # closed, reopened


def test_sft_and_preference_rows_load(tmp_path):
    f = _files(tmp_path)
    located = load_many(f["sft"])
    examples, stats = build_sft_examples([r for _, r in located], TOK, 256, source=[w for w, _ in located])
    q, a = sft_rows()[1]["extra_info"]["question"], sft_rows()[1]["extra_info"]["answer"]
    assert stats["kept"] == 3
    assert examples[1].prompt_ids == TOK.chat_prompt([{"role": "user", "content": q}])  # DARE's recipe fields
    assert examples[1].response_ids == TOK.encode(a) + [TOK.eos_token_id]
    same = record_to_example(
        sft_rows()[1], TOK, "mem", prompt_key="extra_info.question", response_key="extra_info.answer"
    )
    assert same == examples[1]
    pairs, stats = load_preference_examples([f["dpo"], f["dpo"]], TOK, 64)  # a list of files
    assert stats["kept"] == 4 and pairs[1].where == f"{f['dpo']}:row 2"
    assert pairs[1].prompt_ids == TOK.chat_prompt([{"role": "user", "content": "Say hi 1"}])
    assert pairs[1].chosen_ids == TOK.encode("Hi 1!") + [TOK.eos_token_id]
    assert pairs[1].rejected_ids == TOK.encode("no") + [TOK.eos_token_id]
    bad = write_parquet(tmp_path / "bad_dpo.parquet", [{"prompt": "p", "chosen": "a"}])
    with pytest.raises(DataError, match=r"bad_dpo.parquet:row 1: missing field 'rejected'"):
        load_preference_examples(bad, TOK, 64)


# ----------------------------------------------------------------------------------------------- inspect
def _inspect(paths, **kw) -> tuple[int, list[str]]:
    lines: list[str] = []
    rc = inspect_command(list(paths), out=lambda s: lines.extend(s.split("\n")), **kw)
    return rc, lines


def test_data_inspect_on_each_schema(tmp_path):
    f = _files(tmp_path)
    rc, lines = _inspect([f["math"], f["countdown"], f["sudoku"], f["mbpp"]])
    assert rc == 0, lines
    assert "schema: verl / DARE rows; data_source: math 3" in lines
    assert (
        "RL prompts: prompt <- prompt (1 end in an assistant turn, closed as verl renders it), gold <- "
        "reward_model.ground_truth, reward auto" in lines
    )
    assert any(line.startswith("prompt bytes: p50 ") for line in lines)  # no --model: UTF-8 bytes
    assert lines[-1] == "reward of gold answers: 1.000 over 4 records (auto)"  # math 3 + sudoku 1 (not targets)
    rc, lines = _inspect([f["sft"]])
    assert rc == 0 and "SFT examples: extra_info.question + extra_info.answer" in lines
    assert any(line.startswith("response bytes: ") for line in lines)
    assert lines[-1] == "reward of gold answers: 1.000 over 3 records (auto)"
    rc, lines = _inspect([f["dpo"]])
    assert rc == 0 and "preference pairs: prompt <- prompt, chosen <- chosen, rejected <- rejected" in lines
    assert lines[-1] == "reward of gold answers: n/a over 0 records (auto)"


def test_data_inspect_of_a_missing_file_prints_nothing_before_its_error(tmp_path):
    """The report's first line (what lengths count) came before the error for a missing file: the error alone now."""
    f = _files(tmp_path)
    missing = str(tmp_path / "no_such.jsonl")
    lines: list[str] = []
    with pytest.raises(DataError, match=r"no_such\.jsonl: data file not found"):
        inspect_command([f["sft"], missing], out=lines.append)
    assert lines == []


def test_data_inspect_help_says_what_lengths_count_without_model(tmp_path):
    """`megadare data inspect --help` said --model defaults to "the demo's" tokenizer; without it the lengths are
    UTF-8 bytes (README "RL", and the report's first line)."""
    rc, lines = _inspect([_files(tmp_path)["math"]])
    assert rc == 0 and lines[0].startswith("lengths: UTF-8 bytes"), lines
    sub = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    data = next(a for a in sub.choices["data"]._actions if isinstance(a, argparse._SubParsersAction))
    (model,) = [a for a in data.choices["inspect"]._actions if a.dest == "model"]
    assert model.help.endswith("(default: UTF-8 bytes)"), model.help


def test_data_inspect_on_a_model_without_tokenizer_files_says_so(tmp_path):
    """`megadare data inspect rl.jsonl --model runs/demo_hf` (the demo's export: config.json and weights, no
    tokenizer files) reported every row as 'tokenizer ... has no chat template': transformers 5 builds an empty
    tokenizer of the model type instead of failing."""
    hf = write_tiny_hf(tmp_path, "sdar", seed=1, block_size=4)
    with pytest.raises(DataError, match=rf"--model {hf}: no tokenizer files \(none of tokenizer.json"):
        _inspect([_files(tmp_path)["math"]], model=hf)


def test_data_inspect_reads_a_benchmark_file_with_the_default_keys(tmp_path):
    """A gsm8k / MATH-500 / dLLM-RL file (`question` / `problem` + `answer`) was 'no known schema' and needed
    data.prompt_key: the default keys read its prompt field now, in data inspect as in a run."""
    for key in ("question", "problem"):
        path = tmp_path / f"{key}.jsonl"
        row = {key: "What is 6 x 12?", "answer": "72"}
        path.write_text(json.dumps(row) + "\n")
        rc, lines = _inspect([str(path)])
        assert rc == 0 and f"RL prompts: prompt <- {key}, gold <- answer, reward auto" in lines, lines
        (prompt,) = build_prompts([row], ByteTokenizer(), str(path))
        assert prompt.record["answer"] == "72" and prompt.prompt_ids


def test_data_inspect_names_bad_records_and_wrong_rewards(tmp_path, capsys):
    from megadare.cli import main

    bad = write_parquet(
        tmp_path / "bad.parquet", [rl_row("math", "q", "1", 0), rl_row("countdown", "q", "7", 1, numbers="[1, 2")]
    )
    rc, lines = _inspect([bad])
    assert rc == 1
    assert any(
        line.startswith(f"error: {bad}:row 2: field 'answer'") and "countdown numbers" in line for line in lines
    ), lines
    rc, lines = _inspect([write_parquet(tmp_path / "m.parquet", math_rows())], reward="sudoku")  # a wrong reward
    assert rc == 1 and "reward of gold answers: n/a over 0 records (sudoku)" == lines[-1]
    assert main(["data", "inspect", bad]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "reward of gold answers: 1.000 over 1 records (auto)"


# ------------------------------------------------------------------------------------------- eval on DARE files
def _traj(text: str) -> Trajectory:
    ids = TOK.encode(text) + [TOK.eos_token_id]
    return Trajectory(
        prompt_ids=[1],
        response_ids=ids,
        commit_step=list(range(len(ids))),
        block_step=[0] * len(ids),
        logprobs=[0.0] * len(ids),
        finish_reason="stop",
        num_forwards=len(ids),
        params=SamplingParams(),
    )


def test_dare_test_files_are_eval_tasks(tmp_path):
    f = _files(tmp_path)
    spec = task_spec(f["mbpp"])
    assert (spec.name, spec.kind, spec.reward) == ("mbpp", "code", "auto")
    prompts = load_task_prompts(spec, spec.path, None, "boxed", TOK)
    assert prompts[0].prefill == "" and prompts[0].where == f"{f['mbpp']}:row 1"
    right = "[BEGIN]\n 'def add(a, b):\n    return a + b' \n[DONE] \n\n"  # a new turn, scored alone as DARE does
    rows, stats = score_samples(spec, TOK, prompts, [[_traj(right), _traj(right.replace("+", "-"))]])
    assert [r["correct"] for r in rows] == [True, False] and stats["reward_errors"] == 0
    assert rows[0]["extracted"] == "def add(a, b):\n    return a + b"
    spec = task_spec(f["countdown"])
    prompts = load_task_prompts(spec, spec.path, 2, "boxed", TOK)
    rows, _ = score_samples(spec, TOK, prompts, [[_traj("<answer>1+3</answer>")], [_traj("<answer>2+2</answer>")]])
    assert [r["reward"] for r in rows] == [1.0, 0.1] and rows[0]["gold"] == "4"
    out = tmp_path / "out"
    path = write_summary(
        str(out),
        {
            "mbpp": {"problems": 1, "samples_per_problem": 2, "mean@2": 0.5, "pass@1": 0.5, "reward_errors": 0},
            "countdown": {"problems": 2, "samples_per_problem": 1, "mean@1": 0.5},
        },
    )
    with open(path) as fh:
        table = list(csv.reader(fh))
    assert table[0][:5] == ["task", "problems", "samples", "mean@2", "pass@1"]
    assert table[1][:5] == ["mbpp", "1", "2", "0.5000", "0.5000"] and table[2][0] == "countdown"


def test_eval_stops_when_rewards_fail(tmp_path):
    broken = write_parquet(tmp_path / "sudoku_1.parquet", [rl_row("sudoku", "q", "1234341221434321", 0)])
    spec = task_spec(broken)
    prompts = load_task_prompts(spec, spec.path, None, "boxed", TOK)
    with pytest.raises(
        RewardError,
        match=r"eval task sudoku_1: reward 'auto' could not be computed for 1 of 1 .*"
        r"sudoku_1.parquet:row 1: KeyError: .*puzzle",
    ):
        score_samples(spec, TOK, prompts, [[_traj("<answer>1</answer>")]])
    with pytest.raises(DataError, match="a file task takes rows in the verl / DARE schema"):
        task_spec(
            str(tmp_path / "plain.jsonl")
            if (tmp_path / "plain.jsonl").write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
            else ""
        )


def test_a_file_task_of_an_unknown_source_says_what_eval_reads(tmp_path):
    """eval scores a file task by auto alone: the refusal must not send the user to rewards.name, which eval's
    file tasks ignore (the README's user set it, and got the same error again)."""
    odd = write_parquet(tmp_path / "reverse_1.parquet", [rl_row("reverse", "abc>", "cba", 0, task="reverse")])
    with pytest.raises(DataError) as refused:
        task_spec(odd)
    assert str(refused.value).startswith(f"{odd}:row 1: megadare eval scores a file task by its rows' data_source")
    assert "another rewards.name does not apply to it" in str(refused.value)
    assert "data_source='reverse'" in str(refused.value)


def test_rows_without_a_gold_answer_are_refused_or_left_out_when_asked(tmp_path, capsys):
    rows = math_rows(3)
    rows[1]["reward_model"]["ground_truth"] = None
    path = write_parquet(tmp_path / "math.parquet", rows)
    cfg = load_config(None, [f"data.path={path}"])
    with pytest.raises(
        DataError,
        match=r"math.parquet:row 2: field 'reward_model.ground_truth' .* is null; drop the "
        r"row, or set rewards.skip_rows_without_answer=true",
    ):
        load_rl_prompts(cfg, TOK)
    cfg = load_config(None, [f"data.path={path}", "rewards.skip_rows_without_answer=true"])
    train, _ = load_rl_prompts(cfg, TOK)
    assert [p.where for p in train] == [f"{path}:row 1", f"{path}:row 3"]
    assert (
        f"left out 1 rows without a gold answer (rewards.skip_rows_without_answer): {path}:row 2"
        in capsys.readouterr().err
    )
