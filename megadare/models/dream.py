"""Dream 7B / DiffuCoder: Qwen2.5 weights, full (bidirectional) attention masked diffusion.

Facts (Dream-org's modeling_dream.py / generation_utils.py and configuration_dream.py, as published with
Dream-v0-Instruct-7B; architecture ``DreamModel``): Qwen2 layers -- RMSNorm, GQA, q/k/v projections *with* bias,
no QK norm, SwiGLU; separate lm_head; ``mask_token_id`` 151666 in config.json. Logits are shifted by one:
the model's logits at position i predict token i+1 (Dream was adapted from an AR model), so samplers and
losses read ``logits[:, i-1]`` for a masked token at i -- recorded as ``logits_shift = 1``; the model itself
returns plain lm_head logits.
"""

from __future__ import annotations

from dataclasses import replace

from megadare.models.family import MaskKind, ModelArch, canonical_config, register
from megadare.models.sdar import QWEN_NAMES, qwen_common
from megadare.models.hf import decoder_family

MASK_TOKEN_ID = 151666
_L = "model.layers.{i}."
NAMES = replace(
    QWEN_NAMES,
    q_bias=_L + "self_attn.q_proj.bias",
    k_bias=_L + "self_attn.k_proj.bias",
    v_bias=_L + "self_attn.v_proj.bias",
)


def arch(cfg: dict) -> ModelArch:
    cfg = canonical_config(cfg, "DreamModel")
    kw = qwen_common(cfg, "DreamModel")
    return ModelArch(
        family="dream",
        architecture="DreamModel",
        qkv_bias=True,
        logits_shift=1,
        mask_token_id=int(cfg.get("mask_token_id", MASK_TOKEN_ID)),
        attention=MaskKind.BIDIRECTIONAL,
        block_size=0,
        **kw,
    )


def tiny_config(**over) -> dict:
    cfg = {
        "architectures": ["DreamModel"],
        "model_type": "Dream",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "mask_token_id": 255,
        "pad_token_id": 254,
    }
    cfg.update(over)
    return cfg


DREAM = register(decoder_family("dream", "DreamModel", arch, NAMES, tiny_config, ignore_hf=("rotary_emb.inv_freq",)))
