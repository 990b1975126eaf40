"""hf/ reference models: parity with implementations we did not write, routers, RoPE, loading, config errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megadare.models import ModelConfigError, build_hf_model, family_of, get_family, load_hf_model, save_hf_model
from megadare.models.attention import bidirectional, block_causal

S = 12


def _perturbed(name: str, **over):
    torch.manual_seed(7)
    cfg = get_family(name).tiny_config(**over)
    m = build_hf_model(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return cfg, m


def _transformers_twin(cls_name: str, config_cls: str, cfg: dict, state: dict):
    transformers = pytest.importorskip("transformers")
    conf = getattr(transformers, config_cls)(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    conf._attn_implementation = "eager"
    model = getattr(transformers, cls_name)(conf).eval()
    state = _fuse_experts_if_needed(state, model.state_dict())
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if cfg.get("tie_word_embeddings") else set()
    assert not [k for k in missing if "rotary" not in k and k not in tied] and not unexpected, (missing, unexpected)
    if cfg.get("tie_word_embeddings"):
        model.tie_weights()
    return model


def _fuse_experts_if_needed(state: dict, theirs: dict) -> dict:
    """transformers 5 stores Qwen3-MoE experts as 3-D gate_up_proj [E, 2F, H] / down_proj [E, H, F]."""
    state = dict(state)
    for key in [k for k in theirs if k.endswith("mlp.experts.gate_up_proj")]:
        p = key[: -len("gate_up_proj")]
        n = theirs[key].shape[0]
        state[key] = torch.stack(
            [torch.cat([state.pop(f"{p}{e}.gate_proj.weight"), state.pop(f"{p}{e}.up_proj.weight")]) for e in range(n)]
        )
        state[p + "down_proj"] = torch.stack([state.pop(f"{p}{e}.down_proj.weight") for e in range(n)])
    return state


def _hf_logits(model, ids, allowed):
    add = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, float("-inf"))
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=add).logits


@pytest.mark.parametrize(
    "name,cls,conf,mask",
    [
        ("sdar", "Qwen3ForCausalLM", "Qwen3Config", "block"),
        ("sdar_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", "block"),
        ("dream", "Qwen2ForCausalLM", "Qwen2Config", "bidir"),
    ],
)
def test_parity_with_transformers(name, cls, conf, mask):
    cfg, ours = _perturbed(name)
    ref = _transformers_twin(cls, conf, cfg, ours.state_dict())
    ids = torch.randint(0, cfg["vocab_size"], (2, S))
    spec = block_causal(4) if mask == "block" else bidirectional()
    allowed = spec.dense(S, S)
    with torch.no_grad():
        mine = ours(ids, attention_mask=allowed)
    theirs = _hf_logits(ref, ids, allowed)
    assert (mine - theirs).abs().max() < 1e-4
    # the custom mask is really used: plain causal attention gives something else
    causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
    assert (_hf_logits(ref, ids, causal) - theirs).abs().max() > 1e-3


def test_default_masks():
    cfg, m = _perturbed("sdar")
    ids = torch.randint(0, 250, (1, S))
    with torch.no_grad():
        default = m(ids)
        block = m(ids, attention_mask=block_causal(cfg["block_size"]).dense(S, S))
        bidir = m(ids, attention_mask=bidirectional().dense(S, S))
    assert torch.equal(default, block)
    assert (default - bidir).abs().max() > 1e-3
    _, d = _perturbed("dream")
    with torch.no_grad():
        assert torch.equal(d(ids), d(ids, attention_mask=bidirectional().dense(S, S)))


def test_sigmoid_group_router_against_loops():
    """LLaDA2 routing written out per token: groups by top-2 sum, bias for choice only, renorm, scaling."""
    from megadare.models.hf import route

    arch = get_family("llada2").arch(get_family("llada2").tiny_config())
    torch.manual_seed(0)
    logits, bias = torch.randn(20, arch.num_experts), torch.randn(arch.num_experts) * 0.3
    idx, w = route(logits, arch, bias)
    gsize = arch.num_experts // arch.moe_num_groups
    for t in range(20):
        s = torch.sigmoid(logits[t])
        sel = (s + bias).tolist()
        groups = sorted(range(arch.moe_num_groups), key=lambda g: -sum(sorted(sel[g * gsize : (g + 1) * gsize])[-2:]))
        allowed = [e for g in groups[: arch.moe_topk_groups] for e in range(g * gsize, (g + 1) * gsize)]
        chosen = sorted(allowed, key=lambda e: -sel[e])[: arch.moe_topk]
        assert sorted(idx[t].tolist()) == sorted(chosen)
        ws = {e: s[e].item() for e in chosen}
        tot = sum(ws.values())
        for e, wt in zip(idx[t].tolist(), w[t].tolist()):
            assert abs(wt - ws[e] / tot * arch.moe_routed_scaling) < 1e-5


def test_partial_rope_leaves_tail_untouched():
    from megadare.models.hf import apply_rope, rope_cos_sin

    x = torch.randn(1, 2, 5, 16)
    cos, sin = rope_cos_sin(torch.arange(5)[None], 8, 10000.0)
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[..., 8:], x[..., 8:])
    assert torch.allclose(y[..., :8].norm(dim=-1), x[..., :8].norm(dim=-1), atol=1e-5)  # a rotation
    assert torch.equal(y[:, :, 0], x[:, :, 0])  # position 0 is not rotated


@pytest.mark.parametrize("name", ["sdar", "llada2"])  # full RoPE | partial (rotary_percent < 1)
def test_rope_frequencies_are_kept_per_device_and_the_logits_stay_bit_identical(name, monkeypatch):
    """inv_freq was computed (and copied to the positions' device) at every forward, ~5% of the built-in engine's
    time; now it is kept per (device, rot_dim, theta). The logits are the ones of the uncached formula, bit for
    bit, and a second forward computes nothing new."""
    from megadare.models.hf import common

    _, m = _perturbed(name)
    a = m.arch
    rot_dim, theta = int(a.head_dim * a.rotary_percent), a.rope_theta
    ids = torch.randint(0, 250, (2, S))

    def uncached(device, rot_dim, theta):  # the formula as every forward computed it before
        return (1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))).to(device)

    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(common, "rope_inv_freq", uncached)
        want = m(ids)
    common._INV_FREQ.clear()
    with torch.no_grad():
        first = m(ids)
        kept = common._INV_FREQ[(ids.device, rot_dim, float(theta))]
        second = m(ids)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert list(common._INV_FREQ) == [(ids.device, rot_dim, float(theta))]
    assert common._INV_FREQ[(ids.device, rot_dim, float(theta))] is kept
    assert torch.equal(kept, uncached("cpu", rot_dim, theta))


def test_load_roundtrip_and_errors(tmp_path):
    cfg, m = _perturbed("llada2")
    d = str(tmp_path / "ck")
    save_hf_model(m, cfg, d, max_shard_bytes=64 << 10)
    assert os.path.exists(os.path.join(d, "model.safetensors.index.json"))
    ids = torch.randint(0, 250, (2, S))
    with torch.no_grad():
        assert torch.equal(load_hf_model(d)(ids), m(ids))
    from megadare.models.safetensors_io import CheckpointError, SafetensorsReader, save_hf_checkpoint

    state = dict(SafetensorsReader(d).items())
    gone = "model.layers.1.mlp.gate.expert_bias"
    del state[gone]
    state["model.layers.0.extra.weight"] = torch.zeros(1)
    save_hf_checkpoint(state, cfg, str(tmp_path / "bad"))
    with pytest.raises(CheckpointError) as e:
        load_hf_model(str(tmp_path / "bad"))
    assert gone in str(e.value) and "model.layers.0.extra.weight" in str(e.value)


@pytest.mark.parametrize(
    "name,key",
    [("sdar", "hidden_size"), ("llada", "d_model"), ("llada2", "num_experts"), ("dream", "num_hidden_layers")],
)
def test_missing_config_key_is_named(name, key, tmp_path):
    cfg = get_family(name).tiny_config()
    del cfg[key]
    with pytest.raises(ModelConfigError, match=key):
        family_of(cfg).arch(cfg)


def test_unknown_architecture_lists_known(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelConfigError, match="SDARForCausalLM"):
        family_of(str(tmp_path))
