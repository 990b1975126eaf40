"""Tiny random HF checkpoints of the real families for tests (perturbed so every weight matters)."""

from __future__ import annotations

import os

import torch


def write_tiny_hf(root, name: str, seed: int, **config_overrides) -> str:
    from megadare.models import build_hf_model, get_family, save_hf_model

    torch.manual_seed(seed)
    cfg = get_family(name).tiny_config(**config_overrides)
    model = build_hf_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    d = os.path.join(str(root), f"{name}_{seed}")
    save_hf_model(model, cfg, d)
    return d
