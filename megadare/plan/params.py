"""Parameter counts from a ``ModelArch``: the whole model, per token (active), and per GPU under a layout.

Per decoder layer (h hidden, a heads, g key/value heads, d head dim, f dense MLP width, E routed experts of width
f_e, top-k, n_s shared experts):

    attention = h*d*(a + 2g) [+ d*(a + 2g) QKV bias] + a*d*h     fused QKV + output projection (TP-split)
    norms     = 2h [+ 2d QK norm]                                 input / pre-MLP RMSNorm, per-head QK norm
    dense MLP = 3*h*f                                             SwiGLU gate, up, down (TP-split)
    MoE MLP   = E*h router + E*3*h*f_e experts + 3*h*(n_s*f_e) shared expert

    total  = V*h embedding + V*h lm head (unless tied) + h final norm + sum over layers
    active = total with E*3*h*f_e replaced by k*3*h*f_e (what one token touches, embedding and head included,
             as the published "activated" counts of Qwen3-30B-A3B and Ling 2.0 / LLaDA2.0 are stated)

LLaDA2's ``expert_bias`` (E floats per MoE layer) is a buffer, not a parameter: it is left out here (the published
safetensors totals include it, 7,936 numbers for LLaDA2.0-flash).

Per GPU (megatron-core's sharding): QKV / output projection / dense and shared MLP split over TP; norms and the
router replicated; the embedding and lm head split over TP with the vocabulary padded to a multiple of 128
(``padded_vocab_size``); routed experts split E/ep per rank, each over ETP; layers split contiguously over
pp * vpp virtual stages, stage v*pp + r living on pipeline rank r; the embedding on the first stage, the lm head
and final norm on the last (a tied embedding is kept on both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megadare.models.mapping import padded_vocab_size
from megadare.models.family import ModelArch
from megadare.parallel.layout import Layout


@dataclass(frozen=True)
class LayerParams:
    attention: int  # fused QKV (+ bias) and output projection: split over TP
    norms: int  # input / pre-MLP RMSNorm and QK norms: replicated
    mlp: int  # dense SwiGLU, or the shared expert of a MoE layer: split over TP
    router: int  # MoE router weight: replicated
    experts: int  # all routed experts: split over EP x ETP
    active_experts: int  # the top-k experts one token uses


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int
    embedding: int  # input embedding + lm head (one copy when tied)
    experts: int  # routed experts of all layers

    @property
    def active_non_embedding(self) -> int:
        return self.active - self.embedding


@dataclass(frozen=True)
class RankParams:
    """Parameters held by one GPU: dense (reduced over DP) and expert (reduced over expert-DP)."""

    dense: int
    expert: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


def layer_params(arch: ModelArch, moe: bool) -> LayerParams:
    h, d = arch.hidden_size, arch.head_dim
    qkv_out = d * (arch.num_attention_heads + 2 * arch.num_kv_heads)
    attention = h * qkv_out + (qkv_out if arch.qkv_bias else 0) + arch.num_attention_heads * d * h
    norms = 2 * h + (2 * d if arch.qk_norm else 0)
    if not moe:
        return LayerParams(attention, norms, 3 * h * arch.ffn_hidden_size, 0, 0, 0)
    one = 3 * h * arch.moe_ffn_hidden_size
    return LayerParams(
        attention,
        norms,
        arch.num_shared_experts * one,
        arch.num_experts * h,
        arch.num_experts * one,
        arch.moe_topk * one,
    )


def count_params(arch: ModelArch) -> ParamCounts:
    """Total and active parameters of the HF model (unpadded vocabulary)."""
    moe_layers = set(arch.moe_layers())
    emb = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    total = active = emb + arch.hidden_size
    experts = 0
    for i in range(arch.num_layers):
        lp = layer_params(arch, i in moe_layers)
        common = lp.attention + lp.norms + lp.mlp + lp.router
        total += common + lp.experts
        active += common + lp.active_experts
        experts += lp.experts
    return ParamCounts(total=total, active=active, embedding=emb, experts=experts)


def stage_layers(arch: ModelArch, pp: int, vpp: Optional[int], rank: int) -> list[int]:
    """Global layer indices on pipeline rank ``rank``: virtual stages rank, rank + pp, ... (megatron's order)."""
    v = vpp or 1
    per = arch.num_layers // (pp * v)
    return [i for s in range(v) for i in range((s * pp + rank) * per, (s * pp + rank + 1) * per)]


def rank_params(arch: ModelArch, lay: Layout = Layout(), rank: int = 0) -> RankParams:
    """Parameters on one GPU of pipeline rank ``rank`` under ``lay`` (the Megatron model: padded vocabulary)."""
    tp, pp, vpp, ep, etp = lay.tp, lay.pp, lay.vpp, lay.ep, lay.etp
    moe_layers = set(arch.moe_layers())
    dense = expert = 0
    for i in stage_layers(arch, pp, vpp, rank):
        lp = layer_params(arch, i in moe_layers)
        dense += (lp.attention + lp.mlp) // tp + lp.norms + lp.router
        expert += lp.experts // (ep * etp)
    vocab_shard = padded_vocab_size(arch.vocab_size, tp) // tp * arch.hidden_size
    if rank == 0:
        dense += vocab_shard
    if rank == pp - 1:
        dense += arch.hidden_size
        if not arch.tie_word_embeddings or pp > 1:
            dense += vocab_shard
    return RankParams(dense=dense, expert=expert)
