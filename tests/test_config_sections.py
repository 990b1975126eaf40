"""Config sections by owner (optim, advantage, offpolicy, lora, rewards) and the users' keys from before them as
permanent aliases (``config.CONFIG_ALIASES``): every YAML in the repo loads to the same config under either spelling,
errors name the key the user wrote, two spellings of one key must agree, and a run's old config.yaml still loads."""

from __future__ import annotations

import copy
import glob
import os

import pytest
import yaml

from megadare.config import CONFIG_ALIASES, Config, config_from_dict, load_config, to_yaml
from megadare.trainer.checks import validate
from megadare.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_RUN_CONFIG = os.path.join(ROOT, "tests", "fixtures", "config_before_sections.yaml")  # its own test below
YAMLS = sorted(
    os.path.relpath(p, ROOT)
    for pattern in ("examples/**/*.yaml", "megadare/configs/*.yaml", "tests/**/*.yaml")
    for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)
    if p != OLD_RUN_CONFIG
)


def _leaves(data: dict, prefix: str = "") -> dict:
    """{dotted key: value} of a raw YAML mapping (sections only; dict-valued fields such as tiny_config kept)."""
    out = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and not any(key.startswith(s) or key == s for s in _DICT_FIELDS):
            out.update(_leaves(v, key + "."))
        else:
            out[key] = v
    return out


_DICT_FIELDS = ("model.tiny_config", "algo.params", "rollout.engine_resources", "eval.paths")


def _attr(cfg: Config, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


OLD_SPELLING = {new: old for old, new in reversed(CONFIG_ALIASES.items())}  # sft.lora_* for lora.*


def _old_spelled(raw: dict) -> dict:
    """The raw mapping with every canonical key that has an alias written under its old key instead (a user's file
    from before the sections)."""
    out: dict = {}
    for key, value in _leaves(raw).items():
        *sections, leaf = OLD_SPELLING.get(key, key).split(".")
        node = out
        for s in sections:
            node = node.setdefault(s, {})
        node[leaf] = value
    return out


@pytest.mark.parametrize("path", YAMLS)
def test_every_yaml_loads_the_same_under_old_and_new_keys(path, tmp_path):
    assert len(YAMLS) >= 39  # examples/ (DARE presets included), megadare/configs/, tests' configs
    with open(os.path.join(ROOT, path)) as f:
        raw = yaml.safe_load(f) or {}
    cfg = load_config(os.path.join(ROOT, path))
    for key, value in _leaves(raw).items():  # each key the file sets reads back under its canonical key
        got = _attr(cfg, CONFIG_ALIASES.get(key, key))
        assert got == (pytest.approx(value) if isinstance(value, float) else value), (path, key, got, value)
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(_old_spelled(raw), sort_keys=False))
    assert to_yaml(load_config(str(old))) == to_yaml(cfg), path


@pytest.mark.parametrize("path", YAMLS)
def test_shipped_yamls_write_the_canonical_keys(path):
    """A newcomer reads one spelling: the examples and the demo's configs use no old key (aliases are for users'
    files; tests/fixtures/config_before_sections.yaml keeps the old spelling loading)."""
    with open(os.path.join(ROOT, path)) as f:
        raw = yaml.safe_load(f) or {}
    old = sorted(key for key in _leaves(raw) if key in CONFIG_ALIASES)
    assert not old, f"{path} writes {old}; write {[CONFIG_ALIASES[k] for k in old]}"


def test_a_few_values_of_the_repo_configs():
    tree = load_config(os.path.join(ROOT, "examples/configs/dare/d_treerpo_llada.yaml"))
    assert (tree.lora.rank, tree.lora.alpha) == (128, 64.0)
    assert tree.rewards.name == "math" and tree.advantage.estimator == "grpo" and tree.rl.ppo_epochs == 12
    assert tree.optim.lr == pytest.approx(3e-5) and tree.optim.weight_decay == pytest.approx(0.1)  # DARE's lr, wd
    assert tree.optim.adam_beta2 == pytest.approx(0.99) and tree.optim.lr_decay_style == "constant"
    espo = load_config(os.path.join(ROOT, "examples/configs/dare/espo_llada.yaml"))
    assert espo.advantage.estimator == "rloo"


def test_to_yaml_writes_the_new_keys_and_reads_back():
    cfg = load_config(None, ["train.lr=3e-4", "rl.advantage=rloo", "rl.mode=one_step_off", "sft.lora_rank=8"])
    text = to_yaml(cfg)
    saved = yaml.safe_load(text)
    assert saved["optim"]["lr"] == 3e-4 and "lr" not in saved["train"]
    assert saved["advantage"]["estimator"] == "rloo" and saved["offpolicy"]["mode"] == "one_step_off"
    assert saved["lora"]["rank"] == 8 and "lora_rank" not in saved["sft"] and "lora_rank" not in saved["rl"]
    assert not any(old.split(".")[-1] in saved[old.split(".")[0]] for old in CONFIG_ALIASES if "." in old)
    assert config_from_dict(saved) == cfg


def test_a_resumed_runs_old_config_yaml_still_loads():
    """The fixture is to_yaml of main e0ff542: every key of every section, sft.lora_* (defaults) beside rl.lora_*."""
    old = load_config(OLD_RUN_CONFIG)
    assert (old.lora.rank, old.lora.alpha) == (128, 64.0)
    assert old.optim.lr == pytest.approx(3e-6) and old.optim.distributed_optimizer is False
    assert old.advantage.estimator == "rloo" and old.advantage.accuracy_band == [0.2, 0.8]
    assert (old.offpolicy.mode, old.offpolicy.max_staleness, old.offpolicy.loss_mode) == (
        "one_step_off",
        2,
        "decoupled",
    )
    assert old.offpolicy.rollout_is == "token"
    assert (old.rewards.name, old.rewards.max_error_fraction, old.rewards.truncated_as_wrong) == ("gsm8k", 0.1, True)
    assert old.rewards.code.isolation == "namespaces"
    resaved = yaml.safe_load(to_yaml(old))  # saved again: the new keys only, the same config
    assert "lora_rank" not in resaved["rl"] and resaved["lora"]["rank"] == 128
    assert config_from_dict(resaved) == old


def test_errors_name_the_key_as_written(tmp_path):
    with pytest.raises(ConfigError, match=r"^rl\.mode='async' is not one of sync, one_step_off, fully_async$"):
        load_config(None, ["rl.mode=async"])
    with pytest.raises(ConfigError, match=r"^offpolicy\.mode='async' is not one of"):
        load_config(None, ["offpolicy.mode=async"])
    f = tmp_path / "c.yaml"
    f.write_text("rl:\n  advantage: ppo\n")
    with pytest.raises(ConfigError, match=r"^rl\.advantage='ppo' is not one of grpo, rloo, reinforce_pp$"):
        load_config(str(f))
    with pytest.raises(ConfigError, match=r"^train\.lr='fast' is not a number \(in override train\.lr=fast\)$"):
        load_config(None, ["train.lr=fast"])
    with pytest.raises(
        ConfigError, match=r"unknown config key 'rl.advantag' \(rl.advantag=rloo\): did you mean rl.advantage=rloo"
    ):
        load_config(None, ["rl.advantag=rloo"])
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'advantage.estimatr' \(advantage.estimatr=rloo\): did you mean advantage.estimator=",
    ):
        load_config(None, ["advantage.estimatr=rloo"])
    with pytest.raises(ConfigError, match=r"^train\.lr=0\.0, train\.min_lr=0\.0: need"):
        validate(load_config(None, ["train.lr=0"]), None)
    with pytest.raises(ConfigError, match=r"^optim\.lr=0\.0, optim\.min_lr=0\.0: need"):
        validate(load_config(None, ["optim.lr=0"]), None)
    with pytest.raises(ConfigError, match=r"^rl\.max_reward_error_fraction=2\.0 must be within"):
        config_from_dict({"rl": {"max_reward_error_fraction": 2.0}})
    with pytest.raises(ConfigError, match=r"^rewards\.max_error_fraction=2\.0 must be within"):
        config_from_dict({"rewards": {"max_error_fraction": 2.0}})


def test_two_spellings_of_one_key_must_agree(tmp_path):
    f = tmp_path / "both.yaml"
    f.write_text("rl:\n  advantage: rloo\nadvantage:\n  estimator: grpo\n")
    with pytest.raises(
        ConfigError, match=r"both.yaml: advantage.estimator='grpo', rl.advantage='rloo' set one key .* keep one$"
    ):
        load_config(str(f))
    with pytest.raises(ConfigError, match=r"overrides: train.lr=1e-3 and optim.lr=2e-3 set one key \(optim.lr\)"):
        load_config(None, ["train.lr=1e-3", "optim.lr=2e-3"])
    with pytest.raises(ConfigError, match=r"sft.lora_rank=8, rl.lora_rank=4 set one key \(lora.rank\)"):
        config_from_dict({"sft": {"lora_rank": 8}, "rl": {"lora_rank": 4}})
    with pytest.raises(ConfigError, match=r"lora.rank=8, rl.lora_rank=0 set one key"):
        config_from_dict({"lora": {"rank": 8}, "rl": {"lora_rank": 0}})  # the new key against an old one: both
    same = load_config(None, ["train.lr=1e-3", "optim.lr=0.001", "rl.lora_rank=4", "rl.lora_rank=2"])
    assert same.optim.lr == 1e-3 and same.lora.rank == 2  # one spelling twice: the later wins, as before
    f.write_text("optim:\n  lr: 0.5\n")
    assert load_config(str(f), ["train.lr=0.25"]).optim.lr == 0.25  # an override beats the file, either spelling


def test_sft_and_rl_lora_of_an_old_file_take_the_set_one():
    """Before one ``lora`` section a file held sft.lora_* and rl.lora_* (a saved config.yaml: both, one at its
    default); the job read its own. The one that is not the default is the setting."""
    assert config_from_dict({"sft": {"lora_rank": 0}, "rl": {"lora_rank": 16}}).lora.rank == 16
    assert config_from_dict({"sft": {"lora_alpha": 16}, "rl": {"lora_alpha": 64.0}}).lora.alpha == 64.0  # 16 == 16.0
    assert config_from_dict({"sft": {"lora_rank": 8, "lora_alpha": 4.0}, "rl": {"lora_rank": 0}}).lora.alpha == 4.0
    data = {"rl": {"lora_rank": 16}}
    before = copy.deepcopy(data)
    config_from_dict(data)
    assert data == before  # the caller's mapping is not changed
