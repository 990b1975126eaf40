"""RMSNorm for Megatron layer specs, matching HF's Qwen3/Llama RMSNorm op order, with sequence parallelism.

y = weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype)   (Zhang & Sennrich 2019, as in HF)

Under sequence parallelism each TP rank normalises its own slice of the sequence, so the weight gradient is a
partial sum: the weight is tagged ``sequence_parallel`` and megatron's finalize_model_grads all-reduces it over
TP, exactly as for TE's / apex's norms (megatron's torch norm refuses SP instead).

``FusedRMSNorm`` (``train.fused_elementwise``, models/step_fusions.py): the same norm as one kernel each way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megadare.models import step_fusions


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's op order: normalise in fp32, round to the input's dtype, then multiply by the weight."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class RMSNorm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_: object):
        super().__init__()
        self.config = config
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {}, sharded_offsets)


class FusedRMSNorm(RMSNorm):
    """``RMSNorm`` as one kernel forward and one (plus the weight's reduction) backward: torch's fused CUDA kernel
    where it exists and the dtypes match, else ``rms_norm`` compiled (step_fusions.py says which and why)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and step_fusions.norm_path(x.device) == "aten_fused_rms_norm":
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # [tokens (x rows x heads), dim], dynamic: a view for the hidden states and for megatron's q and k (slices
        # of the fused QKV output), so every norm of a model is one of a few graphs
        rows = x.reshape(-1, x.shape[-1])
        return step_fusions.run_compiled(rms_norm, (rows, self.weight, self.eps), ((0,), ())).view(x.shape)
