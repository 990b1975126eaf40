"""Model FLOPs of a training step, for TFLOP/s and MFU.

    FLOPs = 6 * N_active * tokens  +  12 * layers * hidden * sum_seq S^2

The first term is the matmuls of the (active) parameters, forward + backward (2 + 4 FLOPs per parameter per
token); the second is attention scores and values (QK^T and PV: 2 * 2 * S * hidden per token per layer,
times 3 for forward + backward), counted dense even where a block mask skips tiles. Embedding lookups are free,
the output layer is counted in N_active.
"""

from __future__ import annotations

import torch

from megadare.models.family import ModelArch

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0}


def active_params(arch: ModelArch) -> float:
    """Parameters touched per token (MoE: top-k routed + shared experts; dense layers of MoE models included)."""
    h = arch.hidden_size
    attn = h * arch.head_dim * (2 * arch.num_attention_heads + 2 * arch.num_kv_heads)
    dense_mlp = 3 * h * arch.ffn_hidden_size
    moe_layers = len(arch.moe_layers())
    moe_mlp = 3 * h * arch.moe_ffn_hidden_size * (arch.moe_topk + arch.num_shared_experts)
    n_dense = arch.num_layers - moe_layers
    return arch.num_layers * attn + n_dense * dense_mlp + moe_layers * moe_mlp + arch.vocab_size * h


def step_flops(arch: ModelArch, seq_lengths: list[int]) -> float:
    """FLOPs of forward + backward over sequences of the given lengths."""
    tokens = sum(seq_lengths)
    return 6.0 * active_params(arch) * tokens + 12.0 * arch.num_layers * arch.hidden_size * sum(
        s * s for s in seq_lengths
    )


def peak_tflops() -> float | None:
    """bf16 dense peak of the current GPU (None on CPU or an unknown GPU)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, v in PEAK_BF16_TFLOPS.items():
        if key in name:
            return v
    return None
