"""Lean HF-layout decoder used by every family: parameter names come from the family's ``HFNames`` table.

The family table (models/mapping.py ``HFNames``) is the single statement of a checkpoint's parameter names:
the converter maps them to Megatron keys, and this module registers every parameter under exactly that name,
so ``load_state_dict`` of a published checkpoint works and the names can never drift between the two.

The math is plain and visible (nanoGPT-style): RMSNorm (HF op order), RoPE with rotate-half on the first
``rotary_dim`` dims, SDPA attention with a boolean mask (True = attend), SwiGLU MLPs, and two MoE routers:
softmax top-k (Qwen3-MoE) and sigmoid + expert bias + group-limited top-k + routed scaling (LLaDA2 / Ling 2.0).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megadare.models.mapping import HFNames
from megadare.models.attention import MaskSpec, bidirectional, block_causal
from megadare.models.family import ModelArch


class KVCache:
    """Per-layer keys/values [B, kv_heads, T, head_dim] (after RoPE and QK norm) of tokens already decoded.

    Block diffusion caches every completed block (exact: a block-causal model's keys of earlier blocks do not
    depend on later tokens); full-attention samplers may cache a prefix as an approximation (Fast-dLLM).
    """

    def __init__(self, num_layers: int):
        self.k: list[Optional[torch.Tensor]] = [None] * num_layers
        self.v: list[Optional[torch.Tensor]] = [None] * num_layers
        self.columns: Optional[torch.Tensor] = None   # after select(): the sequence positions of the keys

    def __len__(self) -> int:
        return 0 if self.k[0] is None else int(self.k[0].shape[2])

    def select(self, index: torch.Tensor) -> "KVCache":
        """A cache holding only the key columns ``index`` (order is free: RoPE is already in the keys)."""
        out = KVCache(len(self.k))
        out.k = [None if t is None else t[:, :, index] for t in self.k]
        out.v = [None if t is None else t[:, :, index] for t in self.v]
        out.columns = index.cpu()
        return out

    def extended(self, i: int, k: torch.Tensor, v: torch.Tensor, commit: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of the cache followed by the new ones; stored when ``commit``."""
        if self.k[i] is not None:
            k = torch.cat([self.k[i], k], dim=2)
            v = torch.cat([self.v[i], v], dim=2)
        if commit:
            self.k[i], self.v[i] = k, v
        return k, v


class RMSNorm(nn.Module):
    """weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype) -- the op order of HF's Qwen3RMSNorm."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Router(nn.Module):
    """A MoE gate: ``weight`` [E, hidden] and, for sigmoid routers, the ``expert_bias`` buffer (selection only)."""

    def __init__(self, hidden: int, experts: int, expert_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        nn.init.normal_(self.weight, std=0.02)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(experts))
        else:
            self.expert_bias = None


def rope_cos_sin(positions: torch.Tensor, rot_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, S, rot_dim] for positions [B, S]: inv_freq_j = theta^(-2j/rot_dim), halves duplicated.

    inv_freq is computed on the CPU (as HF's rotary embedding computes its buffer) and then moved to the
    positions' device, so the engine on a GPU uses the same frequencies bit for bit."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, D]: rotate-half RoPE on the first cos.shape[-1] dims, the rest passes through."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    x1, x2 = rot[..., : r // 2], rot[..., r // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def _mlp(x: torch.Tensor, gate: nn.Linear, up: nn.Linear, down: nn.Linear) -> torch.Tensor:
    return down(F.silu(gate(x)) * up(x))


def route(logits: torch.Tensor, arch: ModelArch, expert_bias: Optional[torch.Tensor]):
    """Top-k expert indices [T, k] and weights [T, k] (fp32) for router logits [T, E].

    softmax (Qwen3-MoE): w = softmax(logits); top-k; renormalise if norm_topk_prob.
    sigmoid (LLaDA2): s = sigmoid(logits); choose on s + expert_bias, restricted to the top ``topk_group``
    groups ranked by the sum of their top-2 scores; w = s of the chosen, renormalised (+1e-20), times
    ``routed_scaling_factor``.
    """
    logits = logits.float()
    k = arch.moe_topk
    if arch.moe_score_function == "softmax":
        w = torch.softmax(logits, dim=-1)
        topw, topi = torch.topk(w, k, dim=-1)
        if arch.moe_norm_topk_prob:
            topw = topw / topw.sum(-1, keepdim=True)
        return topi, topw * arch.moe_routed_scaling
    s = torch.sigmoid(logits)
    sel = s + expert_bias if expert_bias is not None else s
    if arch.moe_num_groups:
        T, E = sel.shape
        g = sel.view(T, arch.moe_num_groups, -1).topk(2, dim=-1)[0].sum(-1)
        gi = torch.topk(g, arch.moe_topk_groups, dim=-1, sorted=False)[1]
        gmask = torch.zeros_like(g).scatter_(1, gi, 1).bool()
        sel = sel.masked_fill(~gmask.repeat_interleave(E // arch.moe_num_groups, dim=1), float("-inf"))
    topi = torch.topk(sel, k, dim=-1)[1]
    topw = s.gather(1, topi)
    if k > 1 and arch.moe_norm_topk_prob:
        topw = topw / (topw.sum(-1, keepdim=True) + 1e-20)
    return topi, topw * arch.moe_routed_scaling


class DecoderLM(nn.Module):
    """A decoder-only LM whose parameters live at the family's HF names; forward -> logits [B, S, V]."""

    def __init__(self, arch: ModelArch, names: HFNames):
        super().__init__()
        self.arch, self.names = arch, names
        a = arch
        self._place(names.embed, nn.Embedding(a.vocab_size, a.hidden_size))
        self._place(names.final_norm, RMSNorm(a.hidden_size, a.rms_norm_eps))
        if not a.tie_word_embeddings:
            self._place(names.lm_head, nn.Linear(a.hidden_size, a.vocab_size, bias=False))
        q_out, kv_out = a.num_attention_heads * a.head_dim, a.num_kv_heads * a.head_dim
        moe = set(a.moe_layers())
        for i in range(a.num_layers):
            f = lambda t, **kw: t.format(i=i, **kw)  # noqa: E731
            self._place(f(names.input_norm), RMSNorm(a.hidden_size, a.rms_norm_eps))
            self._place(f(names.post_norm), RMSNorm(a.hidden_size, a.rms_norm_eps))
            if names.qkv:
                self._place(f(names.qkv), nn.Linear(a.hidden_size, q_out + 2 * kv_out, bias=a.qkv_bias))
            else:
                self._place(f(names.q), nn.Linear(a.hidden_size, q_out, bias=a.qkv_bias))
                self._place(f(names.k), nn.Linear(a.hidden_size, kv_out, bias=a.qkv_bias))
                self._place(f(names.v), nn.Linear(a.hidden_size, kv_out, bias=a.qkv_bias))
            if a.qk_norm:
                self._place(f(names.q_norm), RMSNorm(a.head_dim, a.rms_norm_eps))
                self._place(f(names.k_norm), RMSNorm(a.head_dim, a.rms_norm_eps))
            self._place(f(names.o), nn.Linear(q_out, a.hidden_size, bias=False))
            if i in moe:
                self._place(f(names.router), Router(a.hidden_size, a.num_experts, a.moe_expert_bias))
                for e in range(a.num_experts):
                    self._swiglu(f(names.expert_gate, e=e), f(names.expert_up, e=e), f(names.expert_down, e=e),
                                 a.moe_ffn_hidden_size)
                if a.num_shared_experts:
                    self._swiglu(f(names.shared_gate), f(names.shared_up), f(names.shared_down),
                                 a.moe_ffn_hidden_size * a.num_shared_experts)
            else:
                self._swiglu(f(names.gate), f(names.up), f(names.down), a.ffn_hidden_size)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    # ----------------------------------------------------------------- construction by name
    def _place(self, param_name: str, module: nn.Module) -> None:
        """Register ``module`` so that its parameter gets the full HF name ``param_name``."""
        path = param_name.rsplit(".", 1)[0]
        parent: nn.Module = self
        parts = path.split(".")
        for p in parts[:-1]:
            if not hasattr(parent, p):
                parent.add_module(p, nn.Module())
            parent = getattr(parent, p)
        parent.add_module(parts[-1], module)

    def _swiglu(self, gate: str, up: str, down: str, width: int) -> None:
        h = self.arch.hidden_size
        self._place(gate, nn.Linear(h, width, bias=False))
        self._place(up, nn.Linear(h, width, bias=False))
        self._place(down, nn.Linear(width, h, bias=False))

    def sub(self, param_name: str) -> nn.Module:
        return self.get_submodule(param_name.rsplit(".", 1)[0])

    # ----------------------------------------------------------------- forward
    def default_mask(self, block_size: Optional[int] = None) -> MaskSpec:
        if self.arch.attention == "block_causal":
            return block_causal(block_size or self.arch.block_size)
        return bidirectional()

    def _allowed(self, attention_mask, S: int, device, block_size: Optional[int]) -> torch.Tensor:
        if attention_mask is None or isinstance(attention_mask, MaskSpec):
            spec = attention_mask or self.default_mask(block_size)
            return spec.dense(S, S, device=device)
        m = attention_mask
        if m.dim() == 2 and not (m.dtype == torch.bool and m.shape == (S, S)):
            # [B, S] key padding (1 = real token), on top of the family's own mask
            return self.default_mask(block_size).dense(S, S, device=device) & m.bool()[:, None, None, :]
        m = m.bool()
        while m.dim() < 4:
            m = m.unsqueeze(0)
        return m

    def forward(self, input_ids: torch.Tensor, attention_mask=None, position_ids: Optional[torch.Tensor] = None,
                block_size: Optional[int] = None, kv_cache: Optional[KVCache] = None,
                commit: bool = False) -> torch.Tensor:
        """Logits [B, S, vocab]. With ``kv_cache`` the queries are ``input_ids`` and the keys are the cached tokens
        followed by them; ``attention_mask`` must then be an explicit bool [B|1, 1, S, T + S] (True = attend)
        and ``position_ids`` are required. ``commit`` appends this call's keys/values to the cache."""
        a, n = self.arch, self.names
        B, S = input_ids.shape
        if kv_cache is not None:
            if not (torch.is_tensor(attention_mask) and attention_mask.dim() == 4 and position_ids is not None):
                raise ValueError("decoding with a KV cache needs position_ids and a [B, 1, S, T+S] bool mask")
            allowed = attention_mask.bool()
        else:
            if position_ids is None:
                position_ids = torch.arange(S, device=input_ids.device).expand(B, S)
            allowed = self._allowed(attention_mask, S, input_ids.device, block_size)
        rot = int(a.head_dim * a.rotary_percent)
        cos, sin = rope_cos_sin(position_ids, rot, a.rope_theta)
        x = self.sub(n.embed)(input_ids)
        moe = set(a.moe_layers())
        for i in range(a.num_layers):
            f = lambda t, **kw: t.format(i=i, **kw)  # noqa: E731
            h = self.sub(f(n.input_norm))(x)
            x = x + self._attention(h, i, allowed, cos, sin, kv_cache, commit)
            h = self.sub(f(n.post_norm))(x)
            x = x + (self._moe(h, i) if i in moe else _mlp(h, self.sub(f(n.gate)), self.sub(f(n.up)),
                                                          self.sub(f(n.down))))
        x = self.sub(n.final_norm)(x)
        w = self.sub(n.embed).weight if a.tie_word_embeddings else self.sub(n.lm_head).weight
        return F.linear(x, w)

    def _attention(self, h, i, allowed, cos, sin, kv_cache: Optional[KVCache] = None, commit: bool = False):
        a, n = self.arch, self.names
        f = lambda t: t.format(i=i)  # noqa: E731
        B, S, _ = h.shape
        H, G, D = a.num_attention_heads, a.num_kv_heads, a.head_dim
        if n.qkv:
            q, k, v = self.sub(f(n.qkv))(h).view(B, S, H + 2 * G, D).split([H, G, G], dim=2)
        else:
            q = self.sub(f(n.q))(h).view(B, S, H, D)
            k = self.sub(f(n.k))(h).view(B, S, G, D)
            v = self.sub(f(n.v))(h).view(B, S, G, D)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if a.qk_norm:
            q, k = self.sub(f(n.q_norm))(q), self.sub(f(n.k_norm))(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.extended(i, k, v, commit)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=H != G)
        return self.sub(f(n.o))(out.transpose(1, 2).reshape(B, S, H * D))

    def _moe(self, h, i):
        a, n = self.arch, self.names
        f = lambda t, **kw: t.format(i=i, **kw)  # noqa: E731
        B, S, C = h.shape
        x = h.reshape(-1, C)
        router = self.sub(f(n.router))
        topi, topw = route(F.linear(x.float(), router.weight.float()), a, router.expert_bias)
        y = torch.zeros_like(x, dtype=torch.float32)
        for e in range(a.num_experts):
            tok, slot = (topi == e).nonzero(as_tuple=True)
            if tok.numel():
                out = _mlp(x[tok], self.sub(f(n.expert_gate, e=e)), self.sub(f(n.expert_up, e=e)),
                           self.sub(f(n.expert_down, e=e)))
                y.index_add_(0, tok, out.float() * topw[tok, slot, None])
        y = y.to(h.dtype).view(B, S, C)
        if a.num_shared_experts:
            y = y + _mlp(h, self.sub(f(n.shared_gate)), self.sub(f(n.shared_up)), self.sub(f(n.shared_down)))
        return y
