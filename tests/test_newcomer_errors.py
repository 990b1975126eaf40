"""Mistakes a new user makes following README.md: each is refused in one line naming the key or path and the fix,
before anything trains."""

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import megadare.cli
from megadare.cli import main
from megadare.config.loading import CHOICES
from megadare.models.family import FAMILIES, _ensure_loaded
from tiny import write_tiny_hf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT_TINY = os.path.join(REPO, "examples", "configs", "sft_sdar_tiny.yaml")
DEMO_RL = os.path.join(REPO, "megadare", "configs", "demo_rl.yaml")
SDAR_TINY = os.path.join(REPO, "examples", "configs", "sdar_tiny.yaml")
EVAL = os.path.join(REPO, "tests", "fixtures", "eval")


def refused(capsys, *argv) -> str:
    """The one ``megadare: error:`` line of a refused command (exit 2, no traceback)."""
    rc = main(list(argv))
    _, err = capsys.readouterr()
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("megadare: error:")]
    assert rc == 2 and len(lines) == 1, (rc, err)
    return lines[0]


def test_data_path_over_a_generated_task_is_refused(capsys, tmp_path):
    """The README's tiny SFT config trains on a generated task; data.path added to it was silently ignored."""
    data = tmp_path / "mine.jsonl"
    data.write_text('{"prompt": "1+1=", "response": "2"}\n')
    run = tmp_path / "run"
    line = refused(capsys, "sft", "--config", SFT_TINY, f"data.path={data}", "train.steps=4", f"logging.run_dir={run}")
    assert "data.path=" in line and "data.synthetic='addition'" in line and "data.synthetic=null" in line, line
    assert not (run / "ckpt").exists()
    line = refused(capsys, "sft", "--dry-run", "--config", SFT_TINY, f"data.path={data}", f"logging.run_dir={run}")
    assert "data.synthetic=null" in line, line


def test_a_checkpoint_that_does_not_exist_says_so(capsys, tmp_path):
    missing = tmp_path / "runs" / "demo" / "sft" / "ckpt"
    line = refused(capsys, "rl", "--config", DEMO_RL, f"checkpoint.load={missing}", f"logging.run_dir={tmp_path / 'r'}")
    assert f"{missing} does not exist" in line and "megadare sft" in line, line
    line = refused(capsys, "convert", "megatron-to-hf", "--ckpt", str(missing), "--out", str(tmp_path / "hf"))
    assert f"{missing} does not exist" in line, line
    assert not (tmp_path / "hf").exists()


def test_ctrl_c_before_training_is_one_line(capsys, monkeypatch):
    """Ctrl-C while megatron still imports (tens of seconds on a loaded CPU) printed a KeyboardInterrupt traceback."""
    import megadare.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_dispatch", interrupted)
    try:
        rc = main(["sft", "--config", SFT_TINY])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C left megadare's main as a KeyboardInterrupt traceback")
    err = capsys.readouterr().err
    assert rc == 130 and err.strip().splitlines() == [
        "megadare: interrupted (Ctrl-C); run the same command again to resume from its newest checkpoint, if any"
    ], err


def test_a_megatron_checkpoint_given_as_an_hf_model_says_how_to_export(capsys, tmp_path):
    """`megadare eval --model runs/demo/rl/ckpt` (the demo writes Megatron checkpoints) said
    '.../ckpt/config.json: no config.json found'."""
    root = tmp_path / "runs" / "demo" / "rl" / "ckpt"
    (root / "iter_0000030").mkdir(parents=True)
    (root / "iter_0000030" / "metadata.json").write_text("{}")
    (root / "latest_checkpointed_iteration.txt").write_text("30")
    for model in (root, root / "iter_0000030"):
        line = refused(
            capsys, "eval", "--config", SDAR_TINY, "--model", str(model), "--tasks", "gsm8k", f"eval.data_dir={EVAL}"
        )
        assert f"{model} is a Megatron checkpoint" in line and f"megatron-to-hf --ckpt {model}" in line, line


def test_the_demo_export_without_its_tiny_config_says_model_tiny(capsys, tmp_path):
    """`megadare eval --model runs/demo_hf ...` without the README's `--config examples/configs/sdar_tiny.yaml` said
    'has no tokenizer ...; copy the model's tokenizer files into it': the demo's export has none to copy, it uses
    the byte tokenizer (model.tiny=true)."""
    hf = write_tiny_hf(tmp_path, "sdar", seed=1, block_size=4)
    argv = ["eval", "--model", hf, "--tasks", "gsm8k", "--dry-run", f"eval.data_dir={EVAL}"]
    line = refused(capsys, *argv)
    assert f"model.hf_path={hf} has no tokenizer" in line and "add model.tiny=true" in line, line
    assert main([*argv, "model.tiny=true"]) == 0
    capsys.readouterr()
    other = write_tiny_hf(tmp_path, "sdar", seed=2, block_size=4, vocab_size=320)  # not the byte vocabulary
    line = refused(capsys, "eval", "--model", other, "--tasks", "gsm8k", f"eval.data_dir={EVAL}", "--dry-run")
    assert "copy the model's tokenizer files into it" in line and "model.tiny" not in line, line


def test_overrides_after_an_option_are_taken(capsys, tmp_path):
    """`megadare sft --config X parallel.tp=2 --dry-run logging.run_dir=...` said 'unrecognized arguments:
    logging.run_dir=...': argparse takes only the first run of positionals."""
    argv = ["sft", "--config", SFT_TINY, "parallel.tp=2", "--dry-run", "--config-only", f"logging.run_dir={tmp_path}"]
    assert main([*argv, "--nproc", "2", "parallel.sp=true"]) == 0
    out = capsys.readouterr().out
    assert "tp: 2" in out and "sp: true" in out and f"run_dir: {tmp_path}" in out, out
    with pytest.raises(SystemExit):  # a stray word that is no override is still refused
        main([*argv, "oops"])
    assert "unrecognized arguments: oops" in capsys.readouterr().err


def test_a_dry_run_that_passes_says_so(capsys, tmp_path):
    """README "Config": `megadare sft --nproc 2 --dry-run ...` printed 180 lines of config and no verdict."""
    argv = ["sft", "--nproc", "2", "--dry-run", "--config", SFT_TINY, "parallel.tp=2", f"logging.run_dir={tmp_path}"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "tp: 2" in out and err.strip().splitlines()[-1].startswith("pre-flight: every check passed"), err
    assert main([*argv, "--config-only"]) == 0
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("pre-flight: the config and the memory plan passed"), err


def test_rl_stopped_early_names_the_steps_its_accuracy_is_from(capsys, monkeypatch):
    """Ctrl-C at step 7 of the README's RL run printed 'held-out accuracy 0.280 -> 0.280': both the step-0 number,
    read as 'RL did nothing'."""
    import megadare.cli as cli
    from megadare.config import load_config

    run = {"step": 7, "stopped_by_signal": True, "checkpoint_root": "runs/x/ckpt", "evals": {0: {"accuracy": 0.28}}}
    monkeypatch.setattr(cli, "_launch", lambda *a: run)
    assert cli._run_rl(load_config(DEMO_RL, []), 1) == 0
    assert "rl stopped by signal at step 7; held-out accuracy 0.280 at step 0;" in capsys.readouterr().out
    run.update(
        step=30, stopped_by_signal=False, evals={0: {"accuracy": 0.28}, 10: {"accuracy": 0.5}, 30: {"accuracy": 1}}
    )
    assert cli._run_rl(load_config(DEMO_RL, []), 1) == 0
    assert "rl done at step 30; held-out accuracy 0.280 at step 0 -> 1.000 at step 30;" in capsys.readouterr().out


def _edited_hf(tmp_path, **changes) -> str:
    """A tiny SDAR checkpoint whose config.json has ``changes`` (a config.json of another checkpoint)."""
    import json

    hf = write_tiny_hf(tmp_path, "sdar", seed=1, block_size=4)
    path = os.path.join(hf, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config["__whole__"] if "__whole__" in config else config, f)
    return hf


def test_a_config_json_that_is_no_object_is_named(capsys, tmp_path):
    """A config.json holding a list (a JSON file of another tool) ended in 'TypeError: expected str, bytes or
    os.PathLike object, not list'."""
    hf = _edited_hf(tmp_path, __whole__=["SDARForCausalLM"])
    line = refused(capsys, "convert", "hf-to-megatron", "--hf", hf, "--out", str(tmp_path / "out"))
    assert f"{hf}/config.json: holds a JSON list, not an object" in line, line


@pytest.mark.parametrize(
    "changes,words",
    [
        ({"vocab_size": 300}, "model.embed_tokens.weight has 256 rows, config.json's vocab_size is 300"),
        ({"hidden_size": 128}, "model.embed_tokens.weight is [256, 64], config.json's hidden_size is 128"),
        (
            {"num_attention_heads": 8},
            "v_proj.weight have [64, 32, 32] rows, config.json's 8 heads, 2 key-value heads of 16",
        ),
        (
            {"intermediate_size": 96},
            "model.layers.0.mlp.gate_proj.weight is [128, 64], config.json gives [96, 64]; model.layers.0.mlp.up_proj",
        ),
    ],
)
def test_a_config_json_of_other_weights_is_refused_before_converting(capsys, tmp_path, changes, words):
    """config.json not matching the safetensors: vocab_size ended the conversion in a ValueError traceback half
    way; hidden_size wrote a Megatron checkpoint of the wrong shapes; the dry run passed both."""
    hf = _edited_hf(tmp_path, **changes)
    out = tmp_path / "out"
    line = refused(capsys, "convert", "hf-to-megatron", "--hf", hf, "--out", str(out))
    assert f"{hf}: config.json does not describe these weights (" in line and words in line, line
    assert not out.exists()
    argv = ["sft", "--dry-run", "--config", SFT_TINY, f"model.hf_path={hf}", "model.family=null"]
    line = refused(capsys, *argv, f"logging.run_dir={tmp_path / 'run'}")
    assert words in line, line


def test_a_config_json_with_fewer_layers_than_its_weights_is_one_line(capsys, tmp_path):
    """num_hidden_layers below the checkpoint's layers: a ValueError traceback from the mapping table's check."""
    hf = _edited_hf(tmp_path, num_hidden_layers=1)
    line = refused(capsys, "convert", "hf-to-megatron", "--hf", hf, "--out", str(tmp_path / "out"))
    assert "the checkpoint does not match its config.json; unexpected tensors (11): ['model.layers.1." in line, line
    assert line.endswith("put the checkpoint's own config.json beside its safetensors"), line


def test_load_hf_model_names_a_width_config_json_does_not_give(tmp_path):
    """The built-in engine's and eval's loader: a config.json of another MLP width was a RuntimeError of
    load_state_dict's size-mismatch list; now the CheckpointError naming the tensor and both shapes."""
    from megadare.models import load_hf_model
    from megadare.models.safetensors_io import CheckpointError

    hf = _edited_hf(tmp_path, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"gate_proj.weight is \[128, 64\], config.json gives \[96, 64\]"):
        load_hf_model(hf)


def test_eval_dry_run_reads_the_task_rows(capsys, tmp_path):
    """`megadare eval --dry-run` with eval.paths.gsm8k naming an empty file, or one without gsm8k's fields, said
    'every check passed'; the run then failed after loading the model."""
    hf = write_tiny_hf(tmp_path, "sdar", seed=1, block_size=4)
    empty, other = tmp_path / "empty.jsonl", tmp_path / "other.jsonl"
    empty.write_text("")
    other.write_text('{"prompt": "1+1=", "response": "2"}\n')
    argv = ["eval", "--dry-run", "--model", hf, "--tasks", "gsm8k", "model.tiny=true"]
    line = refused(capsys, *argv, f"eval.paths.gsm8k={empty}")
    assert f"{empty}: the file holds no rows" in line, line
    line = refused(capsys, *argv, f"eval.paths.gsm8k={other}")
    assert f"{other}:1: missing field 'question'" in line, line
    assert main([*argv, f"eval.data_dir={EVAL}"]) == 0


def test_data_commands_refuse_a_file_for_a_directory_and_a_count_below_one(capsys, tmp_path):
    """`megadare data tokenizer FILE` ended in a FileExistsError traceback; `data inspect --limit 0` (or -1)
    scored no gold answer and said 'n/a over 0 records', exit 0."""
    afile = tmp_path / "tok"
    afile.write_text("")
    line = refused(capsys, "data", "tokenizer", str(afile))
    assert f"{afile}: is a file, not a directory; name a new directory" in line, line
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    for limit in ("0", "-1"):
        with pytest.raises(SystemExit) as e:
            main(["data", "inspect", "--limit", limit, str(rows)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"argument --limit: {limit} must be a positive integer" in err, err


def test_the_demo_checks_its_options_and_the_rl_config_before_sft(capsys, tmp_path):
    """`megadare demo --algo tracrl` trained the SFT stage (minutes) before naming the typo; --workdir FILE and
    --nproc 0 ended in tracebacks (NotADirectoryError, IndexError); --sft-steps 0 ran the default 500 steps."""
    work = tmp_path / "demo"
    line = refused(capsys, "demo", "--workdir", str(work), "--sft-steps", "1", "--algo", "tracrl")
    assert "algo.name='tracrl' unknown" in line, line
    assert not (work / "sft").exists()
    afile = tmp_path / "file"
    afile.write_text("")
    line = refused(capsys, "demo", "--workdir", str(afile))
    assert f"--workdir {afile}: is a file, not a directory" in line, line
    for option in ("--nproc", "--sft-steps", "--rl-steps"):
        with pytest.raises(SystemExit) as e:
            main(["demo", "--workdir", str(work), option, "0"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"argument {option}: 0 must be a positive integer" in err, err


@pytest.mark.parametrize("size", ["0", "-1", "nan", "inf"])
def test_an_export_shard_size_must_be_a_positive_number(capsys, tmp_path, size):
    """--max-shard-gb 0 or -1 wrote one safetensors file per tensor, silently; nan / inf ended in a ValueError /
    OverflowError traceback after the checkpoint was read."""
    with pytest.raises(SystemExit) as e:
        main(
            [
                "convert",
                "megatron-to-hf",
                "--ckpt",
                str(tmp_path),
                "--out",
                str(tmp_path / "hf"),
                f"--max-shard-gb={size}",
            ]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument --max-shard-gb: {size} must be a finite number > 0" in err, err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("tasks", ["", " , "])
def test_eval_tasks_naming_no_task_is_refused(capsys, tmp_path, tasks):
    """`--tasks ''` evaluated eval.tasks' default benchmarks instead; `--tasks ' , '` ended in yaml's ParserError
    traceback."""
    line = refused(capsys, "eval", "--dry-run", "--config", SDAR_TINY, "--tasks", tasks, f"eval.data_dir={EVAL}")
    assert f"--tasks {tasks!r} names no task; e.g. --tasks gsm8k,math500" in line, line


@pytest.mark.parametrize("vpp", ["0", "-2"])
def test_convert_vpp_below_one_is_refused(capsys, tmp_path, vpp):
    """--vpp 0 or -2 was read as 'no virtual stages' without a word (the config's parallel.vpp refuses them)."""
    hf = write_tiny_hf(tmp_path, "sdar", seed=1, block_size=4)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as refusal:  # argparse's one line: the option as typed, not parallel.vpp
        main(["convert", "hf-to-megatron", "--hf", hf, "--out", str(out), "--pp", "2", "--vpp", vpp])
    err = capsys.readouterr().err
    assert refusal.value.code == 2 and f"argument --vpp: {vpp} must be a positive integer" in err, err
    assert not out.exists()


def test_the_dry_run_names_a_damaged_shard(capsys, tmp_path):
    """Every shard's header is read once by the dry run: a shard cut short is named before anything loads."""
    import json

    from megadare.models import build_hf_model, get_family, save_hf_model

    cfg = get_family("sdar").tiny_config(block_size=4)
    hf = save_hf_model(build_hf_model(cfg), cfg, tmp_path / "hf", max_shard_bytes=40_000)
    with open(os.path.join(hf, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    assert len(shards) >= 3, shards
    last = os.path.join(hf, shards[-1])
    with open(last, "r+b") as f:
        f.truncate(100)
    argv = ["sft", "--dry-run", "--config", SFT_TINY, f"model.hf_path={hf}", "model.family=null"]
    line = refused(capsys, *argv, f"logging.run_dir={tmp_path / 'run'}")
    assert f"{last}: not a complete safetensors file" in line, line


def test_eval_without_a_model_says_it_scores_a_random_tiny_model(capsys, tmp_path, monkeypatch):
    """`megadare eval --config examples/configs/sdar_tiny.yaml --tasks gsm8k ...` with --model forgotten printed a
    table of zeros like a checkpoint's: the tiny config's random model was scored without a word."""
    import megadare.eval.runner as runner

    monkeypatch.setattr(runner, "_run_tasks", lambda *a: 0)  # what is scored is decided before the engines
    argv = ["eval", "--config", SDAR_TINY, "--tasks", "gsm8k", f"eval.data_dir={EVAL}", f"logging.run_dir={tmp_path}"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "no --model given: scoring a randomly initialised tiny sdar" in err and "give --model DIR" in err, err
    hf = write_tiny_hf(str(tmp_path / "hf"), "sdar", 0)
    assert main([*argv[:5], "--model", hf, *argv[5:]]) == 0
    assert "randomly initialised" not in capsys.readouterr().err


def test_an_hf_path_that_does_not_exist_says_so(capsys, tmp_path):
    """`hf_to_megatron.py --hf /ckpt/SDAR-30B-A3B-Chat` on a machine without it said 'no config.json found', as if
    the directory were there but incomplete."""
    missing = tmp_path / "SDAR-30B-A3B-Chat"
    line = refused(capsys, "convert", "hf-to-megatron", "--hf", str(missing), "--out", str(tmp_path / "out"))
    assert f"{missing}: does not exist; point to an HF checkpoint directory" in line, line
    missing.mkdir()
    line = refused(capsys, "convert", "hf-to-megatron", "--hf", str(missing), "--out", str(tmp_path / "out"))
    assert f"{missing / 'config.json'}: no config.json found" in line, line


def test_a_misspelt_model_family_is_refused_by_the_config_check(capsys, tmp_path):
    """`model.family=sdra` loaded torch and megatron first (14 s on a loaded 2-core VM), then said "unknown family
    'sdra'" without the key it came from."""
    run = tmp_path / "run"
    line = refused(capsys, "sft", "--config", SFT_TINY, "model.family=sdra", f"logging.run_dir={run}")
    assert "model.family='sdra' is not one of null, dream, llada, llada2, sdar, sdar_moe" in line, line
    assert not run.exists()
    _ensure_loaded()
    assert CHOICES["model.family"] == (None, *sorted(FAMILIES)), "model.family's Literal lists the registered families"


class _Launched(Exception):
    """Raised in place of starting ranks: the test stops where the launch would begin."""


def test_nproc_below_one_is_refused_and_more_than_the_cores_is_said(capsys, monkeypatch, tmp_path):
    """`--nproc 0` (or -1) trained in one process without a word; `--nproc 16` on a 2-core laptop started 16 ranks,
    each with its own torch and megatron, with nothing saying why the run crawled."""

    def launched(*args, **kwargs):
        raise _Launched

    monkeypatch.setattr(megadare.cli, "_launch", launched)
    for nproc in ("0", "-1"):
        with pytest.raises(SystemExit) as stop:
            main(["sft", "--config", SFT_TINY, "--nproc", nproc, f"logging.run_dir={tmp_path / 'run'}"])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and f"argument --nproc: {nproc} must be a positive integer" in err, err
    monkeypatch.undo()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("megadare.parallel.launch.spawn", launched)
    with pytest.raises(_Launched):
        main(["sft", "--config", SFT_TINY, "--nproc", "3", f"logging.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert "--nproc 3 starts 3 trainer processes on 2 CPU cores and no GPU" in err and "--nproc 2 or fewer" in err, err
    with pytest.raises(_Launched):
        main(["sft", "--config", SFT_TINY, "--nproc", "2", f"logging.run_dir={tmp_path / 'run'}"])
    assert "CPU cores" not in capsys.readouterr().err


def test_data_inspect_of_dare_rows_without_a_gold_says_where_it_goes(capsys, tmp_path):
    """A DARE RL parquet whose rows lost their reward_model column (a filter or a join gone wrong) was 'no known
    schema ... found keys [...]' with nothing saying which field was missing."""
    row = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1?"}], "extra_info": {"index": 0}}
    path = tmp_path / "math_1.parquet"
    pq.write_table(pa.Table.from_pylist([row]), str(path))
    assert main(["data", "inspect", str(path)]) == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.err, out.err
    (line,) = [ln for ln in (out.out + out.err).splitlines() if ln.startswith("error:")]
    assert f"{path}:row 1: no known schema" in line and "reward_model.ground_truth, which this row lacks" in line, line


def test_a_recipe_placeholder_model_says_to_point_at_the_real_checkpoint(capsys, tmp_path):
    """A DARE recipe run as shipped (`model.hf_path: examples/configs/hf/SDAR-1dot7B-Chat`, config.json only) said
    '...: no model.safetensors, model.safetensors.index.json or *.safetensors files', naming neither the key nor
    that the directory is a placeholder."""
    recipe = os.path.join(REPO, "examples", "configs", "dare", "bgpo_sdar_1dot7b.yaml")
    rows = tmp_path / "math_1.parquet"
    row = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1?"}]}
    pq.write_table(pa.Table.from_pylist([{**row, "reward_model": {"ground_truth": "2"}}]), str(rows))
    over = [f"data.path={rows}", f"data.eval_path={rows}", f"logging.run_dir={tmp_path / 'run'}"]
    line = refused(capsys, "rl", "--dry-run", "--config", recipe, *over)
    placeholder = "examples/configs/hf/SDAR-1dot7B-Chat: no model.safetensors"
    assert placeholder in line and "point model.hf_path (--hf, --model) at the HF checkpoint directory" in line, line
    hf = os.path.join(REPO, "examples", "configs", "hf", "SDAR-1dot7B-Chat")
    line = refused(capsys, "convert", "hf-to-megatron", "--hf", hf, "--out", str(tmp_path / "out"))
    assert "the recipes' placeholders under examples/configs/hf/" in line, line
    assert not (tmp_path / "out").exists()
