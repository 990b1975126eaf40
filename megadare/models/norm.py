"""RMSNorm for Megatron layer specs, matching HF's Qwen3/Llama RMSNorm op order, with sequence parallelism.

y = weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype)   (Zhang & Sennrich 2019, as in HF)

Under sequence parallelism each TP rank normalises its own slice of the sequence, so the weight gradient is a
partial sum: the weight is tagged ``sequence_parallel`` and megatron's finalize_model_grads all-reduces it over
TP, exactly as for TE's / apex's norms (megatron's torch norm refuses SP instead).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint


class RMSNorm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_: object):
        super().__init__()
        self.config = config
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {}, sharded_offsets)
