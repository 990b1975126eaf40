"""LLaDA / LLaDA-1.5 (8B): LLaMA-like full-attention masked diffusion with its own parameter names.

Facts (ML-GSAI LLaDA ``modeling_llada.py`` / ``configuration_llada.py`` as published with LLaDA-8B-Instruct;
architecture ``LLaDAModelLM``; Megatron-Bridge's LLaDA 1.5 bridge uses the same names):
* names under ``model.transformer``: ``wte``, ``blocks.N.{attn_norm, q_proj, k_proj, v_proj, attn_out, ff_norm,
  ff_proj (gate), up_proj, ff_out (down)}``, ``ln_f``, and ``ff_out`` as the lm head (``weight_tying`` false);
* config keys are OLMo-style: d_model, n_heads, n_kv_heads, n_layers, mlp_hidden_size, embedding_size (the
  padded vocabulary: the embedding has ``embedding_size`` rows), rope_theta, rms_norm_eps, include_bias,
  max_sequence_length;
* RMSNorm in fp32 then weight (HF op order), rotate-half RoPE, no QK norm, no bias; bidirectional attention;
  mask token id 126336.
Rejected: include_bias true, attention_layer_norm true, block_type other than "llama".
"""

from __future__ import annotations

from megadare.models.mapping import HFNames
from megadare.models.family import MaskKind, ModelArch, ModelConfigError, canonical_config, register, require
from megadare.models.hf import decoder_family

MASK_TOKEN_ID = 126336
_B = "model.transformer.blocks.{i}."
NAMES = HFNames(
    embed="model.transformer.wte.weight",
    final_norm="model.transformer.ln_f.weight",
    lm_head="model.transformer.ff_out.weight",
    input_norm=_B + "attn_norm.weight",
    post_norm=_B + "ff_norm.weight",
    q=_B + "q_proj.weight",
    k=_B + "k_proj.weight",
    v=_B + "v_proj.weight",
    o=_B + "attn_out.weight",
    gate=_B + "ff_proj.weight",
    up=_B + "up_proj.weight",
    down=_B + "ff_out.weight",
)


def arch(cfg: dict) -> ModelArch:
    w = "LLaDAModelLM"
    cfg = canonical_config(cfg, w)
    for key, bad in (("include_bias", True), ("attention_layer_norm", True)):
        if cfg.get(key) == bad:
            raise ModelConfigError(f"{w}: config.json {key}={bad} is not supported")
    if cfg.get("block_type", "llama") != "llama":
        raise ModelConfigError(f"{w}: config.json block_type={cfg['block_type']!r}; only 'llama' is supported")
    heads = require(cfg, "n_heads", int, w)
    d = require(cfg, "d_model", int, w)
    vocab = int(cfg.get("embedding_size") or require(cfg, "vocab_size", int, w))
    return ModelArch(
        family="llada",
        architecture=w,
        vocab_size=vocab,
        hidden_size=d,
        num_layers=require(cfg, "n_layers", int, w),
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("n_kv_heads") or heads),
        head_dim=d // heads,
        ffn_hidden_size=require(cfg, "mlp_hidden_size", int, w),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        max_position_embeddings=int(cfg.get("max_sequence_length", 4096)),
        tie_word_embeddings=bool(cfg.get("weight_tying", False)),
        mask_token_id=int(cfg.get("mask_token_id", MASK_TOKEN_ID)),
        attention=MaskKind.BIDIRECTIONAL,
        block_size=0,
    )


def tiny_config(**over) -> dict:
    cfg = {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "d_model": 64,
        "n_heads": 4,
        "n_kv_heads": 4,
        "n_layers": 2,
        "mlp_hidden_size": 128,
        "vocab_size": 250,
        "embedding_size": 256,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "max_sequence_length": 512,
        "weight_tying": False,
        "include_bias": False,
        "block_type": "llama",
        "layer_norm_type": "rms",
        "activation_type": "silu",
        "mask_token_id": 255,
    }
    cfg.update(over)
    return cfg


LLADA = register(decoder_family("llada", "LLaDAModelLM", arch, NAMES, tiny_config))
