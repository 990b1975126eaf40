"""``megadare eval``: metrics against brute force, the task loaders / prompts / extractors on fixture files, the
shared RL verifier on canned responses, errors that name the file, line, field or config key, and one end-to-end
run of the CLI on a tiny random SDAR model served by a Ray engine."""

from __future__ import annotations

import itertools
import json
import os
from fractions import Fraction
from types import SimpleNamespace

import pytest

from ray_fixture import ray_cluster  # noqa: F401  (module-scoped local Ray cluster)

from megadare.config import load_config
from megadare.errors import ConfigError, OutputError
from megadare.data.sft_data import DataError
from megadare.data.tokenizer import ByteTokenizer
from megadare.eval import TASKS, maj_at_k, pass_at_k, task_metrics
from megadare.eval.files import load_rows, task_file, write_json_atomic, write_jsonl_atomic
from megadare.eval.runner import check_eval_config, load_task_prompts, run_eval_command, score_samples
from megadare.eval.tasks import CODE_BLOCK_INSTRUCTION, D1_MATH_SYSTEM_PROMPT, MATH_BOXED_INSTRUCTION
from megadare.rewards import normalize_answer
from megadare.rollout.engine import SamplingParams, Trajectory

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "eval")
TOK = ByteTokenizer()
FILES = {t: task_file(FIXTURES, {}, t) for t in TASKS}


# ------------------------------------------------------------------------------------------------ metrics
def _brute_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """Share of the k-subsets of n samples (the first c correct) holding at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def test_pass_at_k_equals_enumeration_over_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(_brute_pass_at_k(n, c, k)), abs=1e-12), (n, c, k)
    assert pass_at_k(200, 1, 1) == pytest.approx(1 / 200)  # large n stays stable
    for bad in ((3, 4, 1), (3, 1, 4), (3, 1, 0)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_maj_at_k_hand_built():
    right = lambda keys, gold: [k == gold for k in keys]  # noqa: E731
    keys = ["5", "7", "5", "7", "7"]
    assert maj_at_k(keys, right(keys, "7"), 5) == 1.0  # 3 votes for 7
    assert maj_at_k(keys, right(keys, "5"), 5) == 0.0
    assert maj_at_k(keys, right(keys, "5"), 3) == 1.0  # only the first 3 vote: 5 wins 2-1
    assert maj_at_k(keys, right(keys, "5"), 4) == 1.0  # 2-2 tie: the answer seen first (5) wins
    assert maj_at_k(keys, right(keys, "7"), 4) == 0.0
    none_first = [None, None, "3", None]
    assert maj_at_k(none_first, right(none_first, "3"), 4) == 1.0  # unanswered samples do not vote
    assert maj_at_k(none_first, right(none_first, "3"), 2) == 0.0  # nobody voted: a miss
    with pytest.raises(ValueError):
        maj_at_k(keys, right(keys, "7"), 6)


def test_task_metrics_on_hand_built_rows():
    def row(i, s, ans, ok, length=4, fwd=2):
        return {"index": i, "sample": s, "extracted": ans, "correct": ok, "length": length, "forwards": fwd}

    rows = [
        row(0, 0, "1", True),
        row(0, 1, "2", False),
        row(0, 2, "1", True),
        row(1, 2, "9", False, 8, 8),
        row(1, 0, "9", False),
        row(1, 1, "4", True),
    ]  # out of order on purpose
    m = task_metrics(rows, [1, 2], normalize_answer)
    assert m["mean@3"] == pytest.approx(3 / 6)
    assert m["pass@1"] == pytest.approx((2 / 3 + 1 / 3) / 2)
    assert m["pass@2"] == pytest.approx((1.0 + (1 - 1 / 3)) / 2)
    assert m["maj@1"] == pytest.approx((1 + 0) / 2) and m["maj@2"] == pytest.approx((1 + 0) / 2)
    assert m["response_length"] == pytest.approx(28 / 6) and m["forwards_per_token"] == pytest.approx(18 / 28)
    assert "maj@1" not in task_metrics(rows, [1], None)  # code tasks: no majority vote


# ------------------------------------------------------------------------------------ loaders and prompts
@pytest.mark.parametrize("task", list(TASKS))
def test_loader_and_prompt_on_fixture(task):
    spec = TASKS[task]
    prompts = load_task_prompts(spec, FILES[task], None, "boxed", TOK)
    assert len(prompts) == len(load_rows(FILES[task])) >= 2
    for p in prompts:
        content = p.record["messages"][0]["content"]
        assert p.prompt_ids == TOK.chat_prompt([{"role": "user", "content": content}])  # the chat template
        if spec.kind == "planning":
            assert "inside <answer></answer> tags" in content or "<answer>\n[16-character solution" in content
        else:
            assert content.endswith(MATH_BOXED_INSTRUCTION if spec.kind == "math" else CODE_BLOCK_INSTRUCTION)
        assert p.record[spec.gold_field]
    rec = prompts[0].record
    expected = {
        "gsm8k": ("answer", "#### 7"),
        "math500": ("answer", "\\frac{3}{4}"),
        "aime24": ("answer", "401"),
        "aime25": ("answer", "15"),
        "humaneval": ("tests", "check(add)"),
        "mbpp": ("tests", "assert set(similar_elements"),
        "countdown": ("answer", "13"),
        "sudoku": ("answer", "1234341221434321"),
    }[task]
    assert expected[1] in rec[expected[0]]
    assert (
        rec["problem_id"]
        == {
            "gsm8k": None,
            "math500": "test/prealgebra/1.json",
            "aime24": "60",
            "aime25": "I-1",
            "humaneval": "HumanEval/0",
            "mbpp": "2",
            "countdown": "c1",
            "sudoku": "s1",
        }[task]
    )
    if task == "countdown":  # DARE's prompt, from Countdown-Tasks fields and from d1's "input"/"output" rows
        assert (
            "Using only the numbers [3, 5, 2], create an arithmetic expression that evaluates to exactly 13"
            in prompts[0].record["messages"][0]["content"]
        )
        assert "numbers [30, 100, 93]" in prompts[1].record["messages"][0]["content"]
        assert prompts[1].record["numbers"] == [30, 100, 93] and prompts[1].record["answer"] == "23"
    if task == "sudoku":
        assert prompts[1].record["puzzle"] == "2100300012000301"
        assert "Solve the following Sudoku puzzle: 2100300012000301" in prompts[1].record["messages"][0]["content"]
    if task == "math500":  # a row without 'answer' falls back to its solution (the reward takes the last box)
        assert "\\boxed{2\\sqrt{3}}" in prompts[2].record["answer"]
    if task == "mbpp":  # the full-MBPP row: 'text' + test_setup_code
        assert prompts[1].record["messages"][0]["content"].startswith("Write a python function")


def test_d1_prompt_style_and_limit():
    prompts = load_task_prompts(TASKS["gsm8k"], FILES["gsm8k"], 2, "d1", TOK)
    assert len(prompts) == 2
    content = prompts[0].record["messages"][0]["content"]
    assert content.startswith(D1_MATH_SYSTEM_PROMPT) and content.endswith("How many apples does he have now?")


def _trajectory(text: str) -> Trajectory:
    ids = TOK.encode(text) + [TOK.eos_token_id]
    n = len(ids)
    return Trajectory(
        prompt_ids=[1],
        response_ids=ids,
        commit_step=list(range(n)),
        block_step=[0] * n,
        logprobs=[0.0] * n,
        finish_reason="stop",
        num_forwards=n,
        params=SamplingParams(),
    )


CANNED = {  # (a correct response, a wrong one) for the first two problems of every fixture
    "gsm8k": [("3 + 4 = 7. The answer is 7.", "The answer is 8."), ("<answer>\\boxed{1200}</answer>", "12")],
    "math500": [("So $\\boxed{\\dfrac{3}{4}}$.", "$\\boxed{0.7}$"), ("x = \\boxed{4}", "\\boxed{5}")],
    "aime24": [("\\boxed{401}", "\\boxed{2401}"), ("The answer is 9", "\\boxed{8}")],
    "aime25": [("\\boxed{15}", "\\boxed{16}"), ("\\boxed{23}", "\\boxed{21}")],
    "humaneval": [
        (
            "```python\ndef add(a: int, b: int) -> int:\n    return a + b\n```",
            "```python\ndef add(a, b):\n    return a - b\n```",
        ),
        ("```python\ndef is_even(n):\n    return n % 2 == 0\n```", "no code"),
    ],
    "mbpp": [
        (
            "```python\ndef similar_elements(a, b):\n    return tuple(set(a) & set(b))\n```",
            "```python\ndef similar_elements(a, b):\n    return a\n```",
        ),
        (
            "```python\nimport math\ndef is_square(n):\n    return math.isqrt(n) ** 2 == n\n```",
            "```python\ndef is_square(n):\n    return True\n```",
        ),
    ],
    "countdown": [
        ("<reasoning>3*5=15</reasoning>\n<answer>\n3*5-2\n</answer>", "<answer>3*5*2</answer>"),
        ("<answer>30-(100-93)</answer>", "<answer>30+100-93</answer>"),
    ],
    "sudoku": [
        ("<answer>\n1234341221434321\n</answer>", "<answer>1234341221434312</answer>"),
        ("<answer>2143341212344321</answer>", "no answer"),
    ],
}


@pytest.mark.parametrize("task", list(TASKS))
def test_extraction_and_shared_verifier_on_canned_responses(task):
    spec = TASKS[task]
    prompts = load_task_prompts(spec, FILES[task], 2, "boxed", TOK)
    traj = [[_trajectory(good), _trajectory(bad)] for good, bad in CANNED[task]]
    rows, stats = score_samples(spec, TOK, prompts, traj)
    assert [r["correct"] for r in rows] == [True, False, True, False], rows
    assert stats["reward_errors"] == 0 and stats["reward_timeouts"] == 0
    assert [(r["index"], r["sample"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert rows[0]["length"] == len(TOK.encode(CANNED[task][0][0])) + 1 and rows[0]["response"] == CANNED[task][0][0]
    if spec.kind == "math":
        assert rows[2]["extracted"] == {"gsm8k": "1200", "math500": "4", "aime24": "9", "aime25": "23"}[task]
        assert rows[0]["gold"] == {"gsm8k": "7", "math500": "\\frac{3}{4}", "aime24": "401", "aime25": "15"}[task]
    elif spec.kind == "planning":
        assert rows[2]["extracted"] == {"countdown": "30-(100-93)", "sudoku": "2143341212344321"}[task]
        assert rows[0]["gold"] == {"countdown": "13", "sudoku": "1234341221434321"}[task]
        assert rows[1]["reward"] == {"countdown": 0.1, "sudoku": 7 / 8}[task]  # DARE's partial rules
    else:
        assert rows[0]["extracted"].startswith("def ") and rows[0]["gold"] is None


# ------------------------------------------------------------------------------------------------ errors
def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_bad_files_name_file_line_and_field(tmp_path):
    ok = json.dumps({"question": "q", "answer": "#### 1"})
    path = _write(tmp_path / "gsm8k.jsonl", [ok, "", json.dumps({"question": "q2"})])  # blank line 2
    with pytest.raises(DataError, match=r"gsm8k.jsonl:3: missing field 'answer'.*found keys \['question'\]"):
        load_task_prompts(TASKS["gsm8k"], path, None, "boxed", TOK)
    path = _write(tmp_path / "bad.jsonl", [ok, "{not json"])
    with pytest.raises(DataError, match=r"bad.jsonl:2: invalid JSON"):
        load_task_prompts(TASKS["gsm8k"], path, None, "boxed", TOK)
    path = _write(tmp_path / "m.jsonl", [json.dumps({"problem": ["x"], "answer": "1"})])
    with pytest.raises(DataError, match=r"m.jsonl:1: field 'problem' \(the problem statement\) must be a string"):
        load_task_prompts(TASKS["math500"], path, None, "boxed", TOK)
    path = _write(tmp_path / "mbpp.jsonl", [json.dumps({"text": "t", "test_list": "assert f()"})])
    with pytest.raises(DataError, match=r"mbpp.jsonl:1: field 'test_list' .* must be a list of strings"):
        load_task_prompts(TASKS["mbpp"], path, None, "boxed", TOK)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.Table.from_pylist(
            [
                {"prompt": "def f():", "test": "pass", "entry_point": "f"},
                {"prompt": "def g():", "test": "pass", "entry_point": None},
            ]
        ),
        str(tmp_path / "he.parquet"),
    )
    with pytest.raises(DataError, match=r"he.parquet:row 2: missing field 'entry_point'"):
        load_task_prompts(TASKS["humaneval"], str(tmp_path / "he.parquet"), None, "boxed", TOK)
    _write(tmp_path / "empty.jsonl", [""])
    with pytest.raises(DataError, match=r"empty.jsonl: the file holds no rows"):
        load_rows(str(tmp_path / "empty.jsonl"))


def test_missing_data_names_file_and_config_key(tmp_path):
    with pytest.raises(DataError, match=r"math500.jsonl or .*math500.parquet: .*not found.*eval.paths.math500"):
        task_file(str(tmp_path), {}, "math500")
    with pytest.raises(DataError, match=r"nope.jsonl: data file of task 'mbpp' not found \(set by eval.paths.mbpp\)"):
        task_file(None, {"mbpp": str(tmp_path / "nope.jsonl")}, "mbpp")
    with pytest.raises(ConfigError, match=r"no data for task 'gsm8k': set eval.data_dir"):
        task_file(None, {}, "gsm8k")
    _write(tmp_path / "aime24.jsonl", ["{}"])
    _write(tmp_path / "aime24.parquet", [""])
    with pytest.raises(ConfigError, match=r"both .* exist in eval.data_dir; choose one with eval.paths.aime24"):
        task_file(str(tmp_path), {}, "aime24")


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["eval.tasks=[gsm8k,gsm8kk]"], r"eval.tasks: unknown task 'gsm8kk'; did you mean 'gsm8k'"),
        (["eval.n_samples=2", "eval.k=[1,4]", "eval.temperature=1.0"], r"eval.k=\[1, 4\]: k=4 > eval.n_samples=2"),
        (["eval.n_samples=2"], r"eval.n_samples=2 with temperature 0 \(rollout.eval_temperature\).*eval.temperature"),
        (["eval.n_samples=2", "eval.temperature=0"], r"temperature 0 \(eval.temperature\)"),
        (["eval.paths={humaneva: x.jsonl}"], r"eval.paths.humaneva: unknown task"),
        (["eval.prompt_style=cot"], r"eval.prompt_style='cot' is not one of boxed, d1"),
    ],
)
def test_config_errors_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        check_eval_config(load_config(None, overrides))


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    from megadare.cli import main

    base = ["model.family=sdar", "model.tiny=true", f"logging.run_dir={tmp_path}"]
    assert main(["eval", *base, "eval.tasks=[gsm8kk]"]) == 2
    assert "eval.tasks: unknown task 'gsm8kk'" in capsys.readouterr().err
    assert main(["eval", "--tasks", "mbpp", *base, f"eval.data_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "mbpp.jsonl or" in err and "eval.paths.mbpp" in err and "Traceback" not in err


def test_eval_refuses_to_replace_files_it_did_not_write(tmp_path, capsys):
    """eval.output_dir pointed at a directory holding the user's own summary.json: eval replaced it without a word.
    It now refuses before any engine starts, naming the file; a directory it wrote before is its own to replace."""
    from megadare.cli import main
    from megadare.eval.files import claim_output_dir

    out = tmp_path / "results"
    out.mkdir()
    (out / "summary.json").write_text('{"mine": 1}')
    base = ["model.family=sdar", "model.tiny=true", f"logging.run_dir={tmp_path}", f"eval.data_dir={FIXTURES}"]
    assert main(["eval", "--tasks", "gsm8k", *base, "eval.limit=1", f"eval.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert f"eval.output_dir={out} holds {out}/summary.json, which megadare eval did not write" in err, err
    assert "Traceback" not in err and (out / "summary.json").read_text() == '{"mine": 1}'
    assert sorted(os.listdir(out)) == ["summary.json"]
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(OutputError, match="is a file; choose a directory"):
        claim_output_dir(str(tmp_path / "a_file"), ["summary.json"])
    ours = tmp_path / "ours"
    claim_output_dir(str(ours), ["summary.json"])
    (ours / "summary.json").write_text("{}")
    claim_output_dir(str(ours), ["summary.json"])  # a rerun replaces its own outputs


def test_a_second_eval_on_a_live_evals_output_dir_is_refused(tmp_path, capsys, monkeypatch):
    """Two ``megadare eval`` on one eval.output_dir ran side by side, each rewriting summary.json and the
    samples files under the other. The output directory is now locked (the run lock) for the eval: a second is
    refused in one line while the first runs, and may go once it ended."""
    from megadare.cli import main
    from megadare.eval import runner

    out = tmp_path / "out"
    argv = ["eval", "--tasks", "gsm8k", "model.family=sdar", "model.tiny=true", f"logging.run_dir={tmp_path}"]
    argv += [f"eval.data_dir={FIXTURES}", "eval.limit=1", f"eval.output_dir={out}"]
    started, second = [], []

    def engines(cfg, src, tok):  # the first eval, while it runs, sees a second start on its output_dir
        started.append(cfg.eval.output_dir)
        if len(started) == 1:  # the first eval: a second starts meanwhile
            second.append(main(argv))
        raise KeyboardInterrupt  # stop here: no engines in this test

    monkeypatch.setattr(runner, "start_engines", engines)
    assert main(argv) == 130 and second == [2], second
    err = capsys.readouterr().err
    assert len(started) == 1 and f"{out} is in use by pid {os.getpid()}" in err and "eval.output_dir" in err, err
    assert "megadare.lock" not in os.listdir(out)  # the first gave it back when it stopped
    started.append("the first ended")  # the next eval on the output directory goes on
    assert main(argv) == 130 and started[-1] == str(out), started


def test_atomic_jsonl_leaves_no_temp_files(tmp_path):
    out = tmp_path / "sub" / "rows.jsonl"
    write_jsonl_atomic(str(out), [{"a": 1}, {"b": "\\boxed{2}"}])
    write_jsonl_atomic(str(out), [{"a": 3}])
    assert [json.loads(x) for x in out.read_text().splitlines()] == [{"a": 3}]
    assert os.listdir(tmp_path / "sub") == ["rows.jsonl"]
    with pytest.raises(TypeError):
        write_jsonl_atomic(str(out), [{"bad": object()}])
    assert [json.loads(x) for x in out.read_text().splitlines()] == [{"a": 3}]  # a failed write keeps the old file
    assert os.listdir(tmp_path / "sub") == ["rows.jsonl"]


_KILLED_MID_WRITE = """
import os, sys, time
from megadare.eval.files import write_json_atomic
def stall(fd):
    print("writing", flush=True)
    time.sleep(300)
os.fsync = stall
write_json_atomic(sys.argv[1], {"tasks": {}})
"""


def test_an_eval_output_write_killed_mid_way_leaves_no_temp_file_after_the_next(tmp_path):
    """eval wrote each output through a temp file of a random name (mkstemp): a SIGKILL mid-write left
    ``summary.json.<random>.tmp`` in the output directory, one more per kill. It now writes through the one
    helper a run's files use (megadare/files.py): a fixed ``summary.json.tmp`` that the next write replaces."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "summary.json"
    write_json_atomic(str(out), {"tasks": {"old": 1}})
    child = subprocess.Popen([sys.executable, "-c", _KILLED_MID_WRITE, str(out)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "writing\n"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert json.loads(out.read_text()) == {"tasks": {"old": 1}} and len(os.listdir(tmp_path)) == 2
    write_json_atomic(str(out), {"tasks": {"new": 1}})
    assert os.listdir(tmp_path) == ["summary.json"] and json.loads(out.read_text()) == {"tasks": {"new": 1}}


# ------------------------------------------------------------------------------------------- end to end


@pytest.mark.timeout(300)
def test_cli_eval_end_to_end_on_tiny_sdar(tmp_path, ray_cluster):
    from megadare.cli import main

    out = tmp_path / "out"
    rc = main(
        [
            "eval",
            "--tasks",
            ",".join(TASKS),
            "model.family=sdar",
            "model.tiny=true",
            "model.block_size=4",
            f"logging.run_dir={tmp_path}",
            f"eval.data_dir={FIXTURES}",
            "eval.paths={gsm8k: " + FILES["gsm8k"] + "}",
            "eval.n_samples=2",
            "eval.k=[1,2]",
            "eval.temperature=1.0",
            "eval.limit=2",
            f"eval.output_dir={out}",
            "rollout.max_new_tokens=8",
            "rollout.num_engines=1",
        ]
    )
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["tasks"]) == set(TASKS) and summary["sampling"]["temperature"] == 1.0
    differ = 0
    for task, spec in TASKS.items():
        rows = [json.loads(x) for x in (out / f"samples_{task}.jsonl").read_text().splitlines()]
        assert len(rows) == 2 * 2
        assert {(r["index"], r["sample"]) for r in rows} == {(i, j) for i in range(2) for j in range(2)}
        for r in rows:
            assert (
                {"task", "index", "prompt", "sample", "response", "extracted", "correct", "length", "forwards"}
                <= set(r)
                and r["task"] == task
                and r["forwards"] >= 1
            )
        m = summary["tasks"][task]
        keys = {"mean@2", "pass@1", "pass@2", "response_length", "forwards_per_token", "problems", "file"}
        assert keys <= set(m) and m["problems"] == 2
        assert ("maj@2" in m) == (spec.kind == "math")
        assert m["mean@2"] == pytest.approx(sum(r["correct"] for r in rows) / len(rows))  # recomputed
        assert m["response_length"] == pytest.approx(sum(r["length"] for r in rows) / len(rows))
        assert m["forwards_per_token"] == pytest.approx(
            sum(r["forwards"] for r in rows) / sum(r["length"] for r in rows)
        )
        by = {(r["index"], r["sample"]): r["response"] for r in rows}
        differ += sum(by[(i, 0)] != by[(i, 1)] for i in range(2))
    assert differ > 0  # distinct per-sample seeds: the two samples of a problem are not copies
    table = (out / "summary.csv").read_text().splitlines()  # the printed table, one row per task
    assert table[0].startswith("task,problems,samples,mean@2,pass@1,pass@2") and len(table) == 1 + len(TASKS)
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


@pytest.mark.parametrize(
    "overrides, nproc, match",
    [([], 2, "--nproc 2: evaluation runs no trainer processes"), (["checkpoint.load=/ckpt/x"], 1, "checkpoint.load")],
)
def test_eval_refuses_trainer_options_before_loading_anything(overrides, nproc, match):
    """--nproc > 1 and a Megatron checkpoint.load are refused first, naming the fix (no model, data or engine)."""
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError, match=match):
        run_eval_command(SimpleNamespace(cfg=cfg, source=None), nproc=nproc)
