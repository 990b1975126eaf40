"""``--dry-run`` checks what will run, before Ray and torchrun start (issue 24, items 4, 6, 8): the memory plan on the
declared cluster (and ``megadare plan`` exits non-zero when it does not fit), the model's weights and tokenizer,
``checkpoint.load``, the data rows and their length, the reward, the engine, the eval section and the run
directory -- each failure one line naming the file, row or key. RL prompts longer than the prompt budget follow
``data.overlong`` when loaded, naming file and row."""

from __future__ import annotations

import json
import os

import pytest

from megadare.cli import main
from tiny import write_tiny_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RL = os.path.join(ROOT, "megadare", "configs", "demo_rl.yaml")  # tiny SDAR, max_length 24, 4 new tokens
SFT = os.path.join(ROOT, "examples", "configs", "sft_sdar_tiny.yaml")


def rows(path, *prompts) -> str:
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p, "answer": "2"}) + "\n")
    return str(path)


def dry(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


def refused(capsys, *argv) -> str:
    rc, _, err = dry(capsys, *argv)
    assert rc == 2 and err.count("megadare: error:") == 1, err
    return err


@pytest.fixture
def data(tmp_path):
    return rows(tmp_path / "p.jsonl", "1+1?", "2+2?")


def rl(tmp_path, data, *over) -> list[str]:
    return [
        "rl",
        "--dry-run",
        "--config",
        RL,
        "data.synthetic=null",
        f"data.path={data}",
        f"logging.run_dir={tmp_path / 'run'}",
        *over,
    ]


def test_a_runnable_config_passes_and_prints_itself(tmp_path, data, capsys):
    rc, out, err = dry(capsys, *rl(tmp_path, data))
    assert rc == 0 and "max_length: 24" in out, err


def test_data_rows_are_checked(tmp_path, data, capsys):
    assert "nope.jsonl: data file not found" in refused(capsys, *rl(tmp_path, str(tmp_path / "nope.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "oops"\n')
    assert "bad.jsonl:2: invalid JSON" in refused(capsys, *rl(tmp_path, str(bad)))
    eval_missing = refused(capsys, *rl(tmp_path, data, f"data.eval_path={tmp_path / 'held.jsonl'}"))
    assert "held.jsonl: data file not found" in eval_missing
    long = rows(tmp_path / "long.jsonl", "1+1?", "what is " + "one plus " * 10 + "one?")
    err = refused(capsys, *rl(tmp_path, long, "data.overlong=error"))
    assert "long.jsonl:2: prompt has 105 tokens, more than 20 (data.max_length minus rollout.max_new_tokens)" in err
    rc, _, err = dry(capsys, *rl(tmp_path, long))  # truncate (the default): said, not refused
    assert rc == 0 and "data.overlong=truncate applies to 1 of the first 2 prompts" in err
    assert "leaves no room for a prompt" in refused(capsys, *rl(tmp_path, data, "rollout.max_new_tokens=24"))
    sft_long = tmp_path / "sft.jsonl"
    sft_long.write_text(json.dumps({"prompt": "a" * 10, "response": "b" * 40}) + "\n")
    err = refused(
        capsys,
        "sft",
        "--dry-run",
        "--config",
        SFT,
        "data.synthetic=null",
        f"data.path={sft_long}",
        "data.overlong=error",
        f"logging.run_dir={tmp_path / 'sft'}",
    )
    assert "sft.jsonl:1: example is 54 tokens (prompt 13 + response 41), longer than max_len=24" in err


def test_reward_and_engine_are_resolved(tmp_path, data, capsys):
    assert "reward 'no_such_pkg.mod:fn': module 'no_such_pkg.mod' not found" in refused(
        capsys, *rl(tmp_path, data, "rl.reward=no_such_pkg.mod:fn")
    )
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"prompt": "1+1?", "answer": "2", "data_source": "chess"}) + "\n")
    assert f"{odd}:1: rewards.name=auto has no rule for data_source='chess'" in refused(
        capsys, *rl(tmp_path, str(odd), "rl.reward=auto")
    )
    pytest.importorskip("megadare")  # (sglang is not installed in CI's CPU environment)
    try:
        import sglang  # noqa: F401
    except ImportError:
        assert "rollout.engine=sglang: the SGLang rollout engine needs sglang" in refused(
            capsys, *rl(tmp_path, data, "rollout.engine=sglang")
        )


def test_model_weights_tokenizer_and_initial_checkpoint(tmp_path, data, capsys):
    hf = write_tiny_hf(tmp_path, "sdar", seed=1, block_size=4)
    over = [f"model.hf_path={hf}", "model.tiny=false", "model.family=null"]
    err = refused(capsys, *rl(tmp_path, data, *over))
    assert f"model.hf_path={hf} has no tokenizer (none of tokenizer.json" in err
    with open(os.path.join(hf, "model.safetensors"), "r+b") as f:  # a corrupt header: named, one line
        f.write(b"\xff" * 16)
    assert f"{hf}/model.safetensors: not a readable safetensors file" in refused(capsys, *rl(tmp_path, data, *over))
    os.remove(os.path.join(hf, "model.safetensors"))
    assert f"{hf}: no model.safetensors" in refused(capsys, *rl(tmp_path, data, *over))
    llada = write_tiny_hf(tmp_path, "llada", seed=1)
    ckpt = tmp_path / "llada_mcore"
    assert main(["convert", "hf-to-megatron", "--hf", llada, "--out", str(ckpt)]) == 0
    capsys.readouterr()
    err = refused(capsys, *rl(tmp_path, data, f"checkpoint.load={ckpt}"))
    assert f"{ckpt} is a checkpoint of a llada model (LLaDAModelLM); this run builds a sdar model" in err


def test_a_tiny_model_whose_vocabulary_the_byte_tokenizer_cannot_decode_is_refused_for_rl(tmp_path, data, capsys):
    """RL samples every id of the model: a tiny model with more ids than the byte tokenizer (256) failed at the
    first decode, mid-run, with a traceback; now the check refuses it first (SFT never decodes samples)."""
    err = refused(capsys, *rl(tmp_path, data, "model.tiny_config={vocab_size: 4096}"))
    assert "model.tiny_config: vocab_size 4096 is larger than the byte tokenizer's 256 ids" in err
    rc, _, _ = dry(
        capsys,
        "sft",
        "--dry-run",
        "--config",
        "megadare/configs/demo_sft.yaml",
        f"logging.run_dir={tmp_path / 'sft'}",
        "model.tiny_config={vocab_size: 4096}",
    )
    assert rc == 0


def test_the_memory_plan_must_fit_and_plan_exits_nonzero_when_it_does_not(tmp_path, data, capsys):
    err = refused(capsys, *rl(tmp_path, data, "plan.gpu_memory_gb=3.01"))
    assert "the memory plan does not fit: peak" in err and "on 1 x 8 GPUs of 3.01 GB (plan.*)" in err
    rc, out, _ = dry(capsys, "plan", "--config", RL, "plan.gpu_memory_gb=3.01")
    assert rc == 1 and "DOES NOT FIT" in out
    rc, out, _ = dry(capsys, "plan", "--config", RL)
    assert rc == 0 and ": fits" in out


def test_grouped_experts_on_a_dense_model_is_refused(tmp_path, capsys):
    """``train.grouped_experts`` chooses how MoE experts run (models/experts.py); on a dense model nothing reads it."""
    argv = ["sft", "--dry-run", "--config", SFT, f"logging.run_dir={tmp_path / 'sft'}"]
    assert dry(capsys, *argv)[0] == 0
    err = refused(capsys, *argv, "train.grouped_experts=true")
    assert "train.grouped_experts=true: the sdar model is dense and has no MoE experts" in err, err
    moe = ["model.family=sdar_moe", "train.grouped_experts=false"]
    assert dry(capsys, *argv, *moe)[0] == 0


def test_eval_settings_and_files(tmp_path, capsys):
    fixtures = os.path.join(ROOT, "tests", "fixtures", "eval")

    def base(task: str, data_dir: str) -> list[str]:
        return [
            "eval",
            "--dry-run",
            "--tasks",
            task,
            "model.family=sdar",
            "model.tiny=true",
            "model.block_size=4",
            f"eval.data_dir={data_dir}",
            f"logging.run_dir={tmp_path}",
        ]

    rc, _, err = dry(capsys, *base("gsm8k", fixtures))
    assert rc == 0, err
    assert "eval.k=[4]: k=4 > eval.n_samples=1" in refused(capsys, *base("gsm8k", fixtures), "eval.k=[4]")
    err = refused(capsys, *base("math500", str(tmp_path)))
    assert f"{tmp_path}/math500.jsonl or {tmp_path}/math500.parquet: data file of task 'math500' not found" in err


def test_a_run_directory_in_use_is_refused(tmp_path, data, capsys):
    import socket
    import subprocess
    import sys

    import psutil

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run = tmp_path / "run"
        run.mkdir()
        (run / "megadare.lock").write_text(
            json.dumps(
                {"pid": holder.pid, "host": socket.gethostname(), "started": psutil.Process(holder.pid).create_time()}
            )
        )
        assert f"{run} is in use by pid {holder.pid}" in refused(capsys, *rl(tmp_path, data))
    finally:
        holder.kill()
        holder.wait()
    (run / "megadare.lock").unlink()
    (run / "config.yaml").write_text("rl:\n  n_samples: 4\n")  # the user's own, not a run's resolved config
    assert f"{run}/config.yaml was not written by a megadare run" in refused(capsys, *rl(tmp_path, data))


def test_a_value_checkpoint_root_in_use_is_refused(tmp_path, data, capsys):
    """TraceRL with a value model locks <root>_value for the run, but --dry-run (and the Slurm preflight) checked
    only the run directory and the checkpoint root: a second job passed, then failed at start. It is refused."""
    import socket
    import subprocess
    import sys

    import psutil

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        value = tmp_path / "run" / "ckpt_value"
        value.mkdir(parents=True)
        (value / "megadare.lock").write_text(
            json.dumps(
                {"pid": holder.pid, "host": socket.gethostname(), "started": psutil.Process(holder.pid).create_time()}
            )
        )
        tracerl = ("algo.name=tracerl", "algo.params.value_model=true")
        assert f"{value} is in use by pid {holder.pid}" in refused(capsys, *rl(tmp_path, data, *tracerl))
        assert dry(capsys, *rl(tmp_path, data))[0] == 0  # without a value model <root>_value is not the run's
    finally:
        holder.kill()
        holder.wait()


def test_rl_prompts_over_the_budget_follow_data_overlong_when_loaded(tmp_path, capsys):
    from megadare.config import load_config
    from megadare.data.files import DataError
    from megadare.data.prompt_data import load_rl_prompts
    from megadare.data.tokenizer import ByteTokenizer

    path = rows(tmp_path / "p.jsonl", "1+1?", "x" * 40, "2+2?")
    tok = ByteTokenizer()
    cfg = load_config(None, [f"data.path={path}", "data.overlong=error"])
    with pytest.raises(DataError, match=r"p.jsonl:2: prompt has \d+ tokens, more than 20"):
        load_rl_prompts(cfg, tok, 20)
    cfg = load_config(None, [f"data.path={path}", "data.overlong=drop"])
    train, _ = load_rl_prompts(cfg, tok, 20)
    assert [p.where for p in train] == [f"{path}:1", f"{path}:3"]
    assert "data: left out 1 prompts longer than 20 tokens" in capsys.readouterr().err
    cfg = load_config(None, [f"data.path={path}"])  # truncate: keep the end
    train, _ = load_rl_prompts(cfg, tok, 20)
    full = tok.chat_prompt([{"role": "user", "content": "x" * 40}])
    assert len(train) == 3 and train[1].prompt_ids == full[-20:]
    assert "kept the last tokens of 1 prompts longer than 20 tokens" in capsys.readouterr().err


def test_code_rewards_need_the_sandbox_before_anything_starts(tmp_path, data, capsys, monkeypatch):
    """A run whose reward runs programs checks at pre-flight that the kernel accepts the code sandbox (as RL and eval
    set-up do), so a Slurm job does not start only to be refused at its first scored step."""
    import megadare.rewards as rewards

    calls = []

    def refuse(mode=None):
        calls.append(mode)
        raise rewards.SandboxUnavailable(
            "sandbox: this machine refused the OS isolation (unshare: Operation not "
            "permitted). Set rewards.code.isolation=process to accept the weaker guard"
        )

    monkeypatch.setattr(rewards, "check_isolation", refuse)
    err = refused(capsys, *rl(tmp_path, data, "rl.reward=code"))
    assert "rewards.code.isolation=process" in err and len(calls) == 1
    rc, _, _ = dry(capsys, *rl(tmp_path, data, "rl.reward=exact_match"))  # no program runs: not checked
    assert rc == 0 and len(calls) == 1


@pytest.mark.parametrize("source", ["file", "synthetic"])
def test_an_unknown_reward_is_refused_naming_its_key(tmp_path, data, capsys, source):
    """A generated task (data.synthetic) has no file to check, but its reward must resolve all the same."""
    argv = rl(tmp_path, data, "rewards.name=exact_mach")
    if source == "synthetic":
        argv = ["rl", "--dry-run", "--config", RL, f"logging.run_dir={tmp_path / 'run'}", "rewards.name=exact_mach"]
    assert "rewards.name: unknown reward 'exact_mach': did you mean 'exact_match'?" in refused(capsys, *argv)
