"""The rollout settings' choices, torch-free: the config schema (config/sections.py) types its ``rollout.*`` keys
with them before any engine module (and torch) loads; the engine side (engine.py, manager.py, sglang_plugin.py,
weight_sync/) checks against the same tuples."""

from __future__ import annotations

ALGORITHMS = ("low_confidence_static", "low_confidence_dynamic", "random", "editing")
CONFIDENCES = ("model_prob", "maskgit_plus", "topk_margin", "entropy")
SCHEDULES = ("even", "linspace", "linspace_first", "linspace_remaining")
WEIGHT_TRANSPORTS = ("auto", "distributed", "colocated", "object_store")  # rollout.weight_transport (weight_sync/)
ENGINE_DEVICES = ("auto", "cpu", "cuda")  # rollout.device (built-in engine)
ENGINE_DTYPES = ("auto", "float32", "bfloat16")  # rollout.dtype (built-in engine)
FULL_ATTENTION_CACHES = ("none", "prefix", "dual")  # rollout.full_attention_cache (built-in engine, Fast-dLLM)
