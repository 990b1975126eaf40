"""Lean torch models in the publishers' HF layout, one shared decoder (common.py) named by each family's table."""

from megadare.models.hf.common import DecoderLM, KVCache, RMSNorm, apply_rope, decoder_family, rope_cos_sin, route

__all__ = ["DecoderLM", "KVCache", "RMSNorm", "apply_rope", "decoder_family", "rope_cos_sin", "route"]
