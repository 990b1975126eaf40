"""Lean HF-layout decoder used by every family: parameter names come from the family's ``HFNames`` table.

The family table (models/mapping.py ``HFNames``) is the single statement of a checkpoint's parameter names:
the converter maps them to Megatron keys, and this module registers every parameter under exactly that name,
so ``load_state_dict`` of a published checkpoint works and the names can never drift between the two.

The math is plain and visible (nanoGPT-style): RMSNorm (HF op order), RoPE with rotate-half on the first
``rotary_dim`` dims, SDPA attention with a boolean mask (True = attend), SwiGLU MLPs, and two MoE routers:
softmax top-k (Qwen3-MoE) and sigmoid + expert bias + group-limited top-k + routed scaling (LLaDA2 / Ling 2.0).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode

from megadare.models.mapping import HFNames, build_table
from megadare.models.attention import MaskSpec, bidirectional, block_causal
from megadare.models.family import Family, ModelArch


class KVCache:
    """A static, preallocated key/value cache: per layer ``[rows, kv_heads, length + 1, head_dim]`` (after RoPE
    and QK norm), written in place. Column ``length`` is a scratch column for padding queries.

    Before a forward the caller :meth:`bind` s it: the rows ``[start, start + n)`` the forward's batch occupies,
    the cache column each query's keys/values go to (``write_cols`` [n, W], the query count W; the scratch column
    for a query whose keys nobody reads), and how many leading columns the queries attend (``key_len``; the mask
    passed to the model is ``[n, 1, W, key_len]``). :meth:`update` (called by every layer) writes the new
    keys/values at their columns and returns the first ``key_len`` columns of the rows. Block diffusion caches
    every completed block (exact: a block-causal model's keys of earlier blocks do not depend on later tokens);
    full-attention samplers may cache everything but the current block as an approximation (Fast-dLLM).
    """

    def __init__(self, arch, rows: int, length: int, dtype: torch.dtype = torch.float32, device=None):
        """Room for ``rows`` sequences of ``length`` positions in every layer of ``arch`` (a ``ModelArch``)."""
        shape = (rows, arch.num_kv_heads, length + 1, arch.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
        self.rows, self.length, self.dtype = rows, length, dtype
        self._rows = slice(0, 0)
        self._row_index: Optional[torch.Tensor] = None  # [n, 1] cache rows of the bound forward
        self._row_indices: dict[tuple, torch.Tensor] = {}  # (start, n, device) -> _row_index, made once (never written)
        self._cols: Optional[torch.Tensor] = None  # [n, W] the cache column of each query
        self._keys = 0

    def fits(self, rows: int, length: int, dtype: torch.dtype, device) -> bool:
        return (
            rows <= self.rows
            and length <= self.length
            and dtype == self.dtype
            and torch.device(device) == self.k[0].device
        )

    def bind(self, start: int, write_cols: torch.Tensor, key_len: int) -> None:
        n = write_cols.shape[0]
        if start + n > self.rows or key_len > self.length:
            raise ValueError(
                f"KVCache: rows [{start}, {start + n}) and {key_len} key columns exceed the cache "
                f"({self.rows} rows x {self.length} columns)"
            )
        self._rows = slice(start, start + n)
        key = (start, n, write_cols.device)
        if key not in self._row_indices:  # a decode binds every block: arange + view were 2 eager ops each time
            self._row_indices[key] = torch.arange(start, start + n, device=write_cols.device)[:, None]
        self._row_index = self._row_indices[key]
        self._cols = write_cols
        self._keys = key_len

    def update(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer ``i``'s new keys/values [n, kv_heads, W, head_dim]; the keys/values the queries attend."""
        kc, vc = self.k[i], self.v[i]
        # an index_put_ into the whole cache: compiled, it stays in place (a scatter_ into a row slice is
        # functionalised into a copy of the slice and a copy back, 2 x the cache per layer per forward on CUDA)
        kc[self._row_index, :, self._cols] = k.transpose(1, 2).to(kc.dtype)
        vc[self._row_index, :, self._cols] = v.transpose(1, 2).to(vc.dtype)
        return kc[self._rows, :, : self._keys], vc[self._rows, :, : self._keys]

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy rows ``src`` to rows ``dst`` (disjoint sets), every layer, every column."""
        for t in self.k + self.v:
            t.index_copy_(0, dst, t.index_select(0, src))


class RMSNorm(nn.Module):
    """weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype) -- the op order of HF's Qwen3RMSNorm.

    Written out again, not models/norm.rms_norm: this model is the independent side of the Megatron parity tests
    and the built-in rollout engine's model, and models/norm.py imports megatron-core."""

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
        if not self.weight.is_meta:  # meta: shapes only (nn.init on meta costs ~10 ms a call)
            nn.init.normal_(self.weight, std=0.02)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(experts))
        else:
            self.expert_bias = None


# inv_freq by (device, rot_dim, theta): it is float32 whatever the model's dtype, and its family has no RoPE scaling
_INV_FREQ: dict[tuple[torch.device, int, float], torch.Tensor] = {}


def rope_inv_freq(device: torch.device, rot_dim: int, theta: float) -> torch.Tensor:
    """inv_freq_j = theta^(-2j/rot_dim), float32 [rot_dim / 2] on ``device``: computed on the CPU (as HF's rotary
    embedding computes its buffer) and then moved, so the engine on a GPU uses the same frequencies bit for bit.
    Kept per device: computing and copying it at every forward was ~5% of the built-in engine's time. Under
    torch.compile or a fake-tensor mode it is computed afresh (a traced value, a CUDA graph's output, a fake
    tensor must not be kept)."""
    key = (device, rot_dim, float(theta))
    keep = not torch.compiler.is_compiling() and detect_fake_mode() is None
    inv_freq = _INV_FREQ.get(key) if keep else None
    if inv_freq is None:
        with torch.inference_mode(False):  # an inference tensor kept here would be refused by a later autograd use
            inv_freq = (1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))).to(device)
        if keep:
            _INV_FREQ[key] = inv_freq
    return inv_freq


def rope_cos_sin(positions: torch.Tensor, rot_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, S, rot_dim] for positions [B, S]: inv_freq (``rope_inv_freq``, on the positions' device),
    halves duplicated."""
    freqs = positions.to(torch.float32)[..., None] * rope_inv_freq(positions.device, rot_dim, theta)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, D]: rotate-half RoPE on the first cos.shape[-1] dims, the rest passes through."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def _mlp(x: torch.Tensor, linears: tuple, gate_up: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SwiGLU through ``linears`` (gate, up, down); with ``gate_up`` (``DecoderLM.fuse_projections``) gate and up
    as that one GEMM."""
    gate, up, down = linears
    if gate_up is None:
        return down(F.silu(gate(x)) * up(x))
    g, u = F.linear(x, gate_up).chunk(2, dim=-1)
    return down(F.silu(g) * u)


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
                    self._swiglu(
                        f(names.expert_gate, e=e),
                        f(names.expert_up, e=e),
                        f(names.expert_down, e=e),
                        a.moe_ffn_hidden_size,
                    )
                if a.num_shared_experts:
                    self._swiglu(
                        f(names.shared_gate),
                        f(names.shared_up),
                        f(names.shared_down),
                        a.moe_ffn_hidden_size * a.num_shared_experts,
                    )
            else:
                self._swiglu(f(names.gate), f(names.up), f(names.down), a.ffn_hidden_size)
        for m in self.modules():  # (on the meta device, shapes only: nothing to initialise)
            if isinstance(m, (nn.Linear, nn.Embedding)) and not m.weight.is_meta:
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        self._resolve()

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

    def _resolve(self) -> None:
        """Direct references to every module the forward uses, looked up once by name (not registered: the
        parameters keep their single HF names)."""
        a, n = self.arch, self.names
        head = None if a.tie_word_embeddings else self.sub(n.lm_head)
        self._io = (self.sub(n.embed), self.sub(n.final_norm), head)  # a tuple: not registered again
        moe = set(a.moe_layers())
        self._layers = [_Layer(self, i, i in moe) for i in range(a.num_layers)]

    # ----------------------------------------------------------------- forward
    def default_mask(self, block_size: Optional[int] = None) -> MaskSpec:
        if self.arch.is_block_diffusion:
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

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask=None,
        position_ids: Optional[torch.Tensor] = None,
        block_size: Optional[int] = None,
        kv_cache=None,
        logits_index: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        """Logits [B, S, vocab]. With ``kv_cache`` (a :class:`KVCache` bound for this call, or anything with its
        ``update(layer, k, v) -> (keys, values)``) the queries are ``input_ids`` and the keys are what the cache
        returns; ``attention_mask`` must then be an explicit bool [B|1, 1, S, keys] (True = attend) and
        ``position_ids`` are required. ``logits_index`` [B, m]: the logits of those positions only, [B, m, vocab]
        (the head runs on them alone; m = 0: no head, returns None)."""
        a = self.arch
        B, S = input_ids.shape
        if kv_cache is not None:
            if not (torch.is_tensor(attention_mask) and attention_mask.dim() == 4 and position_ids is not None):
                raise ValueError("decoding with a KV cache needs position_ids and a [B, 1, S, keys] bool mask")
            allowed = attention_mask.bool()
        else:
            if position_ids is None:
                position_ids = torch.arange(S, device=input_ids.device).expand(B, S)
            allowed = self._allowed(attention_mask, S, input_ids.device, block_size)
        rope = rope_cos_sin(position_ids, int(a.head_dim * a.rotary_percent), a.rope_theta)
        embed, final_norm, head = self._io
        x = embed(input_ids)
        for i, layer in enumerate(self._layers):
            x = x + self._attention(layer.input_norm(x), layer, allowed, rope, kv_cache, i)
            h = layer.post_norm(x)
            x = x + (self._moe(h, layer) if layer.moe else _mlp(h, layer.mlp, layer.fused_gate_up))
        if logits_index is not None:
            if logits_index.shape[1] == 0:
                return None
            x = x.gather(1, logits_index[..., None].expand(-1, -1, x.shape[-1]))
        return F.linear(final_norm(x), embed.weight if head is None else head.weight)

    def _attention(self, h, layer: "_Layer", allowed, rope: tuple[torch.Tensor, torch.Tensor], kv_cache, i: int):
        """Layer ``i``'s attention block; ``rope`` = (cos, sin) of ``rope_cos_sin``."""
        a = self.arch
        B, S, _ = h.shape
        H, G, D = a.num_attention_heads, a.num_kv_heads, a.head_dim
        if layer.qkv is not None or layer.fused_qkv is not None:
            qkv = layer.qkv(h) if layer.qkv is not None else F.linear(h, *layer.fused_qkv)
            q, k, v = qkv.view(B, S, H + 2 * G, D).split([H, G, G], dim=2)
        else:
            q, k, v = layer.q(h).view(B, S, H, D), layer.k(h).view(B, S, G, D), layer.v(h).view(B, S, G, D)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if kv_cache is not None:
            k, v = kv_cache.update(i, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=H != G)
        return layer.o(out.transpose(1, 2).reshape(B, S, H * D))

    def _moe(self, h, layer: "_Layer"):
        """Experts in token-sorted order (each token's experts in expert order): with the experts stacked
        (:meth:`stack_experts`) three grouped GEMMs over the sorted tokens and no host read; otherwise expert by
        expert, with one host read of the per-expert token counts per layer."""
        a = self.arch
        B, S, C = h.shape
        x = h.reshape(-1, C)
        topi, topw = route(F.linear(x.float(), layer.router.weight.float()), a, layer.router.expert_bias)
        flat = topi.reshape(-1)
        order = flat.argsort(stable=True)
        tok, slot = order // a.moe_topk, order % a.moe_topk
        counts = torch.bincount(flat, minlength=a.num_experts)
        if layer.stacked is not None:
            out = grouped_swiglu(x[tok], layer.stacked, counts.cumsum(0).to(torch.int32))
            y = torch.zeros_like(x, dtype=torch.float32).index_add_(0, tok, out.float() * topw[tok, slot, None])
        else:
            y = self._experts_one_by_one(x, layer, tok, slot, topw, counts.tolist())
        y = y.to(h.dtype).view(B, S, C)
        if layer.shared is not None:
            y = y + _mlp(h, layer.shared, layer.fused_shared_gate_up)
        return y

    @staticmethod
    def _experts_one_by_one(x, layer: "_Layer", tok, slot, topw, counts: list[int]) -> torch.Tensor:
        y = torch.zeros_like(x, dtype=torch.float32)
        start = 0
        for expert, c in zip(layer.experts, counts):
            if c:
                t, sl = tok[start : start + c], slot[start : start + c]
                y.index_add_(0, t, _mlp(x[t], expert).float() * topw[t, sl, None])
            start += c
        return y

    # ----------------------------------------------------------------- stacked experts (inference)
    def stack_experts(self, traced: bool = False) -> bool:
        """Stack every MoE layer's expert weights into three tensors [experts, out, in] (gate, up, down) whose
        slices *are* the experts' parameters (each becomes a view of its slice: loading or syncing an expert's
        HF-named tensor writes the stack), so the forward runs the experts as grouped GEMMs without a host read.
        Moving the model copies its parameters one by one and undoes this: :meth:`unstack_experts` first, stack
        again after. Returns False (nothing stacked) where grouped GEMMs do not run on this device and dtype
        (``traced``: under torch.compile)."""
        if not self.arch.is_moe or not grouped_gemm_runs(self._io[0].weight, traced):
            self.unstack_experts()  # stacked before for another engine or dtype
            return False
        for layer in (lay for lay in self._layers if lay.moe):
            stacks = []
            for j in range(3):
                weights = [expert[j].weight for expert in layer.experts]
                stack = torch.stack([w.detach() for w in weights])
                for e, w in enumerate(weights):
                    w.data = stack[e]
                stacks.append(stack)
            layer.stacked = tuple(stacks)
        return True

    def unstack_experts(self) -> None:
        """Drop the stacks (the parameters keep their values; the forward runs expert by expert)."""
        for layer in self._layers:
            layer.stacked = None

    # ----------------------------------------------------------------- fused projections (inference)
    def fuse_projections(self) -> None:
        """Each layer's q, k, v (where the HF layout keeps them apart) and the gate and up of its dense MLP or
        shared experts as one weight whose row blocks *are* the parameters (views, as in :meth:`stack_experts`:
        loading or syncing an HF-named tensor writes the fused one), so one GEMM runs where the layout has three
        or two: a dense layer's 7 GEMMs become 4. At a decode step's few rows each GEMM is a small kernel (7 per
        layer were ~43% of a compiled SDAR-1.7B decode call's GPU time on an H200, batch 32). Bitwise the same
        here (an AMD EPYC CPU, fp32 and bf16); a GPU library may pick another kernel for the wider GEMM.
        Moving the model undoes this, as it does the stacks: :meth:`unfuse_projections` first, fuse again after."""
        for layer in self._layers:
            if layer.q is not None:
                layer.fused_qkv = _rows_as_one([layer.q, layer.k, layer.v])
            if layer.mlp is not None:
                layer.fused_gate_up = _rows_as_one(layer.mlp[:2])[0]
            if layer.shared is not None:
                layer.fused_shared_gate_up = _rows_as_one(layer.shared[:2])[0]

    def unfuse_projections(self) -> None:
        """Drop the fused weights (the parameters keep their values; the forward runs one GEMM per projection)."""
        for layer in self._layers:
            layer.fused_qkv = layer.fused_gate_up = layer.fused_shared_gate_up = None


def _rows_as_one(linears: list) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The Linears' weights (and biases) concatenated along their outputs, each Linear's own now a view of its rows
    of the whole: (weight, bias or None)."""
    whole = []
    for name in ("weight", "bias"):
        params = [getattr(m, name) for m in linears]
        if params[0] is None:
            whole.append(None)
            continue
        fused = torch.cat([p.detach() for p in params])
        start = 0
        for p in params:
            p.data = fused[start : start + p.shape[0]]
            start += p.shape[0]
        whole.append(fused)
    return whole[0], whole[1]


def grouped_swiglu(xs: torch.Tensor, stacked: tuple, ends: torch.Tensor) -> torch.Tensor:
    """SwiGLU of token-sorted rows ``xs`` through each one's expert: rows [ends[e-1], ends[e]) use expert e of
    the stacked [experts, out, in] weights (gate, up, down)."""
    gate, up, down = stacked
    h = F.silu(grouped_mm(xs, gate.transpose(1, 2), offs=ends)) * grouped_mm(xs, up.transpose(1, 2), offs=ends)
    return grouped_mm(h, down.transpose(1, 2), offs=ends)


# the grouped GEMM op (None in a torch without one): the engine's stacked experts here and the training experts
# (models/experts.py) both call it
grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


# grouped_gemm_runs's answers by (device, dtype, traced, the op): the probe is a tiny GEMM and a host read, asked
# for by the engine's build, experts_module and every GroupedExperts layer's first forward
_GROUPED_RUNS: dict[tuple[torch.device, torch.dtype, bool, Any], bool] = {}


def grouped_gemm_runs(like: torch.Tensor, traced: bool = False) -> bool:
    """Whether grouped GEMMs run for tensors like ``like`` (device, dtype): tried once on a tiny problem with the
    shapes a MoE layer gives them (groups of any size, an empty one among them; CUDA kernels exist for some GPUs and
    dtypes only). ``traced``: also under torch.compile, whose fake-tensor kernel of the op accepts fewer dtypes than
    the op itself (bfloat16 only in torch 2.13: float32 runs eagerly on the CPU, and fails to compile). The answer
    is kept per process (one probe per device, dtype and ``traced``), except one found while tracing."""
    key = (like.device, like.dtype, traced, grouped_mm)
    runs = _GROUPED_RUNS.get(key)
    if runs is None:
        runs = _probe_grouped_gemm(like.device, like.dtype, traced)
        if not torch.compiler.is_compiling() and detect_fake_mode() is None:
            _GROUPED_RUNS[key] = runs
    return runs


def _probe_grouped_gemm(device: torch.device, dtype: torch.dtype, traced: bool) -> bool:
    if grouped_mm is None:
        return False
    try:
        if not bool((_grouped_probe(device, dtype).float() == _GROUPED_WANT).all()):
            return False
        if traced:
            quiet = logging.getLogger("torch._subclasses.fake_tensor")  # it logs the refusal as an error
            level = quiet.level
            quiet.setLevel(logging.CRITICAL)
            try:
                with FakeTensorMode():
                    _grouped_probe(device, dtype)
            finally:
                quiet.setLevel(level)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


_GROUPED_WANT = torch.tensor([16.0, 48.0, 48.0])[:, None]  # the probe's rows: 1 x 16, 3 x 16, 3 x 16


def _grouped_probe(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    a = torch.ones(3, 16, dtype=dtype, device=device)
    b = torch.arange(1, 4, dtype=dtype, device=device)[:, None, None].expand(3, 16, 16).contiguous()
    ends = torch.tensor([1, 1, 3], dtype=torch.int32, device=device)  # rows 0 | none | 1, 2
    return grouped_mm(a, b.transpose(1, 2), offs=ends).cpu()


class _Layer:
    """One layer's modules, resolved by name once (plain references: the forward does no lookups)."""

    def __init__(self, model: DecoderLM, i: int, moe: bool):
        n = model.names

        def get(template: str, **kw) -> nn.Module:
            return model.sub(template.format(i=i, **kw))

        self.input_norm, self.post_norm, self.o = get(n.input_norm), get(n.post_norm), get(n.o)
        self.qkv = get(n.qkv) if n.qkv else None
        self.q, self.k, self.v = (None, None, None) if n.qkv else (get(n.q), get(n.k), get(n.v))
        qk = model.arch.qk_norm
        self.q_norm, self.k_norm = (get(n.q_norm), get(n.k_norm)) if qk else (None, None)
        self.moe = moe
        self.mlp = None if moe else (get(n.gate), get(n.up), get(n.down))
        self.router = get(n.router) if moe else None
        self.experts = (
            [
                (get(n.expert_gate, e=e), get(n.expert_up, e=e), get(n.expert_down, e=e))
                for e in range(model.arch.num_experts)
            ]
            if moe
            else []
        )
        shared = moe and model.arch.num_shared_experts
        self.shared = (get(n.shared_gate), get(n.shared_up), get(n.shared_down)) if shared else None
        self.stacked: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # DecoderLM.stack_experts
        # DecoderLM.fuse_projections: (weight, bias) of q/k/v; gate/up weights of the dense MLP / shared experts
        self.fused_qkv: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None
        self.fused_gate_up: Optional[torch.Tensor] = None
        self.fused_shared_gate_up: Optional[torch.Tensor] = None


def decoder_family(
    name: str, architecture: str, arch: Callable[[dict], ModelArch], names: HFNames, tiny_config, **extra: Any
) -> Family:
    """A family whose hf/ model is this ``DecoderLM`` and whose parameter table is ``build_table``, both named by
    ``names`` (every family megadare ships)."""
    return Family(
        name=name,
        architectures=(architecture,),
        arch=arch,
        hf_model=lambda c: DecoderLM(arch(c), names),
        mapping=lambda c: build_table(arch(c), names),
        tiny_config=tiny_config,
        extra=extra,
    )
