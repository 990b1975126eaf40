"""SDAR / TraDo (dense, Qwen3 weights) and SDAR-MoE (e.g. SDAR-30B-A3B, Qwen3-MoE weights): block diffusion.

Facts (checked against sglang python/sglang/srt/models/sdar.py, sdar_moe.py and srt/dllm/config.py, and the
Qwen3 / Qwen3-MoE modeling files the SDAR checkpoints reuse):
* architectures ``SDARForCausalLM`` / ``SDARMoeForCausalLM``; TraDo checkpoints use the SDAR architecture.
* Qwen3 layer: RMSNorm, GQA attention with per-head QK RMSNorm (q_norm/k_norm, before RoPE), no QKV bias,
  SwiGLU MLP; MoE: softmax router ``mlp.gate`` over ``num_experts``, top ``num_experts_per_tok``, renormalised
  when ``norm_topk_prob``, experts of ``moe_intermediate_size``, no shared expert.
* attention: block-causal at inference (own block bidirectional, earlier blocks causal); block-diffusion
  training over x_t ++ x_0. Mask token id 151669, default block size 4 (sglang DLLM_PARAMS).
* ``mask_token_id`` / ``block_size`` keys in config.json win when present (tiny test configs set them so a
  small vocabulary can hold the mask token).
* ``model_type``: the publishers write ``sdar`` / ``sdar_moe`` and ship ``configuration_sdar*.py`` /
  ``modeling_sdar*.py`` with an ``auto_map`` (megadare's exports copy those files along). Configs megadare writes
  from scratch say ``qwen3`` / ``qwen3_moe``: SDAR's config keys and weights are Qwen3's, so transformers'
  AutoConfig and AutoModelForCausalLM load them without remote code, and SGLang serves them as SDAR (it picks the
  model class from ``architectures``).
Unsupported (rejected with a message): Qwen3-MoE ``decoder_sparse_step`` != 1, non-empty ``mlp_only_layers``,
``rope_scaling``.
"""

from __future__ import annotations

from dataclasses import replace

from megadare.models.mapping import HFNames
from megadare.models.family import Family, MaskKind, ModelArch, ModelConfigError, canonical_config, register, require
from megadare.models.hf import decoder_family

MASK_TOKEN_ID = 151669
BLOCK_SIZE = 4
# SFT's noise draw (sft.t_per=auto): one t per sample, as SDAR's own training code (modeling_sdar.py
# forward_add_noise_packed, one t per packed sample; DARE's sdar_fsdp_sft_trainer.py) draws it
SFT_T_PER = "sample"
_L = "model.layers.{i}."
QWEN_NAMES = HFNames(  # Qwen2 / Qwen3 layers as HF names them; SDAR adds QK norms and experts, Dream QKV biases
    embed="model.embed_tokens.weight",
    final_norm="model.norm.weight",
    lm_head="lm_head.weight",
    input_norm=_L + "input_layernorm.weight",
    post_norm=_L + "post_attention_layernorm.weight",
    q=_L + "self_attn.q_proj.weight",
    k=_L + "self_attn.k_proj.weight",
    v=_L + "self_attn.v_proj.weight",
    o=_L + "self_attn.o_proj.weight",
    gate=_L + "mlp.gate_proj.weight",
    up=_L + "mlp.up_proj.weight",
    down=_L + "mlp.down_proj.weight",
)
NAMES = replace(
    QWEN_NAMES,
    q_norm=_L + "self_attn.q_norm.weight",
    k_norm=_L + "self_attn.k_norm.weight",
    router=_L + "mlp.gate.weight",
    expert_gate=_L + "mlp.experts.{e}.gate_proj.weight",
    expert_up=_L + "mlp.experts.{e}.up_proj.weight",
    expert_down=_L + "mlp.experts.{e}.down_proj.weight",
)


def qwen_common(cfg: dict, where: str) -> dict:
    """The Qwen2/Qwen3-style keys shared by SDAR, SDAR-MoE and Dream."""
    heads = require(cfg, "num_attention_heads", int, where)
    hidden = require(cfg, "hidden_size", int, where)
    return dict(
        vocab_size=require(cfg, "vocab_size", int, where),
        hidden_size=hidden,
        num_layers=require(cfg, "num_hidden_layers", int, where),
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        ffn_hidden_size=require(cfg, "intermediate_size", int, where),
        rms_norm_eps=float(require(cfg, "rms_norm_eps", (int, float), where)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def _arch(cfg: dict, moe: bool) -> ModelArch:
    arch_name = "SDARMoeForCausalLM" if moe else "SDARForCausalLM"
    where = arch_name
    cfg = canonical_config(cfg, where)
    kw = qwen_common(cfg, where)
    if moe:
        if int(cfg.get("decoder_sparse_step", 1)) != 1 or cfg.get("mlp_only_layers"):
            raise ModelConfigError(
                f"{where}: decoder_sparse_step != 1 / mlp_only_layers are not supported "
                "(SDAR-MoE checkpoints make every layer MoE)"
            )
        kw.update(
            num_experts=require(cfg, "num_experts", int, where),
            moe_topk=require(cfg, "num_experts_per_tok", int, where),
            moe_ffn_hidden_size=require(cfg, "moe_intermediate_size", int, where),
            moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            moe_score_function="softmax",
        )
    return ModelArch(
        family="sdar_moe" if moe else "sdar",
        architecture=arch_name,
        qk_norm=True,
        mask_token_id=int(cfg.get("mask_token_id", MASK_TOKEN_ID)),
        attention=MaskKind.BLOCK_CAUSAL,
        block_size=int(cfg.get("block_size", BLOCK_SIZE)),
        **kw,
    )


def _tiny(moe: bool, **over) -> dict:
    cfg = {
        "architectures": ["SDARMoeForCausalLM" if moe else "SDARForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": not moe,
        "attention_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "mask_token_id": 255,
        "block_size": BLOCK_SIZE,
    }
    if moe:
        cfg.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    cfg.update(over)
    return cfg


def _family(name: str, architecture: str, moe: bool) -> Family:
    """The dense (Qwen3 weights) or MoE (Qwen3-MoE weights) SDAR family; ``moe`` picks the config keys."""
    return decoder_family(
        name,
        architecture,
        lambda c: _arch(c, moe),
        NAMES,
        lambda **o: _tiny(moe, **o),
        ignore_hf=("rotary_emb.inv_freq",),
        sft_t_per=SFT_T_PER,
    )


SDAR = register(_family("sdar", "SDARForCausalLM", moe=False))
SDAR_MOE = register(_family("sdar_moe", "SDARMoeForCausalLM", moe=True))
