"""config.json written by newer transformers: the names transformers' own config classes accept for a key
(``attribute_map``: transformers 5 saves Qwen3-MoE's ``num_experts`` as ``num_local_experts``) and transformers 5's
``rope_parameters`` read as the keys megadare knows, for every family."""

from __future__ import annotations

import json

import pytest

from megadare.models import FAMILIES, ModelConfigError, get_family
from megadare.models.family import KEY_ALIASES, ROPE_PARAMETER_KEYS, canonical_config

transformers = pytest.importorskip("transformers")

# the transformers config class whose layout a family's config.json follows (families without one: LLaDA's and
# LLaDA2's configs are the publishers' remote code)
TRANSFORMERS_CLASS = {"sdar": "Qwen3Config", "sdar_moe": "Qwen3MoeConfig", "dream": "Qwen2Config"}


def _as_transformers5_writes(cfg: dict) -> dict:
    """cfg with every aliased key under its alias and the RoPE keys inside rope_parameters."""
    out = dict(cfg)
    for key, names in KEY_ALIASES.items():
        if key in out:
            out[names[0]] = out.pop(key)
    rope = {k: out.pop(k) for k in ROPE_PARAMETER_KEYS if k in out}
    if rope:
        out["rope_parameters"] = {**rope, "rope_type": "default"}
    return out


FAMILY_NAMES = ("dream", "llada", "llada2", "sdar", "sdar_moe")


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_every_family_reads_aliased_keys(name):
    fam = get_family(name)
    assert sorted(FAMILIES) == list(FAMILY_NAMES)  # a new family is added here too
    cfg = fam.tiny_config(rope_theta=123456.0)  # not any family's default
    moved = _as_transformers5_writes(cfg)
    assert moved != cfg
    assert fam.arch(moved) == fam.arch(cfg)


@pytest.mark.parametrize("name", sorted(TRANSFORMERS_CLASS))
def test_configs_saved_by_transformers_read_the_same(name, tmp_path):
    """A family's tiny config saved by the installed transformers' own config class (what a checkpoint written
    with transformers 5 holds) gives the same architecture; the alias table covers that class's attribute_map."""
    cls = getattr(transformers, TRANSFORMERS_CLASS[name])
    for alias, stored in cls.attribute_map.items():  # {name megadare reads: name transformers stores}
        assert stored in KEY_ALIASES.get(alias, ()), (cls.__name__, alias, stored)
    fam = get_family(name)
    cfg = fam.tiny_config(rope_theta=123456.0)
    cls.from_dict({k: v for k, v in cfg.items() if k != "model_type"}).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    if int(transformers.__version__.split(".")[0]) >= 5:  # the layout this is about
        assert "rope_theta" not in saved and saved["rope_parameters"]["rope_theta"] == 123456.0
        assert name != "sdar_moe" or ("num_experts" not in saved and saved["num_local_experts"] == 8)
    assert fam.arch(saved) == fam.arch(cfg)


def test_conflicting_and_unsupported_values_are_named():
    cfg = get_family("sdar_moe").tiny_config()
    with pytest.raises(ModelConfigError, match=r"'num_experts' different values.*num_experts=8, num_local_experts=4"):
        canonical_config({**cfg, "num_local_experts": 4}, "X")
    assert canonical_config({**cfg, "num_local_experts": 8}, "X")["num_experts"] == 8
    with pytest.raises(ModelConfigError, match=r"rope_type 'yarn' is not supported"):
        canonical_config({**cfg, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "X")
    with pytest.raises(ModelConfigError, match=r"rope_theta=10000.0, rope_parameters.rope_theta=1000000.0"):
        get_family("sdar").arch({**get_family("sdar").tiny_config(), "rope_parameters": {"rope_theta": 1e6}})


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_every_family_refuses_rope_scaling(name):
    """The publishers' code applies ``rope_scaling`` (LLaDA2's through transformers' ROPE_INIT_FUNCTIONS): a family
    that ignored it would load a different model. Refused for every family, not only the Qwen-style ones; a null or
    ``default`` scaling is plain RoPE."""
    fam = get_family(name)
    cfg = fam.tiny_config()
    with pytest.raises(ModelConfigError, match=r"rope_scaling=\{'type': 'linear', 'factor': 2.0\} is not supported"):
        fam.arch({**cfg, "rope_scaling": {"type": "linear", "factor": 2.0}})
    for plain in (None, {"rope_type": "default"}, {"type": "default"}):
        assert fam.arch({**cfg, "rope_scaling": plain}) == fam.arch(cfg)
