"""From a config to a trainable Megatron model on this rank: source checkpoint, TransformerConfig, chunks.

The model source is one of
* ``model.hf_path``: an HF checkpoint directory (its family is recognised from config.json);
* ``model.family`` + ``model.tiny``: a random tiny model of that family (tests, demo, laptops); rank 0 writes it
  once as an HF checkpoint under ``<run_dir>/init_hf`` (seeded by ``seed``) so every rank and every later
  export sees the same weights and config.json.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any, Optional

import torch
import torch.distributed as dist

from megadare.config import Config
from megadare.convert.hf_megatron import load_hf_into_model
from megadare.data.tokenizer import VOCABULARY_FILES, ByteTokenizer, HFTokenizer
from megadare.errors import ConfigError, RunStateError
from megadare.models import build_hf_model, save_hf_model
from megadare.models.family import ModelArch, read_hf_config
from megadare.models.experts import experts_module
from megadare.models.gpt import DTYPES, LayerModules, transformer_config, build_model_chunks
from megadare.models.norm import FusedRMSNorm, RMSNorm
from megadare.models.head import HeadSettings
from megadare.models import step_fusions
from megadare.trainer.spec import ModelSource, model_source, source_of


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def resolve_model_source(cfg: Config) -> ModelSource:
    """The config's model source, its tiny checkpoint written (``materialise``)."""
    return materialise(model_source(cfg), cfg)


def materialise(src: Optional[ModelSource], cfg: Config) -> ModelSource:
    """``src`` ready to load on every rank: a tiny random model is written once by rank 0 (seeded by ``seed``)
    under ``<run_dir>/init_hf``, then read back from there."""
    m = cfg.model
    if src is None or not (m.hf_path or src.tiny):
        raise ConfigError("no model: set model.hf_path (an HF checkpoint) or model.family + model.tiny=true")
    if m.hf_path:
        return src
    if os.path.exists(os.path.join(src.hf_dir, "config.json")):
        _check_same_tiny(src.hf_dir, src.hf_config)
    elif _rank0():
        _write_tiny(src, cfg.seed)
    if dist.is_initialized():
        dist.barrier()
    return replace(source_of(read_hf_config(src.hf_dir), src.hf_dir, m.block_size), tiny=True)


def _write_tiny(src: ModelSource, seed: int) -> None:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = build_hf_model(src.hf_config)
        with torch.no_grad():  # a non-trivial init: HF inits norms to 1 and biases to 0
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
    try:  # written aside and renamed into place: a failed write leaves nothing behind
        save_hf_model(model, src.hf_config, src.hf_dir)
    except OSError as e:
        raise RunStateError(
            f"writing the tiny model to {src.hf_dir} failed: {e.strerror or e}; free space (or make "
            "logging.run_dir writable), then rerun the same command"
        ) from None


def _check_same_tiny(hf_dir: str, want: dict) -> None:
    """The run directory's tiny model must be the one the config asks for (model.family, model.tiny_config): an
    earlier run there wrote it, and its checkpoints hold that model."""
    have = read_hf_config(hf_dir)
    diff = sorted(k for k in set(have) | set(want) if json.dumps(have.get(k)) != json.dumps(want.get(k)))
    if diff:
        shown = ", ".join(f"{k} {have.get(k)!r} vs {want.get(k)!r}" for k in diff[:4])
        raise RunStateError(
            f"{hf_dir} holds the tiny model an earlier run in this directory trained, which differs "
            f"from this config's (there vs here: {shown}); use a new logging.run_dir, or restore "
            "model.family / model.tiny_config"
        )


def training_transformer_config(cfg: Config, arch: ModelArch, elementwise: Optional[bool] = None):
    """TransformerConfig for training: dtype, SP, recomputation, MoE balancing as the family specifies, the step
    fusions asked for (models/step_fusions.py); ``elementwise``: ``train.fused_elementwise`` as it runs, where the
    caller has it already (None: worked out here)."""
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
    if elementwise is None:
        elementwise = step_fusions.elementwise_on(t.fused_elementwise, arch.is_moe, cfg.model.dtype)
    over.update(step_fusions.config_overrides(t.gradient_accumulation_fusion, elementwise))
    return transformer_config(arch, cfg.model.dtype, **over)


def build_training_chunks(cfg: Config, src: ModelSource) -> list[torch.nn.Module]:
    """This rank's model chunks with the source weights loaded (HF straight into the shards); their output layer
    runs as ``train.logits`` says (models/head.py), their norms fused under ``train.fused_elementwise``, their
    MoE experts as ``train.grouped_experts`` says (models/experts.py)."""
    fused = step_fusions.elementwise_on(cfg.train.fused_elementwise, src.arch.is_moe, cfg.model.dtype)
    tcfg = training_transformer_config(cfg, src.arch, fused)
    experts = LayerModules.experts
    if src.arch.is_moe:
        like = torch.empty(0, dtype=DTYPES[cfg.model.dtype], device="cuda" if torch.cuda.is_available() else "cpu")
        experts = experts_module(cfg.train.grouped_experts, tcfg, like)
    chunks = build_model_chunks(
        src.arch,
        tcfg,
        attention_backend=cfg.model.attention_backend,
        head=HeadSettings(cfg.train.logits, cfg.train.logits_chunk_mb),
        modules=LayerModules(norm=FusedRMSNorm if fused else RMSNorm, experts=experts),
    )
    load_hf_into_model(chunks, src.hf_dir)
    return chunks


def tokenizer_for(cfg: Config, src: ModelSource, generates: bool = False):
    """The HF tokenizer of the checkpoint, or the byte tokenizer for tiny random models. ``generates``: the run
    samples from the model (rl, eval), so every id the model can sample must decode."""
    if cfg.model.tiny:
        tok = ByteTokenizer()
        if tok.mask_token_id != src.arch.mask_token_id or tok.vocab_size > src.arch.vocab_size:
            raise ConfigError(
                f"the byte tokenizer (vocab {tok.vocab_size}, mask {tok.mask_token_id}) does not fit "
                f"the tiny {src.arch.family} model (vocab {src.arch.vocab_size}, mask "
                f"{src.arch.mask_token_id})"
            )
        if generates and src.arch.vocab_size > tok.vocab_size:
            raise ConfigError(
                f"model.tiny_config: vocab_size {src.arch.vocab_size} is larger than the byte tokenizer's "
                f"{tok.vocab_size} ids, and the engine samples from every id: leave vocab_size out (a larger "
                "vocabulary needs model.hf_path, a checkpoint with its tokenizer)"
            )
        return tok
    if not any(os.path.exists(os.path.join(src.hf_dir, f)) for f in VOCABULARY_FILES):
        # transformers >= 5 then builds an empty tokenizer of the model type instead of failing
        byte = ByteTokenizer()
        tiny = (src.arch.vocab_size, src.arch.mask_token_id) == (byte.vocab_size, byte.mask_token_id)
        raise ConfigError(
            f"model.hf_path={src.hf_dir} has no tokenizer (none of {', '.join(VOCABULARY_FILES)}); "
            + (
                f"its {byte.vocab_size}-id vocabulary with mask id {byte.mask_token_id} is megadare's byte "
                "tokenizer's (a tiny model's export, e.g. the demo's): add model.tiny=true"
                if tiny
                else "copy the model's tokenizer files into it"
            )
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
