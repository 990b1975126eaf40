"""The config tree: bad configs fail with their own message, overrides beat the file, YAML round trips."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest

from megadare import cli
from megadare.config import load_config, to_yaml
from megadare.trainer.checks import validate
from megadare.parallel.layout import Layout
from megadare.errors import ConfigError
from megadare.models import get_family
from megadare.rollout.weight_sync.sync import SyncSettings


def validate_layout(arch, world_size=None, **sizes):
    Layout(world=world_size, **sizes).check_model(arch)


def _arch(name="sdar_moe", **over):
    fam = get_family(name)
    return fam.arch(fam.tiny_config(**over))


BAD_OVERRIDES = [
    (["parallel.tpp=2"], "did you mean parallel.tp=2"),
    (["parallel.tp=two"], "parallel.tp"),
    (["model.dtype=fp8"], "model.dtype='fp8' is not one of fp32, bf16, fp16"),
    (["model.attention_backend=xformers"], "model.attention_backend"),
    (["parallel.tp=0"], "parallel.tp=0 must be a positive integer"),
    (["parallel.tp"], "must look like key=value"),
]


@pytest.mark.parametrize("overrides,message", BAD_OVERRIDES)
def test_bad_overrides(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


BAD_LAYOUTS = [
    (dict(tp=3), "4 attention heads, not divisible by 3"),
    (dict(tp=4), "2 key/value heads"),
    (dict(ep=3), "8 experts, not divisible by 3"),
    (dict(pp=3), "2 layers do not split evenly into 3 stages"),
    (dict(pp=2, vpp=2), "into 4 stages"),
    (dict(vpp=2), "vpp=2 needs parallel.pp > 1"),
    (dict(tp=1, sp=True), "sp=true needs parallel.tp > 1"),
    (dict(tp=2, world_size=3), "world_size=3 is not divisible by tp\\*pp\\*cp=2"),
    (dict(ep=4, world_size=2), "not divisible by etp\\*ep\\*pp=4"),
    (dict(etp=3), "expert width 32"),
    (dict(tp=2, cp=4), "splits the 2 attention heads per TP rank over 4 ranks"),
]


@pytest.mark.parametrize("layout,message", BAD_LAYOUTS)
def test_bad_layouts(layout, message):
    with pytest.raises(ConfigError, match=message):
        validate_layout(_arch(), **layout)


SFT_BAD = [
    (["train.lr=0"], "train.lr=0.0"),
    (["sft.noise_low=0"], "noise_low=0.0"),
    (["train.warmup_steps=500", "train.steps=10"], "warmup_steps=500"),
    (["sft.lora_rank=-1"], "lora_rank=-1"),
    (["data.max_length=300", "train.seq_length=512"], "rows of up to 600 tokens"),
    (["train.seq_length=63", "parallel.cp=2", "data.max_length=16"], "divisible by parallel.cp=2"),
    (["sft.mode=diffusion"], "sft.mode='diffusion' is not one of"),
    (["model.family=llada2", "parallel.tp=2"], "needs parallel.sp=true"),
    (["data.overlong=cut"], "data.overlong"),
    (["rollout.fp8_weights=true"], "rollout.fp8_weights=true"),
    (["rl.mode=async"], "rl.mode='async' is not one of"),
    (["rl.rollout_is=tokens"], "rl.rollout_is"),
    (["replay.k=0"], "replay.k=0"),
]


@pytest.mark.parametrize("overrides,message", SFT_BAD)
def test_bad_training_settings(overrides, message):
    from megadare.trainer.checks import validate

    with pytest.raises(ConfigError, match=message):
        cfg = load_config(None, ["model.family=sdar", "model.tiny=true"] + overrides)
        validate(cfg, _arch(cfg.model.family))


def test_ep_on_dense_model():
    with pytest.raises(ConfigError, match="no experts"):
        validate_layout(_arch("sdar"), ep=2)


def test_block_size_on_full_attention_family():
    cfg = load_config(None, ["model.block_size=4"])
    with pytest.raises(ConfigError, match="full attention"):
        validate(cfg, _arch("llada"))


def test_model_rule_named_before_the_world_size():
    """A layout both the model and the world refuse names the model's key first (the slurm preflight test's
    expectation): ep=3 on 8 experts in one process is an expert-count error, not a world-size one."""
    cfg = load_config(None, ["model.family=llada2", "parallel.ep=3", "parallel.world_size=1"])
    fam = get_family("llada2")
    with pytest.raises(ConfigError, match=r"parallel.ep=3: model has 8 experts, not divisible by 3"):
        validate(cfg, fam.arch(fam.tiny_config()))


def test_good_layout_and_overrides_beat_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("parallel:\n  tp: 2\n  sp: true\nmodel:\n  dtype: bf16\n")
    cfg = load_config(str(p), ["parallel.tp=1", "parallel.sp=false"])
    assert cfg.parallel.tp == 1 and cfg.parallel.sp is False and cfg.model.dtype == "bf16"
    validate_layout(_arch(), tp=2, ep=2, pp=2, etp=1, sp=True, world_size=4)
    again = tmp_path / "again.yaml"
    again.write_text(to_yaml(cfg))
    assert load_config(str(again), []) == cfg


def test_unknown_key_in_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("parallel:\n  expert_parallel: 2\n")
    with pytest.raises(ConfigError, match="parallel.expert_parallel"):
        load_config(str(p), [])


def test_cli_dry_run_and_errors(capsys):
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "megadare",
            "sft",
            "--nproc",
            "2",
            "--dry-run",
            "--config",
            "examples/configs/sft_sdar_tiny.yaml",
            "parallel.tp=2",
        ],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert "tp: 2" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "megadare", "rl", "--config", "examples/configs/sdar_tiny.yaml", "parallel.tp=3"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "parallel.tp=3" in bad.stderr and "Traceback" not in bad.stderr
    no_eval_model = subprocess.run([sys.executable, "-m", "megadare", "eval"], capture_output=True, text=True)
    assert no_eval_model.returncode == 2 and "--model" in no_eval_model.stderr
    assert "Traceback" not in no_eval_model.stderr
    # in this process (each `megadare` subprocess imports torch + megatron); `sft` ran as a subprocess above
    assert cli.main(["sft"]) == 2
    no_model = capsys.readouterr().err
    assert "no model" in no_model and "Traceback" not in no_model


def test_peer_timeouts_are_keys_and_the_rollout_one_fits_in_the_collective_one():
    """rollout.timeout_s (an engine's silence) and parallel.collective_timeout_s (the process group's timeout,
    which the other ranks wait under while rank 0 rolls out) are set from the config, the rollout one bounding the
    weight-push groups too (they waited 30 minutes for a hung engine); a rollout timeout the
    collective one would cut short is refused."""
    cfg = load_config(None, ["rollout.timeout_s=60", "parallel.collective_timeout_s=120"])
    validate(cfg, None)
    assert (cfg.rollout.timeout_s, cfg.parallel.collective_timeout_s) == (60, 120)
    assert SyncSettings.of(cfg.rollout).timeout == timedelta(seconds=60)  # weight-push groups: the same bound
    with pytest.raises(ConfigError, match=r"rollout.timeout_s=600.*parallel.collective_timeout_s=300: need 0 <"):
        validate(load_config(None, ["rollout.timeout_s=600", "parallel.collective_timeout_s=300"]), None)
