"""Routed experts through grouped GEMMs, with megatron's ``SequentialMLP`` parameters (``train.grouped_experts``).

megatron-core trains experts without Transformer Engine or the ``grouped_gemm`` package in ``SequentialMLP``: a
Python loop over the local experts, each an ``MLP`` of two linear layers, so a layer costs 2 GEMMs per expert each
way (3 with the weight gradients) and ~10 small kernels per expert around them. With 64-256 small experts per layer
that is launch-bound on a GPU (the small SDAR-MoE shape trained at 2.2-2.6% MFU on an H200, 8.3% with this module:
benchmarks/GPU.md).
``torch._grouped_mm`` does each projection of every expert in one call: rows sorted by expert, ``offs`` the
cumulative row counts, a [E, in, out] weight.

``GroupedExperts`` is ``SequentialMLP`` with its forward swapped (a spec module, not a fork): the parameters stay
the experts' own ``local_experts.{i}.linear_fc1.weight`` [2F, H] ([gate; up]) and ``linear_fc2.weight`` [H, F], so
checkpoints, converters, weight sync, LoRA and the optimizer see the same model. For rows x_e of expert e with
router probabilities p_e (megatron's order of operations, MLP.forward):

    h_e = x_e W1_e^T,   a_e = silu(h_e[:, :F]) * h_e[:, F:],   s_e = (a_e * p_e).to(dtype),   y_e = s_e W2_e^T

The weights are stacked into [E, 2F, H] and [E, H, F] inside the forward and again in the backward instead of
being kept (autograd would hold a copy of every expert weight from the forward to the backward). The backward
(rows T, per expert e):

    ds_e = dy_e W2_e          dW2_e = dy_e^T s_e
    dh, dp = the autograd of the elementwise part (the same ops as the forward, so the same roundings; megatron's
             compiled weighted SwiGLU where ``bias_activation_fusion`` is on, as in MLP.forward)
    dx_e = dh_e W1_e          dW1_e = dh_e^T x_e

The weight gradients come from one grouped GEMM each ([E, out, in], offs along the rows), split per expert.
Where the grouped GEMM does not run (a device or dtype without the kernel, strides not 16-byte aligned, an fp8
recipe, biases, another activation) the module runs ``SequentialMLP``'s own forward (``grouped_runs``);
``train.grouped_experts=true`` is refused there (``experts_module``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.transformer.moe.experts import SequentialMLP

from megadare.errors import ConfigError
from megadare.models.hf.common import grouped_mm, grouped_gemm_runs


class _GroupedSwiGLU(torch.autograd.Function):
    """y = SwiGLU experts of token-sorted rows (module doc); inputs x, ends, probs, (n, fused), then n fc1 and n fc2
    weights (``fused``: megatron's compiled weighted SwiGLU, ``train.fused_elementwise``)."""

    @staticmethod
    def forward(ctx, x, ends, probs, how, *weights):
        n, fused = how
        h = grouped_mm(x, torch.stack(weights[:n]).transpose(1, 2), offs=ends)
        scaled = _scaled_swiglu(h, probs, fused)
        y = grouped_mm(scaled, torch.stack(weights[n:]).transpose(1, 2), offs=ends)
        ctx.n, ctx.fused = n, fused
        ctx.save_for_backward(x, ends, probs, h, scaled, *weights)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, ends, probs, h, scaled, *weights = ctx.saved_tensors
        n, weight_grads = ctx.n, any(ctx.needs_input_grad[4:])  # none under LoRA (frozen experts)
        dy = dy.contiguous()
        d_scaled = grouped_mm(dy, torch.stack(weights[n:]), offs=ends)
        dw2 = grouped_mm(dy.t(), scaled, offs=ends).unbind(0) if weight_grads else (None,) * n
        with torch.enable_grad():
            h_ = h.detach().requires_grad_()
            p_ = probs.detach().requires_grad_(ctx.needs_input_grad[2])
            wrt = (h_, p_) if p_.requires_grad else (h_,)
            dh, *dp = torch.autograd.grad(_scaled_swiglu(h_, p_, ctx.fused), wrt, d_scaled)
        dx = grouped_mm(dh, torch.stack(weights[:n]), offs=ends)
        dw1 = grouped_mm(dh.t(), x, offs=ends).unbind(0) if weight_grads else (None,) * n
        return (dx, None, dp[0] if dp else None, None, *dw1, *dw2)


def _scaled_swiglu(h: torch.Tensor, probs: torch.Tensor, fused: bool) -> torch.Tensor:
    """MLP.forward's gated activation times the router probability, back in the compute dtype: megatron's compiled
    ``weighted_bias_swiglu_impl`` where ``bias_activation_fusion`` is on, its unfused ops otherwise."""
    if fused:
        return weighted_bias_swiglu_impl(h, None, probs.unsqueeze(-1))
    gate, up = torch.chunk(h, 2, dim=-1)
    act = F.silu(gate) * up
    return (act * probs.unsqueeze(-1)).to(act.dtype)


def grouped_runs(config, like: torch.Tensor) -> bool:
    """Whether ``GroupedExperts`` of ``config`` takes the grouped path for weights like ``like`` (its device and
    dtype)."""
    return refusal(config, like) is None


def refusal(config, like: torch.Tensor) -> Optional[str]:
    """Why the grouped GEMM cannot run the experts of ``config`` for weights like ``like``, or None: the layer is
    not megatron's bias-free SwiGLU with nothing else in the MLP, this torch has no kernel for the device and dtype,
    or the rows of a projection are not 16-byte aligned (the kernel's stride rule)."""
    swiglu = config.gated_linear_unit and config.activation_func is F.silu and not config.add_bias_linear
    extras = {
        "fp8": config.fp8,
        "fp4": getattr(config, "fp4", None),
        "activation_func_clamp_value": getattr(config, "activation_func_clamp_value", None),
        "glu_linear_offset": getattr(config, "glu_linear_offset", 0.0),
        "use_te_activation_func": getattr(config, "use_te_activation_func", False),
        "activation_func_fp8_input_store": getattr(config, "activation_func_fp8_input_store", False),
    }
    if not swiglu or any(extras.values()):
        named = ", ".join(k for k, v in extras.items() if v) or "another activation or biases"
        return f"the experts are not megatron's bias-free SwiGLU MLP ({named})"
    ffn = config.moe_ffn_hidden_size // config.expert_tensor_parallel_size
    if any(d * like.element_size() % 16 for d in (config.hidden_size, ffn)):
        return (
            f"hidden size {config.hidden_size} or expert FFN width {ffn} (per expert-TP rank) is not a multiple of "
            f"{16 // like.element_size()} {str(like.dtype).removeprefix('torch.')} values (16 bytes)"
        )
    if not grouped_gemm_runs(like):
        return f"torch {torch.__version__} has no grouped GEMM for {like.dtype} on {like.device.type}"
    return None


def experts_module(setting: Optional[bool], config, like: torch.Tensor) -> type:
    """The experts module of a training layer spec for ``train.grouped_experts``: True ``GroupedExperts`` (refused
    where the grouped GEMM cannot run, ``like``: a tensor of the weights' device and dtype), False megatron's
    ``SequentialMLP``, None (auto) ``GroupedExperts`` wherever the grouped GEMM runs: measured faster on a CPU (the
    layer 1.32-1.45x, benchmarks/moe_experts.py; the tiny MoE step 1.06x on average, train_throughput.py
    ``--variants grouped``) with bitwise the same results, and on an H200 (the layer 6.0x, bitwise the same in bf16;
    the small MoE step 3.23x, 2.6% -> 8.3% MFU, its first gradient norm within bf16 rounding)."""
    if setting is None:
        setting = grouped_runs(config, like)
    elif setting and (why := refusal(config, like)):
        raise ConfigError(f"train.grouped_experts=true: {why}; set train.grouped_experts=false or leave it unset")
    return GroupedExperts if setting else SequentialMLP


class GroupedExperts(SequentialMLP):
    """``SequentialMLP`` whose forward runs every local expert in two grouped GEMMs (module doc)."""

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x = permuted_local_hidden_states
        if self.num_local_experts == 1 or x.shape[0] == 0 or self.config.moe_apply_probs_on_input:
            return super().forward(x, tokens_per_expert, permuted_probs)
        if not hasattr(self, "_grouped"):  # decided once, on the first forward (the weights' device and dtype)
            self._grouped = grouped_runs(self.config, self.local_experts[0].linear_fc1.weight)
        if not self._grouped:
            return super().forward(x, tokens_per_expert, permuted_probs)
        ends = tokens_per_expert.to(device=x.device, dtype=torch.int32, non_blocking=True).cumsum(0, dtype=torch.int32)
        x = x.contiguous()  # the kernel refuses row strides that are not 16-byte multiples; SequentialMLP takes any
        fc1 = [e.linear_fc1.weight for e in self.local_experts]
        fc2 = [e.linear_fc2.weight for e in self.local_experts]
        how = (len(fc1), bool(self.config.bias_activation_fusion))
        return _GroupedSwiGLU.apply(x, ends, permuted_probs, how, *fc1, *fc2), None
