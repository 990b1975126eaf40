"""Fixes for megatron-core 0.16.1 bugs that affect megadare on every device (not only CPU).

* ``TopKRouter._apply_expert_bias`` masks padding with ``routing_map & ~padding_mask`` where routing_map is
  [tokens, experts] and padding_mask is [tokens]: the shapes do not broadcast, so passing a padding mask (to keep
  packing padding out of the expert-bias load statistics) crashes. Replaced by the same update with the mask
  broadcast over experts. Applied once, at import of models/gpt.py; a no-op on versions that fixed it.
"""
from __future__ import annotations

from typing import Optional

import torch

_APPLIED = False


def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> None:
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & (~padding_mask.reshape(-1, 1))
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core.transformer.moe.router import TopKRouter

    TopKRouter._apply_expert_bias = _apply_expert_bias
    _APPLIED = True
