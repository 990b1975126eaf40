"""Model families: recognise a checkpoint, build its hf/ reference model or its Megatron model.

load_hf_model(path)             config.json + *.safetensors (single or sharded) -> hf/ model, strict
hf_shape_mismatches(cfg, r)     the tensors whose header shape is not the one config.json's model has
build_hf_model(cfg)             random-initialised hf/ model for a config.json dict
perturb_(model)                 random weights that all matter (norms off one, expert biases off zero)
save_hf_model(model, cfg, dir)  HF-layout checkpoint (sharded safetensors + index + config.json)
"""

from __future__ import annotations

import os

import torch

from megadare.models.family import (
    FAMILIES,
    Family,
    ModelArch,
    ModelConfigError,
    family_of,
    get_family,
    read_hf_config,
)
from megadare.models.safetensors_io import CheckpointError, SafetensorsReader, save_hf_checkpoint

__all__ = [
    "FAMILIES",
    "Family",
    "ModelArch",
    "ModelConfigError",
    "family_of",
    "get_family",
    "read_hf_config",
    "build_hf_model",
    "load_hf_model",
    "hf_shape_mismatches",
    "perturb_",
    "save_hf_model",
]


def build_hf_model(cfg: dict) -> torch.nn.Module:
    return family_of(cfg).hf_model(cfg)


def load_hf_model(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> torch.nn.Module:
    """The family's hf/ model with the checkpoint's weights; missing or unexpected tensors are errors."""
    cfg = read_hf_config(path)
    fam = family_of(cfg)
    with torch.device("meta"):
        model = fam.hf_model(cfg)
    want = model.state_dict()
    ignore = fam.extra.get("ignore_hf", ())
    with SafetensorsReader(path) as r:
        have = {k for k in r.keys() if not any(k.endswith(s) for s in ignore)}
        missing, unexpected = sorted(set(want) - have), sorted(have - set(want))
        if missing or unexpected:
            raise CheckpointError(
                f"{os.fspath(path)}: checkpoint does not match config.json: "
                f"missing {missing[:8]}, unexpected {unexpected[:8]}"
            )
        wrong = _shape_mismatches({k: list(v.shape) for k, v in want.items()}, r)
        if wrong:
            raise CheckpointError(f"{os.fspath(path)}: config.json does not describe these weights ({wrong})")
        state = {k: r.get(k).to(dtype) for k in want}
    model.load_state_dict(state, assign=True)
    return model.to(device).eval()


def hf_shape_mismatches(cfg: dict, reader: SafetensorsReader) -> str:
    """The tensors in ``reader`` whose header shape is not the one the family's hf/ model built from ``cfg`` has
    ("name is [a, b], config.json gives [c, d]", the first three and a count), else ''. Built on the meta device:
    no weight is allocated or read. Names on one side only are the name checks' to report."""
    with torch.device("meta"):
        model = family_of(cfg).hf_model(cfg)
    return _shape_mismatches({k: list(v.shape) for k, v in model.state_dict().items()}, reader)


def _shape_mismatches(want: dict[str, list[int]], reader: SafetensorsReader) -> str:
    have = set(reader.keys())
    wrong = [
        f"{k} is {reader.shape(k)}, config.json gives {s}"
        for k, s in want.items()
        if k in have and reader.shape(k) != s
    ]
    more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
    return "; ".join(wrong[:3]) + more


def perturb_(model: torch.nn.Module, scale: float = 0.05, expert_bias_scale: float = 0.1) -> torch.nn.Module:
    """Random weights that all matter (parity tests and checks): every parameter moved by N(0, scale^2) (a fresh
    model's norms are all ones, its biases zeros), every MoE expert-bias buffer drawn from N(0, expert_bias_scale^2)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
        for n, b in model.named_buffers():
            if "expert_bias" in n:
                b.copy_(torch.randn_like(b) * expert_bias_scale)
    return model


def save_hf_model(model: torch.nn.Module, cfg: dict, out_dir: str | os.PathLike, max_shard_bytes: int = 2 << 30) -> str:
    state = {k: v.detach() for k, v in model.state_dict().items()}
    return save_hf_checkpoint(state, cfg, out_dir, max_shard_bytes=max_shard_bytes)
