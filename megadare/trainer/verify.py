"""Per-rank workers that check Megatron layouts against the hf/ reference (tests, the demo, `spawn`).

``megatron_logits`` builds a family's Megatron model under a layout, loads an HF checkpoint straight into the
shards (optionally also a Megatron checkpoint), and returns full logits; ``resave`` loads a checkpoint under a
layout and saves it again from the sharded model. Run them with ``megadare.parallel.launch.spawn``.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state

from megadare.convert.hf_megatron import load_checkpoint, load_hf_into_model, save_checkpoint
from megadare.models import gpt
from megadare.models.attention import family_mask
from megadare.models.family import family_of, read_hf_config
from megadare.parallel import Layout, destroy_distributed, init_distributed
from megadare.trainer.forward import forward_logits


def _build(hf_dir: str, sp: bool):
    cfg = read_hf_config(hf_dir)
    fam = family_of(cfg)
    arch = fam.arch(cfg)
    tcfg = gpt.transformer_config(arch, sequence_parallel=sp)
    chunks = gpt.build_model_chunks(arch, tcfg, attention_backend="sdpa")
    return arch, chunks


def megatron_logits(
    rank: int,
    world: int,
    layout: dict,
    cases: list[dict],
    save_to: Optional[dict] = None,
    load_from: Optional[dict] = None,
) -> dict:
    """For each case (hf_dir, input_ids): logits of the Megatron model under ``layout``.

    Weights come from the HF checkpoint (load_hf_into_model) and, where ``load_from[name]`` names a Megatron
    checkpoint, also from that checkpoint (returned as ``<name>/ckpt``). ``save_to[name]`` saves the model.
    Returns {case name: logits} from the rank that holds full logits (last PP stage, TP rank 0), else {}.
    """
    init_distributed(Layout(**layout))
    out: dict[str, torch.Tensor] = {}
    try:
        for case in cases:
            name, hf_dir, ids = case["name"], case["hf_dir"], case["input_ids"]
            arch, chunks = _build(hf_dir, layout.get("sp", False))
            mask = family_mask(arch)
            load_hf_into_model(chunks, hf_dir)
            results = {name: forward_logits(chunks, ids, arch.vocab_size, mask)}
            if save_to and name in save_to:
                save_checkpoint(chunks, save_to[name], meta={"family": arch.family}, hf_files_from=hf_dir)
            if load_from and name in load_from:
                _, chunks2 = _build(hf_dir, layout.get("sp", False))
                load_checkpoint(chunks2, load_from[name])
                results[name + "/ckpt"] = forward_logits(chunks2, ids, arch.vocab_size, mask)
            holder = (
                parallel_state.is_pipeline_last_stage(ignore_virtual=True)
                and parallel_state.get_tensor_model_parallel_rank() == 0
                and parallel_state.get_data_parallel_rank() == 0
            )
            if holder:
                out.update({k: v.cpu() for k, v in results.items() if v is not None})
    finally:
        destroy_distributed()
    return out


def resave(rank: int, world: int, layout: dict, hf_dir: str, src_ckpt: str, dst_ckpt: str) -> bool:
    """Load a checkpoint under ``layout`` and save it again from the sharded model (round-trip tests)."""
    init_distributed(Layout(**layout))
    try:
        arch, chunks = _build(hf_dir, layout.get("sp", False))
        load_checkpoint(chunks, src_ckpt)
        save_checkpoint(chunks, dst_ckpt, meta={"family": arch.family}, hf_files_from=hf_dir)
    finally:
        destroy_distributed()
    return True
