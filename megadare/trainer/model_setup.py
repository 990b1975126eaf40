"""From a config to a trainable Megatron model on this rank: source checkpoint, TransformerConfig, chunks.

The model source is one of
* ``model.hf_path``: an HF checkpoint directory (its family is recognised from config.json);
* ``model.family`` + ``model.tiny``: a random tiny model of that family (tests, demo, laptops); rank 0 writes it
  once as an HF checkpoint under ``<run_dir>/init_hf`` (seeded by ``seed``) so every rank and every later
  export sees the same weights and config.json.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megadare.config import Config
from megadare.errors import ConfigError, RunStateError
from megadare.models.family import Family, ModelArch, family_of, get_family, read_hf_config


@dataclass
class ModelSource:
    family: Family
    arch: ModelArch
    hf_dir: str
    hf_config: dict


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def resolve_model_source(cfg: Config) -> ModelSource:
    """Where the initial weights and config.json come from (writes the tiny checkpoint on rank 0)."""
    m = cfg.model
    if m.hf_path:
        if not os.path.isdir(m.hf_path):
            raise ConfigError(f"model.hf_path={m.hf_path!r} is not a directory (expected an HF checkpoint)")
        hf = read_hf_config(m.hf_path)
        hf_dir = m.hf_path
    elif m.family and m.tiny:
        fam = get_family(m.family)
        over = dict(m.tiny_config)
        if m.block_size:
            over["block_size"] = m.block_size
        hf = fam.tiny_config(**over)
        hf_dir = os.path.join(cfg.logging.run_dir, "init_hf")
        if os.path.exists(os.path.join(hf_dir, "config.json")):
            _check_same_tiny(hf_dir, hf)
        elif _rank0():
            from megadare.models import build_hf_model, save_hf_model

            g = torch.random.fork_rng()
            with g:
                torch.manual_seed(cfg.seed)
                model = build_hf_model(hf)
                with torch.no_grad():  # a non-trivial init: HF inits norms to 1 and biases to 0
                    for p in model.parameters():
                        p.add_(torch.randn_like(p) * 0.02)
            save_hf_model(model, hf, hf_dir)
        if dist.is_initialized():
            dist.barrier()
        hf = read_hf_config(hf_dir)
    else:
        raise ConfigError("no model: set model.hf_path (an HF checkpoint) or model.family + model.tiny=true")
    fam = family_of(hf)
    arch = fam.arch(hf)
    if m.block_size is not None and arch.is_block_diffusion and m.block_size != arch.block_size:
        arch = _with_block(arch, m.block_size)
    return ModelSource(family=fam, arch=arch, hf_dir=hf_dir, hf_config=hf)


def _check_same_tiny(hf_dir: str, want: dict) -> None:
    """The run directory's tiny model must be the one the config asks for (model.family, model.tiny_config): an
    earlier run there wrote it, and its checkpoints hold that model."""
    import json

    have = read_hf_config(hf_dir)
    diff = sorted(k for k in set(have) | set(want) if json.dumps(have.get(k)) != json.dumps(want.get(k)))
    if diff:
        shown = ", ".join(f"{k} {have.get(k)!r} vs {want.get(k)!r}" for k in diff[:4])
        raise RunStateError(
            f"{hf_dir} holds the tiny model an earlier run in this directory trained, which differs "
            f"from this config's (there vs here: {shown}); use a new logging.run_dir, or restore "
            "model.family / model.tiny_config"
        )


def _with_block(arch: ModelArch, block: int) -> ModelArch:
    from dataclasses import replace

    return replace(arch, block_size=block)


def training_transformer_config(cfg: Config, arch: ModelArch):
    """TransformerConfig for training: dtype, SP, recomputation, MoE balancing as the family specifies."""
    from megadare.models.gpt import transformer_config

    over: dict[str, Any] = {"sequence_parallel": cfg.parallel.sp}
    t = cfg.train
    if t.recompute == "full":
        over.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif t.recompute == "selective":
        over.update(recompute_granularity="selective", recompute_modules=["core_attn"])
    if arch.is_moe:
        coeff = t.moe_aux_loss_coeff
        if coeff is None:  # families with an expert bias balance without an auxiliary loss
            coeff = 0.0 if arch.moe_expert_bias else 1e-3
        over.update(
            moe_aux_loss_coeff=coeff,
            moe_router_load_balancing_type="aux_loss" if coeff > 0 else "none",
            moe_router_bias_update_rate=t.moe_bias_update_rate,
        )
    return transformer_config(arch, cfg.model.dtype, **over)


def build_training_chunks(cfg: Config, src: ModelSource) -> list[torch.nn.Module]:
    """This rank's model chunks with the source weights loaded (HF straight into the shards); their output layer
    runs as ``train.logits`` says (models/head.py)."""
    from megadare.convert import load_hf_into_model
    from megadare.models.gpt import build_model_chunks
    from megadare.models.head import HeadSettings

    tcfg = training_transformer_config(cfg, src.arch)
    chunks = build_model_chunks(
        src.arch,
        tcfg,
        attention_backend=cfg.model.attention_backend,
        head=HeadSettings(cfg.train.logits, cfg.train.logits_chunk_mb),
    )
    load_hf_into_model(chunks, src.hf_dir)
    return chunks


VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")  # one holds the vocabulary


def tokenizer_for(cfg: Config, src: ModelSource):
    """The HF tokenizer of the checkpoint, or the byte tokenizer for tiny random models."""
    from megadare.data.tokenizer import ByteTokenizer, HFTokenizer

    if cfg.model.tiny:
        tok = ByteTokenizer()
        if tok.mask_token_id != src.arch.mask_token_id or tok.vocab_size > src.arch.vocab_size:
            raise ConfigError(
                f"the byte tokenizer (vocab {tok.vocab_size}, mask {tok.mask_token_id}) does not fit "
                f"the tiny {src.arch.family} model (vocab {src.arch.vocab_size}, mask "
                f"{src.arch.mask_token_id})"
            )
        return tok
    if not any(os.path.exists(os.path.join(src.hf_dir, f)) for f in VOCABULARY_FILES):
        # transformers >= 5 then builds an empty tokenizer of the model type instead of failing
        raise ConfigError(
            f"model.hf_path={src.hf_dir} has no tokenizer (none of {', '.join(VOCABULARY_FILES)}); "
            "copy the model's tokenizer files into it"
        )
    try:
        return HFTokenizer(src.hf_dir, mask_token_id=src.arch.mask_token_id)
    except (OSError, ValueError, TypeError) as e:  # transformers: OSError without files, ValueError for bad ones
        lines = str(e).strip().splitlines()
        raise ConfigError(
            f"model.hf_path={src.hf_dir}: no usable tokenizer ({type(e).__name__}: "
            f"{lines[0] if lines else ''}); copy the model's tokenizer files (tokenizer.json, "
            "tokenizer_config.json, ...) into it"
        ) from None
