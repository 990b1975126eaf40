"""The command line as users from DARE / dLLM-RL / verl / Megatron-LM / torchrun type it: every wrong input fails in
one line that names what was typed and what to write instead (exit status 2), and the table of other projects'
keys (megadare/config/foreign.py) names only megadare keys that exist."""

from __future__ import annotations

import argparse
import os
import runpy
from dataclasses import fields, is_dataclass

import pytest

from megadare.algos import REGISTRY
from megadare.algos.algorithm import COMMON
from megadare import demo
from megadare.cli import CONFIG_COMMANDS, _parser, main
from megadare.config import Config, load_config
from megadare.config.foreign import ORIGINS
from megadare.errors import ConfigError

DEMO = "megadare/configs/demo_rl.yaml"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _error_line(capsys, argv: list[str]) -> str:
    """The one stderr line of ``megadare argv`` (exit status 2, nothing on stdout)."""
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2, (argv, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


OPTIONS = [
    (["--tp", "4"], "unknown option '--tp 4': config keys are set as key=value; did you mean parallel.tp=4?"),
    (["--tp=4"], "unknown option '--tp=4': config keys are set as key=value; did you mean parallel.tp=4?"),
    (["--lr", "1e-6"], "unknown option '--lr 1e-6': config keys are set as key=value; did you mean optim.lr=1e-6?"),
    (
        ["--steps", "10"],
        "unknown option '--steps 10': config keys are set as key=value; did you mean train.steps=10 or rl.steps=10?",
    ),
    (
        ["--tensor-model-parallel-size", "2"],
        "unknown option '--tensor-model-parallel-size 2': config keys are set as key=value; that is Megatron-LM / "
        "torchrun's; megadare: parallel.tp=2",
    ),
    (
        ["--sequence-parallel", "parallel.pp=2"],
        "unknown option '--sequence-parallel': config keys are set as key=value; that is Megatron-LM / torchrun's; "
        "megadare: parallel.sp=true",
    ),
    (
        ["--moe-grouped-gemm"],
        "unknown option '--moe-grouped-gemm': config keys are set as key=value; that is Megatron-LM / torchrun's; "
        "megadare: train.grouped_experts=true (torch's grouped GEMM over SequentialMLP's weights)",
    ),
    (
        ["--nproc_per_node", "2"],
        "unknown option '--nproc_per_node 2': that is Megatron-LM / torchrun's; "
        "megadare: --nproc 2 (or torchrun --nproc_per_node 2 -m megadare ...)",
    ),
    (
        ["--model", "/ckpt"],
        "unknown option '--model /ckpt': config keys are set as key=value; that is megadare eval's; "
        "megadare: model.hf_path=/ckpt",
    ),
    (["--nprocs", "2"], "unknown option '--nprocs 2': did you mean --nproc?"),
    (["--dry_run"], "unknown option '--dry_run': did you mean --dry-run?"),
]


@pytest.mark.parametrize("typed,line", OPTIONS, ids=[" ".join(t) for t, _ in OPTIONS])
def test_an_unknown_option_names_what_to_write(capsys, typed, line):
    assert _error_line(capsys, ["rl", "--config", DEMO, *typed, "--dry-run", "--config-only"]) == (
        f"megadare: error: {line}"
    )


def test_argparse_errors_are_one_line(capsys):
    line = _error_line(capsys, ["rl", "--config", DEMO, "--nproc", "two"])
    assert line == "megadare rl: error: argument --nproc: invalid int value: 'two' (see megadare rl --help)"


@pytest.mark.parametrize(
    "typed,line",
    [
        (
            ["--tp", "4"],
            "megadare: error: unknown option '--tp 4': config keys are set as key=value; did you mean parallel.tp=4?",
        ),
        (
            ["--rl-steps", "x"],
            "megadare demo: error: argument --rl-steps: invalid int value: 'x' (see megadare demo --help)",
        ),
    ],
)
def test_the_demo_refuses_an_option_in_one_line(capsys, typed, line):
    """The demo parses its own options: before, an unknown one printed argparse's usage block."""
    assert _error_line(capsys, ["demo", *typed]) == line


OVERRIDES = [
    ("tp=4", "unknown config key 'tp' (tp=4): did you mean parallel.tp=4?"),
    (
        "parallel.tpp=4",
        "unknown config key 'parallel.tpp' (parallel.tpp=4): did you mean parallel.tp=4 or parallel.pp=4 or "
        "parallel.vpp=4?",
    ),
    ("parallel.tp=four", "parallel.tp='four' is not an integer (in override parallel.tp=four)"),
    ("parallel.sp=maybe", "parallel.sp='maybe' is not true or false (in override parallel.sp=maybe)"),
    (
        "parallel=4",
        "override 'parallel=4': parallel is a section, not a key; set one of its keys: parallel.tp, parallel.pp, "
        "parallel.vpp, parallel.ep, parallel.etp, parallel.cp, parallel.sp, parallel.world_size, "
        "parallel.collective_timeout_s",
    ),
    (
        "+rl.steps=3",
        "override '+rl.steps=3': megadare's keys take no Hydra prefix (every key exists); write rl.steps=3",
    ),
    (
        "actor_rollout_ref.rollout.n=8",
        "unknown config key 'actor_rollout_ref.rollout.n' (actor_rollout_ref.rollout.n=8): that is verl/DARE's; "
        "megadare: rl.n_samples=8",
    ),
    (
        "data.train_batch_size=64",
        "unknown config key 'data.train_batch_size' (data.train_batch_size=64): that is verl/DARE's; "
        "megadare: rl.prompts_per_step=64",
    ),
    (
        "trainer.total_epochs=2",
        "unknown config key 'trainer.total_epochs' (trainer.total_epochs=2): that is verl/DARE's; megadare: "
        "rl.steps=<2 x training prompts // rl.prompts_per_step> (RL steps, not epochs)",
    ),
    (
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "unknown config key 'actor_rollout_ref.actor.optim.lr' (actor_rollout_ref.actor.optim.lr=1e-6): that is "
        "verl/DARE's; megadare: optim.lr=1e-6",
    ),
    (
        "+actor_rollout_ref.actor.mc_num=16",
        "unknown config key 'actor_rollout_ref.actor.mc_num' (+actor_rollout_ref.actor.mc_num=16): that is "
        "verl/DARE's; megadare: algo.params.n_mc=16",
    ),
    (
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "unknown config key 'actor_rollout_ref.actor.kl_loss_type' (actor_rollout_ref.actor.kl_loss_type=low_var_kl):"
        " that is verl/DARE's; megadare: algo.params.kl_estimator=k3",
    ),
    (
        "rollout.num_task_per_step=64",
        "unknown config key 'rollout.num_task_per_step' (rollout.num_task_per_step=64): that is dLLM-RL's; "
        "megadare: rl.prompts_per_step=64",
    ),
    (
        "training.method=coupled",
        "unknown config key 'training.method' (training.method=coupled): that is dLLM-RL's; "
        "megadare: algo.name=random_mask_rl algo.params.couple=true",
    ),
    (  # DARE's SFT recipes: its datasets train on the pads, megadare only when told
        "model.partial_pretrain=models/SDAR-8B-Chat",
        "unknown config key 'model.partial_pretrain' (model.partial_pretrain=models/SDAR-8B-Chat): that is "
        "verl/DARE's; megadare: model.hf_path=models/SDAR-8B-Chat (DARE's SFT datasets pad every answer to "
        "data.max_length and train on the pads: sft.pad_response=eos for LLaDA, pad for SDAR and Dream; LLaDA2's "
        "pads are not trained)",
    ),
    (  # dLLM-RL's SFT configs (configs/sft_*.yaml) use the RL keys for the SFT objective
        "training.lower_p=0.1",
        "unknown config key 'training.lower_p' (training.lower_p=0.1): that is dLLM-RL's; megadare: "
        "algo.params.p_low=0.1 (algo.name=random_mask_rl; in its SFT, the masking probability's low end: "
        "sft.noise_low=0.1 sft.weighting=none)",
    ),
    (
        "config=configs/rl_sdar.yaml",
        "unknown config key 'config' (config=configs/rl_sdar.yaml): that is dLLM-RL's; "
        "megadare: --config configs/rl_sdar.yaml",
    ),
    (  # verl steps its schedule once per RL step, megadare once per optimizer update
        "actor_rollout_ref.actor.optim.lr_warmup_steps=10",
        "unknown config key 'actor_rollout_ref.actor.optim.lr_warmup_steps' "
        "(actor_rollout_ref.actor.optim.lr_warmup_steps=10): that is verl/DARE's; megadare: "
        "optim.warmup_steps=<10 x rl.ppo_epochs x rl.mini_batches> (verl counts RL steps, megadare optimizer updates)",
    ),
    ("trainer.seed=1", "unknown config key 'trainer.seed' (trainer.seed=1): did you mean seed=1?"),
    (
        "rl.foo=1",
        "unknown config key 'rl.foo' (rl.foo=1): the keys of rl: steps, prompts_per_step, n_samples, ppo_epochs, "
        "redraw_corruptions, canvas, mini_batches, eval_interval, eval_size",
    ),
    # a value that is no YAML (an unclosed bracket) ended in yaml's ParserError traceback
    (
        "advantage.accuracy_band=[0.2,",
        "override 'advantage.accuracy_band=[0.2,': the value is not valid YAML (did not find expected node content); "
        "close its brackets or quote it (e.g. advantage.accuracy_band=[0.2,0.8])",
    ),
]


@pytest.mark.parametrize("override,line", OVERRIDES, ids=[o for o, _ in OVERRIDES])
def test_a_wrong_override_names_what_to_write(capsys, override, line):
    assert _error_line(capsys, ["rl", "--config", DEMO, override, "--dry-run", "--config-only"]) == (
        f"megadare: error: {line}"
    )


def test_the_warmup_is_bounded_by_the_updates_of_the_command_that_runs(capsys):
    """``optim.warmup_steps`` counts optimizer updates: an RL run makes rl.steps x ppo_epochs x mini_batches of them
    (the demo: 30 x 1 x 2 = 60), an SFT run train.steps. The bound once was SFT's train.steps (100) for every
    command: a warmup over 2/3 of this RL run was refused naming train.steps, one 10x longer than it passed."""
    assert (
        main(["rl", "--config", DEMO, "rl.mini_batches=2", "optim.warmup_steps=60", "--dry-run", "--config-only"]) == 0
    )
    capsys.readouterr()
    assert _error_line(capsys, ["rl", "--config", DEMO, "optim.warmup_steps=90", "--dry-run", "--config-only"]) == (
        "megadare: error: optim.warmup_steps=90 counts optimizer updates and must be within [0, 30] "
        "(rl.steps=30 x rl.ppo_epochs=1 x rl.mini_batches=1: the updates of this run)"
    )
    sft = ["sft", "--config", "megadare/configs/demo_sft.yaml", "train.steps=20", "--dry-run", "--config-only"]
    assert _error_line(capsys, [*sft, "optim.warmup_steps=21"]) == (
        "megadare: error: optim.warmup_steps=21 counts optimizer updates and must be within [0, 20] "
        "(train.steps=20: the updates of this run)"
    )


def test_a_key_of_nowhere_lists_the_sections_not_every_key():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["foo.bar=1"])
    assert str(e.value).startswith("unknown config key 'foo.bar' (foo.bar=1): the sections: model, parallel, ")
    assert len(str(e.value)) < 300  # the old message listed all ~250 keys


FILES = [
    (
        "model:\n\tfamily: sdar\n",
        "is not valid YAML: a tab at line 2, column 1 ('family: sdar'): YAML indents with "
        "spaces; replace the tab with spaces",
    ),
    (
        "model:\n  family: sdar\n   tiny: true\n",
        "is not valid YAML: mapping values are not allowed in this context at line 3, column 8 ('tiny: true'): the "
        "keys of one section must be indented by the same number of spaces",
    ),
    # an empty file (or comments only) ran on every default without a word
    ("", "config file '{path}' holds no settings (empty or comments only)"),
    ("# TODO: fill in\n", "config file '{path}' holds no settings (empty or comments only)"),
    ("parallel:\ntp: 2\n", "section 'parallel' holds nothing (are its keys indented under it?); set one of its keys: "),
    ("parallel:\n  tp: two\n", "parallel.tp='two' is not an integer (in {path})"),
    (
        # a verl / DARE config: the first key megadare knows another meaning for, and how many more are unknown
        "trainer:\n  project_name: x\n  total_training_steps: 80\nactor_rollout_ref:\n  rollout:\n    n: 8\n",
        "unknown config key 'trainer.total_training_steps' in {path} (2 more unknown keys): that is verl/DARE's; "
        "megadare: rl.steps=80",
    ),
    (
        # dLLM-RL's configs/rl_sdar.yaml, abridged
        "wandb:\n  entity: null\nexperiment:\n  total_step: 80\nrollout:\n  num_response_per_task: 16\n"
        "training:\n  method: TraceRL\n",
        "unknown config key 'experiment.total_step' in {path} (3 more unknown keys): that is dLLM-RL's; "
        "megadare: rl.steps=80",
    ),
]


@pytest.mark.parametrize(
    "text,line", FILES, ids=["tab", "indent", "empty", "comments", "flat section", "type", "verl", "dllm_rl"]
)
def test_a_wrong_config_file_names_the_line_or_key(capsys, tmp_path, text, line):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    got = _error_line(capsys, ["rl", "--config", str(path), "--dry-run", "--config-only"])
    assert got.startswith("megadare: error: ") and line.format(path=path) in got


def test_a_missing_config_file(capsys):
    line = _error_line(capsys, ["rl", "--config", "missing.yaml", "--dry-run", "--config-only"])
    assert line == "megadare: error: config file 'missing.yaml' not found"


@pytest.mark.parametrize("command", CONFIG_COMMANDS)
def test_help_says_how_keys_are_set(capsys, command):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "as key=value (parallel.tp=4 optim.lr=1e-6, not --tp 4)" in out
    assert f"megadare {command} --config FILE --dry-run --config-only" in out


def _options_without_help(parser: argparse.ArgumentParser, path: str):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _options_without_help(sub, f"{path} {name}")
        elif not a.help and a.nargs != argparse.REMAINDER and not isinstance(a, argparse._HelpAction):
            yield f"{path} {'/'.join(a.option_strings) or a.dest}"


def test_every_option_says_what_it_does():
    """``--help`` of every command explains each of its options (a newcomer reads it before the README)."""
    assert list(_options_without_help(_parser(), "megadare")) == []
    assert list(_options_without_help(demo.parser(), "megadare demo")) == []
    built = []
    with pytest.MonkeyPatch.context() as mp:  # the quantize tool builds its parser inside parse_args
        mp.setattr(argparse.ArgumentParser, "parse_args", lambda self, *a, **k: built.append(self))
        runpy.run_path(os.path.join(ROOT, "tools", "checkpoint_convert", "quantize.py"))["parse_args"]([])
    assert [o for p in built for o in _options_without_help(p, "quantize.py")] == []


def _algo_params() -> set[str]:
    return set(COMMON).union(*(cls.defaults for cls in REGISTRY.values()))


def _fixes():
    for origin, table in ORIGINS.items():
        for key, fix in table.items():
            for text in fix.values() if isinstance(fix, dict) else [fix]:
                yield origin, key, text


@pytest.mark.parametrize("origin,key,fix", list(_fixes()), ids=[f"{k}:{f}" for _, k, f in _fixes()])
def test_every_foreign_fix_names_a_megadare_key_or_option(origin, key, fix):
    """Each fix's overrides (before a note in parentheses) set keys megadare has (an algorithm's parameter for
    ``algo.params.*``), or name one of its options; those without a value to compute load as they are."""
    words = fix.split(" (")[0].split()
    if words[0].startswith("--"):
        assert words[0] in ("--config", "--nproc"), fix
        return
    overrides = [w for w in words if "=" in w]
    assert overrides or fix.startswith("nothing: "), fix
    for ov in overrides:
        target, _, value = ov.partition("=")
        if target.startswith("algo.params."):
            assert target.removeprefix("algo.params.") in _algo_params(), fix
        else:
            assert _is_key(target), fix
            if "<" not in value and "{v}" not in value:
                load_config(None, [ov])  # the value too: a typed choice, a bool


def _is_key(dotted: str) -> bool:
    obj = Config()
    for part in dotted.split("."):
        if not is_dataclass(obj) or part not in {f.name for f in fields(obj)}:
            return False
        obj = getattr(obj, part)
    return not is_dataclass(obj)


def test_a_peer_error_is_the_last_line_after_what_ray_printed_on_stdout():
    """Ray prints a dead raylet's log tail on stdout; in a pipe or a log file (``megadare rl > log 2>&1``) stdout is
    block-buffered and was written at exit, after the run's one-line error on stderr. The error now comes last."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, megadare.cli as cli\n"
        "from megadare.errors import PeerError\n"
        "def run(args):\n"
        "    print('(raylet) Raylet is terminated. Last 20 lines of the Raylet logs: ...')\n"
        "    raise PeerError('rollout engine 0 cannot be placed: Ray node 10.0.0.3 died')\n"
        "cli._dispatch = run\n"
        "sys.exit(cli.main(['rl', '--config', 'examples/configs/sdar_tiny.yaml']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as a plain shell runs it
    out = subprocess.run(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120, env=env
    )
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 2, out.stdout
    assert lines[-1] == "megadare: error: rollout engine 0 cannot be placed: Ray node 10.0.0.3 died", lines
    assert any(ln.startswith("(raylet) Raylet is terminated") for ln in lines), lines


VALUES_AS_TYPED = [
    # a value given by an option is named by that option, not by the config key it sets
    (["eval", "--model", "/no/such/ckpt"], "--model '/no/such/ckpt' is not a directory; point it at an HF checkpoint"),
    (
        ["eval", "--model", "/no/such/ckpt", "--dry-run", "--config-only"],
        "--model '/no/such/ckpt' is not a directory",
    ),
    (["eval", "model.hf_path=/no/such/ckpt"], "model.hf_path='/no/such/ckpt' is not a directory"),
    (["convert", "hf-to-megatron", "--hf", "/no/such", "--out", "x", "--tp", "0"], "argument --tp: 0 must be a"),
    (["convert", "hf-to-megatron", "--hf", "/no/such", "--out", "x", "--vpp", "-1"], "argument --vpp: -1 must be"),
    (["convert", "hf-to-megatron", "--hf", "/no/such", "--out", "x", "--vpp", "2"], "--vpp=2 needs --pp > 1"),
]


@pytest.mark.parametrize("argv, named", VALUES_AS_TYPED)
def test_a_value_is_named_as_the_user_typed_it(capsys, argv, named):
    line = _error_line(capsys, argv)
    assert named in line and (argv[1] != "--model" or "model.hf_path" not in line), line


def test_a_relative_model_path_says_what_it_is_relative_to(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = _error_line(capsys, ["eval", "--model", "ckpt/hf"])
    assert f"--model 'ckpt/hf' is not a directory (relative to the current directory {tmp_path})" in line


@pytest.mark.parametrize(
    "path, said",
    [
        (
            "data/preprocessed/sft/x.jsonl",
            "in the current directory {cwd}; DARE's example paths are relative to a DARE checkout: run from the",
        ),
        ("nope.jsonl", "nope.jsonl: data file not found in the current directory {cwd}; check the path"),
        ("/no/such.jsonl", "/no/such.jsonl: data file not found; check the path"),
        (".", ".: is a directory, not a data file; name a .jsonl / .json / .parquet file in it"),
    ],
)
def test_data_inspect_says_which_path_and_what_to_do(capsys, tmp_path, monkeypatch, path, said):
    monkeypatch.chdir(tmp_path)
    line = _error_line(capsys, ["data", "inspect", path])
    assert said.format(cwd=tmp_path) in line, line


def test_an_unknown_task_given_by_tasks_is_named_by_the_option(capsys, tmp_path):
    argv = [
        "eval",
        "--tasks",
        "gsm8kk",
        "--dry-run",
        "model.family=sdar",
        "model.tiny=true",
        f"eval.data_dir={tmp_path}",
    ]
    line = _error_line(capsys, argv)
    assert "--tasks: unknown task 'gsm8kk'; did you mean 'gsm8k'?" in line and "eval.tasks" not in line, line


def test_a_config_only_dry_run_refuses_an_unknown_task(capsys):
    """`eval --tasks gsm8kk --dry-run --config-only` passed: the task names were checked with the task files only."""
    line = _error_line(capsys, ["eval", "--tasks", "gsm8kk", "--dry-run", "--config-only"])
    assert "--tasks: unknown task 'gsm8kk'; did you mean 'gsm8k'?" in line, line
    assert main(["eval", "--tasks", "gsm8k,/cluster/held.jsonl", "--dry-run", "--config-only"]) == 0  # not here


def test_a_config_only_dry_run_refuses_an_unknown_built_in_reward(capsys):
    """`rl --dry-run --config-only rewards.name=gsm8kk` passed: the reward's name was checked with the data only."""
    argv = ["rl", "--config", DEMO, "--dry-run", "--config-only", "rewards.name=gsm8kk"]
    assert "rewards.name: unknown reward 'gsm8kk': did you mean 'gsm8k'?" in _error_line(capsys, argv)


def test_data_inspect_names_the_reward_option(capsys, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    line = _error_line(capsys, ["data", "inspect", str(rows), "--reward", "gsm8kk"])
    assert "--reward gsm8kk: unknown reward 'gsm8kk': did you mean 'gsm8k'?" in line, line


def test_a_file_given_for_an_hf_checkpoint_says_the_fix(capsys, tmp_path):
    """`convert hf-to-megatron --hf weights.bin` said only 'not valid JSON (Expecting value ...)'."""
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"\x00\x01")
    argv = ["convert", "hf-to-megatron", "--hf", str(weights), "--out", str(tmp_path / "out")]
    line = _error_line(capsys, argv)
    assert f"{weights}: not valid JSON" in line and "point to an HF checkpoint directory (its config.json)" in line
