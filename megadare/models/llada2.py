"""LLaDA2.X (LLaDA2.0-mini 16B-A1.4B, -flash ~100B-A6B): Bailing MoE V2 / Ling 2.0 block diffusion.

Facts (inclusionAI ``modeling_llada2_moe.py`` as published with LLaDA2.0-mini, sglang models/llada2.py,
Megatron-Bridge's Bailing MoE V2 bridge; architecture ``LLaDA2MoeModelLM``):
* names: ``model.word_embeddings``, ``model.layers.N.attention.{query_key_value, query_layernorm,
  key_layernorm, dense}``, ``input_layernorm``, ``post_attention_layernorm``, dense layers
  ``mlp.{gate,up,down}_proj``, MoE layers ``mlp.gate.{weight, expert_bias}``, ``mlp.experts.E.*``,
  ``mlp.shared_experts.*``, ``model.norm``, ``lm_head``;
* fused ``query_key_value`` = [q heads; k heads; v heads] (split by heads), QK RMSNorm before RoPE,
  partial RoPE (``partial_rotary_factor``, rotate-half on the first rotary_dim dims);
* router: fp32 logits, sigmoid scores; experts chosen on scores + ``expert_bias`` (a buffer, selection only)
  within the top ``topk_group`` of ``n_group`` groups ranked by the sum of each group's top-2 scores; weights
  = chosen sigmoid scores / (sum + 1e-20) (when ``norm_topk_prob``) * ``routed_scaling_factor``;
  shared expert of width ``moe_intermediate_size * num_shared_experts`` added, no shared gate;
* the first ``first_k_dense_replace`` layers are dense (``intermediate_size``); block-causal attention, mask
  token id 156895, default block size 32 (sglang DLLM_PARAMS).
megatron-core ranks groups by the sum of the top (topk / topk_group) scores, so a checkpoint must have
num_experts_per_tok == 2 * topk_group (true for mini and flash: 8 and 4) -- checked.

LLaDA2.1 (mini, flash) has the same weights layout and config as 2.0 and loads as this family; it decodes with
token editing (``rollout.algorithm=editing``, rollout/editing.py, after its ``generate()``). Attention mask: the
2.1 ``generate()`` builds its block mask as 0/1 and passes it to attention without the ``.log()`` that 2.0's
applies, so it acts as an additive +1 bias, not a mask: in the publisher's own 2.1 decoding every position of
the window (prompt and earlier blocks included) attends to the current, partly masked block. megadare keeps the
strict block-causal mask for 2.1 as for 2.0 (the one the training forward and both rollout engines use, so the
recorded trace is the trainer's), so its 2.1 decodes differ from the publisher's code there by design.
"""

from __future__ import annotations

from megadare.models.mapping import HFNames
from megadare.models.family import MaskKind, ModelArch, ModelConfigError, canonical_config, register, require
from megadare.models.hf import decoder_family

MASK_TOKEN_ID = 156895
BLOCK_SIZE = 32
# SFT's noise draw (sft.t_per=auto): one t per sample, as DARE's LLaDA2 SFT (verl/utils/dataset/llada2_sft_dataset.py
# _forward_process: t ~ U(noise_range_low, noise_range_high) per sample)
SFT_T_PER = "sample"
# and keeps a draw that masks nothing (it scores nothing), where SDAR's rule draws again
SFT_REDRAW_EMPTY = False
# transformers has no llada2_moe: configs megadare writes name its own configuration file (models/remote_code/),
# which save_hf_model puts beside them, so AutoConfig (SGLang) reads them with trust_remote_code
AUTO_MAP = {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig"}
_L = "model.layers.{i}."
NAMES = HFNames(
    embed="model.word_embeddings.weight",
    final_norm="model.norm.weight",
    lm_head="lm_head.weight",
    input_norm=_L + "input_layernorm.weight",
    post_norm=_L + "post_attention_layernorm.weight",
    qkv=_L + "attention.query_key_value.weight",
    o=_L + "attention.dense.weight",
    q_norm=_L + "attention.query_layernorm.weight",
    k_norm=_L + "attention.key_layernorm.weight",
    gate=_L + "mlp.gate_proj.weight",
    up=_L + "mlp.up_proj.weight",
    down=_L + "mlp.down_proj.weight",
    router=_L + "mlp.gate.weight",
    expert_bias=_L + "mlp.gate.expert_bias",
    expert_gate=_L + "mlp.experts.{e}.gate_proj.weight",
    expert_up=_L + "mlp.experts.{e}.up_proj.weight",
    expert_down=_L + "mlp.experts.{e}.down_proj.weight",
    shared_gate=_L + "mlp.shared_experts.gate_proj.weight",
    shared_up=_L + "mlp.shared_experts.up_proj.weight",
    shared_down=_L + "mlp.shared_experts.down_proj.weight",
)


def arch(cfg: dict) -> ModelArch:
    w = "LLaDA2MoeModelLM"
    cfg = canonical_config(cfg, w)
    for key in ("use_qkv_bias", "use_bias"):
        if cfg.get(key):
            raise ModelConfigError(f"{w}: config.json {key}=true is not supported (published LLaDA2 has none)")
    if cfg.get("score_function", "sigmoid") != "sigmoid":
        raise ModelConfigError(f"{w}: score_function={cfg['score_function']!r}; LLaDA2 routes with 'sigmoid'")
    heads = require(cfg, "num_attention_heads", int, w)
    hidden = require(cfg, "hidden_size", int, w)
    topk = require(cfg, "num_experts_per_tok", int, w)
    n_group, topk_group = int(cfg.get("n_group") or 0), int(cfg.get("topk_group") or 0)
    if n_group and topk != 2 * topk_group:
        raise ModelConfigError(
            f"{w}: num_experts_per_tok={topk} must equal 2 * topk_group={topk_group} (groups "
            "are ranked by their top-2 scores, megatron-core uses top-(topk/topk_group))"
        )
    if not cfg.get("norm_topk_prob", True) and topk > 1:
        raise ModelConfigError(f"{w}: norm_topk_prob=false is not supported by megatron's sigmoid router")
    return ModelArch(
        family="llada2",
        architecture=w,
        vocab_size=require(cfg, "vocab_size", int, w),
        hidden_size=hidden,
        num_layers=require(cfg, "num_hidden_layers", int, w),
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        ffn_hidden_size=require(cfg, "intermediate_size", int, w),
        rms_norm_eps=float(require(cfg, "rms_norm_eps", (int, float), w)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        rotary_percent=float(cfg.get("partial_rotary_factor", 1.0)),
        qk_norm=bool(cfg.get("use_qk_norm", True)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        mask_token_id=int(cfg.get("mask_token_id", MASK_TOKEN_ID)),
        attention=MaskKind.BLOCK_CAUSAL,
        block_size=int(cfg.get("block_size", BLOCK_SIZE)),
        num_experts=require(cfg, "num_experts", int, w),
        moe_ffn_hidden_size=require(cfg, "moe_intermediate_size", int, w),
        moe_topk=topk,
        num_shared_experts=int(cfg.get("num_shared_experts") or 0),
        first_k_dense=int(cfg.get("first_k_dense_replace", 0)),
        moe_score_function="sigmoid",
        moe_norm_topk_prob=True,
        moe_routed_scaling=float(cfg.get("routed_scaling_factor", 1.0)),
        moe_num_groups=n_group,
        moe_topk_groups=topk_group,
        moe_expert_bias=bool(cfg.get("moe_router_enable_expert_bias", True)),
    )


def tiny_config(**over) -> dict:
    cfg = {
        "architectures": ["LLaDA2MoeModelLM"],
        "model_type": "llada2_moe",
        "auto_map": dict(AUTO_MAP),
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 600000.0,
        "partial_rotary_factor": 0.5,
        "max_position_embeddings": 512,
        "use_qk_norm": True,
        "use_qkv_bias": False,
        "use_bias": False,
        "tie_word_embeddings": False,
        "num_experts": 8,
        "num_shared_experts": 1,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 32,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "mask_token_id": 255,
        "block_size": BLOCK_SIZE,
        "embedding_dropout": 0.0,
    }
    cfg.update(over)
    return cfg


LLADA2 = register(
    decoder_family(
        "llada2", "LLaDA2MoeModelLM", arch, NAMES, tiny_config, sft_t_per=SFT_T_PER, sft_redraw_empty=SFT_REDRAW_EMPTY
    )
)
