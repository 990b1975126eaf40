"""dLLM attention masks and the core-attention module used by every model family.

One definition of each mask serves training (Megatron), the hf/ reference models and the rollout engine.
Every mask is a ``MaskSpec``: a pure ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` in FlexAttention's
signature (True = query may attend key), plus ``dense(q_len, kv_len)`` which materialises it for SDPA or a
plain reference. Megatron's own convention is the opposite (True = masked out); ``allowed_from_megatron``
(reading) and ``MicroBatch.megatron_mask`` (data/rows.py, writing) are the places that flip it.

Masks (block index b(i) = pos(i) // block_size, positions counted on the global prompt+response grid):

* bidirectional (LLaDA, Dream): every token attends every token of its own sample.
* block-causal inference (SDAR, TraDo, LLaDA2): i attends j iff b(j) <= b(i) -- the own block is
  bidirectional, earlier blocks are causal (KV-cached at inference).
* block-diffusion training (SDAR / BD3-LM, arXiv:2503.09573, Fig. 2): the input is x_t ++ x_0 (length 2L).
  x_t token i attends x_t tokens of its own block and x_0 tokens of strictly earlier blocks; x_0 token i
  attends x_0 tokens of its own and earlier blocks; x_0 never attends x_t. One forward gives every block's
  denoising loss.

Sequence packing: every mask also takes optional per-position segment ids; tokens attend only within their
segment, and block indices use the position inside the segment.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

from megadare.models.family import MaskKind

MASK_KINDS = tuple(MaskKind)


@dataclass(frozen=True)
class MaskSpec:
    """A dLLM attention mask as a FlexAttention-style ``mask_mod``.

    kind: one of MASK_KINDS.
    block_size: block length for block-causal / block-diffusion masks (ignored for bidirectional).
    seq_len: for block_diffusion, L = the length of x_t (the input is 2L long); unused otherwise.
    q_offset / kv_offset: global grid position of the first query / key (KV-cached inference: the queries
        of the current block sit after the cached prefix).
    segment_ids: optional [B, S] int tensor for packed sequences (S = query length = key length);
        position_ids: optional [B, S] positions inside each packed sample (block index = position // block).
    stream_ids: optional [B, S] for packed block diffusion: 0 = noisy x_t token, 1 = clean x_0 token. With it
        (and position_ids) samples of the form x_t ++ x_0 can be packed in any order; without it the input is
        one x_t ++ x_0 of length 2 * seq_len.
    """

    kind: MaskKind
    block_size: int = 1
    seq_len: int = 0
    q_offset: int = 0
    kv_offset: int = 0
    segment_ids: Optional[torch.Tensor] = None
    position_ids: Optional[torch.Tensor] = None
    stream_ids: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.kind not in MASK_KINDS:
            raise ValueError(f"unknown mask kind {self.kind!r}; expected one of {[str(k) for k in MASK_KINDS]}")
        object.__setattr__(self, "kind", MaskKind(self.kind))
        if self.kind is not MaskKind.BIDIRECTIONAL and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 for a {self.kind} mask, got {self.block_size}")
        if self.kind is MaskKind.BLOCK_DIFFUSION and self.stream_ids is not None and self.position_ids is None:
            raise ValueError("a packed block_diffusion mask (stream_ids) needs position_ids for block indices")
        if self.kind is MaskKind.BLOCK_DIFFUSION and self.seq_len < 1 and self.stream_ids is None:
            raise ValueError("a block_diffusion mask needs seq_len = L, the length of x_t (input is 2L)")

    def to(self, device) -> "MaskSpec":
        """The same mask with its per-position tensors on ``device``."""
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(
            self, segment_ids=mv(self.segment_ids), position_ids=mv(self.position_ids), stream_ids=mv(self.stream_ids)
        )

    # ------------------------------------------------------------------ the mask itself
    def _pos(self, b: torch.Tensor, idx: torch.Tensor, offset: int) -> torch.Tensor:
        if self.position_ids is not None:
            return self.position_ids[b, idx]
        return idx + offset

    def mask_mod(self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """True where query q_idx may attend key kv_idx (FlexAttention signature)."""
        if self.kind is MaskKind.BLOCK_DIFFUSION:
            allowed = self._block_diffusion(b, q_idx, kv_idx)
        else:
            qp = self._pos(b, q_idx, self.q_offset)
            kp = self._pos(b, kv_idx, self.kv_offset)
            if self.kind is MaskKind.BIDIRECTIONAL:
                allowed = torch.ones_like(qp + kp, dtype=torch.bool)
            else:  # block_causal
                allowed = (kp // self.block_size) <= (qp // self.block_size)
        if self.segment_ids is not None:
            allowed = allowed & (self.segment_ids[b, q_idx] == self.segment_ids[b, kv_idx])
        return allowed

    def _block_diffusion(self, b: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        L, bs = self.seq_len, self.block_size
        if self.stream_ids is not None:
            q_is_x0 = self.stream_ids[b, q_idx].bool()
            k_is_x0 = self.stream_ids[b, kv_idx].bool()
            qb = self.position_ids[b, q_idx] // bs
            kb = self.position_ids[b, kv_idx] // bs
        else:
            q_is_x0 = q_idx >= L
            k_is_x0 = kv_idx >= L
            qb = torch.where(q_is_x0, q_idx - L, q_idx) // bs
            kb = torch.where(k_is_x0, kv_idx - L, kv_idx) // bs
        xt_xt = (~q_is_x0) & (~k_is_x0) & (qb == kb)  # own noisy block, bidirectional
        xt_x0 = (~q_is_x0) & k_is_x0 & (kb < qb)  # clean context of earlier blocks
        x0_x0 = q_is_x0 & k_is_x0 & (kb <= qb)  # clean stream, block-causal
        return xt_xt | xt_x0 | x0_x0

    # ------------------------------------------------------------------ materialised forms
    def dense(self, q_len: int, kv_len: int, batch_size: int = 1, device: torch.device | str = "cpu") -> torch.Tensor:
        """[B, 1, q_len, kv_len] bool, True = may attend (SDPA / HF 4D-mask convention)."""
        if self.segment_ids is None and self.position_ids is None and self.stream_ids is None:
            batch_size = 1
        b = torch.arange(batch_size, device=device).view(-1, 1, 1)
        q = torch.arange(q_len, device=device).view(1, -1, 1)
        k = torch.arange(kv_len, device=device).view(1, 1, -1)
        if self.kind is MaskKind.BLOCK_DIFFUSION:
            allowed = self._block_diffusion_dense(b, q, k)
        else:
            allowed = self.mask_mod(b, torch.zeros((), dtype=torch.long, device=device), q, k)
        return allowed.expand(batch_size, q_len, kv_len).unsqueeze(1)

    def _block_diffusion_dense(self, b: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """``mask_mod`` of a block-diffusion mask materialised with 3 full-size ops (5 with segments) instead of 13:
        the three stream rules fold into per-row / per-column codes. A key x_0 of block kb is seen by a query
        of block qb iff kb <= qb (query x_0) or kb <= qb - 1 (query x_t); a key x_t iff it is a query x_t of
        the same block. So: x0_code(key) <= limit(query) | xt_code(key) == xt_code(query), with x_0 keys out of
        the equality (codes no query takes) and x_t keys out of the comparison (the largest code)."""
        L, bs = self.seq_len, self.block_size
        if self.stream_ids is not None:
            q_x0, k_x0 = self.stream_ids[b, q_idx].bool(), self.stream_ids[b, kv_idx].bool()
            qb, kb = self.position_ids[b, q_idx] // bs, self.position_ids[b, kv_idx] // bs
        else:
            q_x0, k_x0 = q_idx >= L, kv_idx >= L
            qb = torch.where(q_x0, q_idx - L, q_idx) // bs
            kb = torch.where(k_x0, kv_idx - L, kv_idx) // bs
        info = torch.iinfo(qb.dtype)
        limit = torch.where(q_x0, qb, qb - 1)  # the last block of x_0 keys a query sees
        k_x0_code = torch.where(k_x0, kb, info.max)
        q_xt_code = torch.where(q_x0, info.min, qb)
        k_xt_code = torch.where(k_x0, info.min + 1, kb)
        allowed = k_x0_code <= limit
        allowed |= k_xt_code == q_xt_code
        if self.segment_ids is None:
            return allowed
        same = self.segment_ids[b, q_idx] == self.segment_ids[b, kv_idx]  # [B, Q, K]: allowed may be [1, Q, K]
        same &= allowed
        return same


def bidirectional(**kw) -> MaskSpec:
    return MaskSpec(MaskKind.BIDIRECTIONAL, **kw)


def block_causal(block_size: int, **kw) -> MaskSpec:
    return MaskSpec(MaskKind.BLOCK_CAUSAL, block_size=block_size, **kw)


def block_diffusion(seq_len: int, block_size: int, **kw) -> MaskSpec:
    return MaskSpec(MaskKind.BLOCK_DIFFUSION, block_size=block_size, seq_len=seq_len, **kw)


# ====================================================================== core attention (Megatron spec module)
ATTENTION_BACKENDS = ("auto", "flex", "sdpa", "reference")


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' -> FlexAttention on CUDA (never materialises the score matrix), SDPA elsewhere."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r} unknown; choose one of {ATTENTION_BACKENDS}")
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if backend == "flex" and device.type != "cuda":
        raise ValueError("attention backend 'flex' needs a CUDA device; use 'sdpa' or 'auto' on CPU")
    return backend


def allowed_from_megatron(attention_mask, q_len: int, kv_len: int, device) -> Optional[torch.Tensor]:
    """Normalise what Megatron passes as ``attention_mask`` to an allowed [B|1, 1, Q, K] bool (or None = all)."""
    if attention_mask is None:
        return None
    if isinstance(attention_mask, MaskSpec):
        return dense_mask(attention_mask, q_len, kv_len, device)
    if attention_mask.dtype != torch.bool:
        raise TypeError("a tensor attention_mask must be bool in Megatron convention (True = masked out)")
    m = ~attention_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    return m


def _mask_batch(spec: MaskSpec) -> int:
    for t in (spec.segment_ids, spec.position_ids, spec.stream_ids):
        if t is not None:
            return t.shape[0]
    return 1


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Optional[torch.Tensor], scale: float
) -> torch.Tensor:
    """q [B, H, Q, D], k/v [B, G, K, D] (G kv groups, H % G == 0); allowed [B|1, 1, Q, K] or None."""
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Optional[torch.Tensor], scale: float
) -> torch.Tensor:
    """Plain softmax(QK^T * scale + mask) V in fp32: the readable reference for the other backends."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


_BLOCK_MASKS: "OrderedDict[tuple, tuple]" = OrderedDict()  # most recent block masks (all layers of a forward)
_BLOCK_MASKS_KEPT = 8
_DENSE_MASKS: "OrderedDict[tuple, tuple]" = OrderedDict()  # the same for dense masks ([B, 1, Q, K] bool: few kept)
_DENSE_MASKS_KEPT = 2


def _graph_mask(spec: MaskSpec, device: torch.device) -> Callable:
    """``spec.mask_mod`` as a plain 4-argument function whose per-batch values are tensors on ``device``.

    A compiled FlexAttention treats what its mask_mod reads as part of the graph: tensors are inputs, but Python
    ints are constants, so a spec whose offsets change every call (KV-cached decoding moves ``q_offset`` by a block
    each step) or whose block-diffusion length L changes would compile a new graph each time and, after dynamo's
    recompile limit (8), fall back to the unfused kernel that materialises the scores. Offsets and L therefore go
    in as 0-dim tensors; what stays constant is the mask's structure (kind, block size, which tensors it carries,
    shapes), so one graph serves every micro-batch of one structure. (A plain function also because
    ``create_block_mask`` counts a bound method's ``self`` as a fifth positional argument and refuses it.)
    """
    as_t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    graph_spec = replace(spec, q_offset=as_t(spec.q_offset), kv_offset=as_t(spec.kv_offset), seq_len=as_t(spec.seq_len))

    def mask_mod(b, h, q_idx, kv_idx):
        return graph_spec.mask_mod(b, h, q_idx, kv_idx)

    return mask_mod


def flex_block_mask(spec: MaskSpec, q_len: int, kv_len: int, device: torch.device):
    """The block-sparse mask of ``spec`` (built once per spec and shape: every layer of a forward reuses it).

    A spec without per-position tensors is keyed by value (an equal spec of the next micro-batch hits); one with
    segment / position / stream ids by identity (its contents are the micro-batch's own), holding the spec so its
    id cannot be reused while cached."""
    packed = _packed(spec)
    return _cached(
        _BLOCK_MASKS,
        _BLOCK_MASKS_KEPT,
        (spec, q_len, kv_len, device),
        lambda: create_block_mask(
            _graph_mask(spec, device), _mask_batch(spec) if packed else None, None, q_len, kv_len, device=device
        ),
    )


def dense_mask(spec: MaskSpec, q_len: int, kv_len: int, device) -> torch.Tensor:
    """``spec.dense`` for SDPA / the reference, built once per spec and shape like :func:`flex_block_mask` (every
    layer of a forward attends with its micro-batch's mask; SDPA's backward keeps it: one copy, not one a layer)."""
    return _cached(
        _DENSE_MASKS,
        _DENSE_MASKS_KEPT,
        (spec, q_len, kv_len, device),
        lambda: spec.dense(q_len, kv_len, _mask_batch(spec), device=device),
    )


def _packed(spec: MaskSpec) -> bool:
    return any(t is not None for t in (spec.segment_ids, spec.position_ids, spec.stream_ids))


def _cached(cache: "OrderedDict[tuple, tuple]", kept: int, spec_shape: tuple, build: Callable[[], Any]) -> Any:
    """``build()`` of (spec, q_len, kv_len, device), from ``cache`` (the ``kept`` most recent): a spec with per-position
    tensors keyed by identity (held with its entry, so its id cannot be reused), else by value."""
    spec, q_len, kv_len, device = spec_shape
    key = (id(spec) if _packed(spec) else spec, q_len, kv_len, str(device))
    hit = cache.get(key)
    if hit is not None:
        cache.move_to_end(key)
        return hit[1]
    value = build()
    cache[key] = (spec, value)
    while len(cache) > kept:
        cache.popitem(last=False)
    return value


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec, scale: float) -> torch.Tensor:
    """FlexAttention with a block-sparse mask built from the spec's mask_mod (CUDA)."""
    block_mask = flex_block_mask(spec, q.shape[-2], k.shape[-2], q.device)
    return _flex_kernel(q.device)(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


_COMPILED = None


def _flex_kernel(device: torch.device) -> Callable:
    """The compiled FlexAttention on CUDA (the eager one materialises the scores), the eager one elsewhere."""
    global _COMPILED
    if device.type != "cuda":
        return torch_flex_attention
    if _COMPILED is None:
        _COMPILED = torch.compile(torch_flex_attention, dynamic=False)
    return _COMPILED


_UNUSED_INIT_KEYWORDS = ("attn_mask_type", "attention_type", "cp_comm_type")
_FORWARD_KEYWORDS = ("attn_mask_type", "attention_bias", "packed_seq_params")


def _check_megatron_keywords(method: str, given: dict, known: tuple[str, ...]) -> None:
    """The keywords megatron's core-attention protocol passes are the only ones taken through ``**``."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise TypeError(f"DLLMCoreAttention.{method}() got unexpected keyword arguments {unknown}")


class DLLMCoreAttention(torch.nn.Module):
    """Megatron core-attention module for dLLM masks (drop-in for ``DotProductAttention`` in a layer spec).

    Takes Megatron's [S, B, heads, D] q/k/v and returns [S, B, heads_per_partition * D]. ``attention_mask``
    is a ``MaskSpec`` (preferred: FlexAttention builds a block-sparse mask from it and SDPA materialises it)
    or a bool tensor in Megatron convention (True = masked out). Never materialises the score matrix on the
    flex path; SDPA uses its fused kernels where the mask allows.

    Context parallelism (``config.context_parallel_size`` = cp > 1) is Ulysses-style: every CP rank holds the
    contiguous sequence chunk [r*S/cp, (r+1)*S/cp) of q/k/v ([S/cp, B, h, D]); an all-to-all over the CP group
    turns that into the whole sequence for h/cp heads ([S, B, h/cp, D]), the backend runs unchanged with the
    FULL-sequence mask (the ``MaskSpec``'s segment/position/stream ids are [B, S] over the whole sequence), and
    a second all-to-all returns [S/cp, B, h * D]. Any dLLM mask is therefore exact. Query heads per TP partition
    must be divisible by cp; GQA kv heads are repeated up to lcm(kv heads, cp) when needed. Both exchanges are
    differentiable. On backends without ``all_to_all_single`` (some CPU gloo builds) the exchange falls back to
    an ``all_gather`` -- correct, cp times the traffic.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        softmax_scale: Optional[float] = None,
        pg_collection=None,
        backend: str = "auto",
        **unused,  # megatron's CoreAttentionBuilder also passes attn_mask_type, attention_type, cp_comm_type
    ):
        super().__init__()
        from megatron.core import parallel_state  # heavy: megadare.models imports without megatron

        _check_megatron_keywords("__init__", unused, _UNUSED_INIT_KEYWORDS)

        self.config = config
        self.backend = backend
        tp = parallel_state.get_tensor_model_parallel_world_size() if pg_collection is None else pg_collection.tp.size()
        self.heads_per_partition = config.num_attention_heads // tp
        self.cp_size = config.context_parallel_size
        self.cp_group = None
        if self.cp_size > 1:
            self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
            if self.cp_group is None:
                self.cp_group = parallel_state.get_context_parallel_group()
            if self.heads_per_partition % self.cp_size:
                raise ValueError(
                    f"parallel.cp={self.cp_size}: Ulysses context parallelism scatters attention heads over the CP "
                    f"ranks, but each tensor-parallel partition holds {self.heads_per_partition} query heads "
                    f"({config.num_attention_heads} heads / tp={tp}), not divisible by cp={self.cp_size}; "
                    f"choose parallel.cp (times parallel.tp) dividing {config.num_attention_heads}"
                )
        self.head_dim = config.kv_channels
        self.scale = (
            softmax_scale
            if softmax_scale is not None
            else (config.softmax_scale if getattr(config, "softmax_scale", None) else self.head_dim**-0.5)
        )
        self.dropout_p = config.attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask,
        **megatron_keywords,  # megatron's CoreAttention.forward: attn_mask_type, attention_bias, packed_seq_params
    ) -> torch.Tensor:
        _check_megatron_keywords("forward", megatron_keywords, _FORWARD_KEYWORDS)
        if (
            megatron_keywords.get("attention_bias") is not None
            or megatron_keywords.get("packed_seq_params") is not None
        ):
            raise ValueError("DLLMCoreAttention: pass packing through MaskSpec(segment_ids=...), not packed_seq_params")
        if self.training and self.dropout_p > 0:
            raise ValueError("attention dropout is not supported by DLLMCoreAttention (dLLM recipes use 0)")
        if self.cp_size > 1:
            return self._forward_cp(query, key, value, attention_mask)
        return self._attend(query, key, value, attention_mask)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask) -> torch.Tensor:
        """The local computation: [S, B, h, D] q/k/v over the whole sequence -> [S, B, h * D]."""
        sq, b = query.shape[0], query.shape[1]
        q = query.permute(1, 2, 0, 3)  # [B, H, S, D]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        backend = resolve_backend(self.backend, q.device)
        if backend == "flex" and (attention_mask is None or isinstance(attention_mask, MaskSpec)):
            spec = attention_mask if attention_mask is not None else bidirectional()
            out = flex_attention(q, k, v, spec, self.scale)
        else:
            allowed = allowed_from_megatron(attention_mask, q.shape[-2], k.shape[-2], q.device)
            fn = reference_attention if backend == "reference" else sdpa_attention
            out = fn(q, k, v, allowed, self.scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, q.shape[1] * self.head_dim)

    def _forward_cp(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask) -> torch.Tensor:
        """Ulysses context parallelism: [S/cp, B, h, D] chunks -> all-to-all -> [S, B, h/cp, D] -> attention
        with the full-sequence mask -> all-to-all back -> [S/cp, B, h * D]."""
        cp, group = self.cp_size, self.cp_group
        s, b = query.shape[0], query.shape[1]
        if query.shape[2] % cp:
            raise ValueError(f"parallel.cp={cp}: {query.shape[2]} query heads per partition are not divisible by cp")
        key, value = _kv_heads_for_cp(key, query.shape[2], cp), _kv_heads_for_cp(value, query.shape[2], cp)
        q = seq_to_head_parallel(query, group)
        k = seq_to_head_parallel(key, group)
        v = seq_to_head_parallel(value, group)
        out = self._attend(q, k, v, attention_mask)  # [S, B, h/cp * D]
        out = out.view(s * cp, b, q.shape[2], self.head_dim)
        return head_to_seq_parallel(out, group).reshape(s, b, query.shape[2] * self.head_dim)


# ====================================================================== Ulysses context parallelism
def _kv_heads_for_cp(x: torch.Tensor, q_heads: int, cp: int) -> torch.Tensor:
    """Repeat GQA kv heads ([S, B, G, D]) to lcm(G, cp) groups so they scatter evenly over the CP ranks.

    Query head i uses group i // (H / G); with every group repeated r times it uses group i // (H / (G r)),
    the r-th copy of the same group, so the result is unchanged. lcm(G, cp) divides H (G and cp both do)."""
    g = x.shape[2]
    if g % cp == 0:
        return x
    target = g * cp // math.gcd(g, cp)
    if q_heads % target:
        raise ValueError(f"parallel.cp={cp}: cannot spread {g} kv heads over cp ranks for {q_heads} query heads")
    return x.repeat_interleave(target // g, dim=2)


_A2A_SUPPORTED: dict = {}


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Equal-split all-to-all along dim 0 ([cp, ...]: block j goes to rank j; block i of the result came from
    rank i). Uses ``all_to_all_single``; where the backend lacks it (older gloo builds) falls back to an
    ``all_gather`` of every rank's whole buffer, from which each rank picks its blocks (cp times the traffic:
    a CPU-only fallback, correct but not meant for speed)."""
    x = x.contiguous()
    key = dist.get_backend(group)
    if _A2A_SUPPORTED.get(key, True):
        out = torch.empty_like(x)
        try:
            dist.all_to_all_single(out, x, group=group)
            _A2A_SUPPORTED[key] = True
            return out
        except (RuntimeError, NotImplementedError):
            if key == "nccl" or _A2A_SUPPORTED.get(key) is True:
                raise
            _A2A_SUPPORTED[key] = False
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    bufs = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(bufs, x, group=group)
    return torch.stack([bufs[i][me] for i in range(cp)])


class _AllToAll(torch.autograd.Function):
    """Differentiable equal-split all-to-all over dim 0; it is its own adjoint (a block transpose across
    ranks), so the backward is the same exchange of the incoming gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


def seq_to_head_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """[S/cp, B, h, D] (this rank's contiguous sequence chunk, all heads) -> [S, B, h/cp, D] (the whole sequence
    in rank order, this rank's contiguous slice of heads)."""
    cp = dist.get_world_size(group)
    s, b, h, d = x.shape
    send = x.reshape(s, b, cp, h // cp, d).permute(2, 0, 1, 3, 4)  # [cp, s, B, h/cp, D]
    return _AllToAll.apply(send, group).reshape(cp * s, b, h // cp, d)


def head_to_seq_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of ``seq_to_head_parallel``: [S, B, h/cp, D] -> [S/cp, B, h, D]."""
    cp = dist.get_world_size(group)
    S, b, hc, d = x.shape
    recv = _AllToAll.apply(x.reshape(cp, S // cp, b, hc, d), group)  # [cp (head slice), s, B, h/cp, D]
    return recv.permute(1, 2, 0, 3, 4).reshape(S // cp, b, cp * hc, d)


def family_mask(arch) -> MaskSpec:
    """The family's inference mask (block-causal with its block size, or bidirectional)."""
    return block_causal(arch.block_size) if arch.is_block_diffusion else bidirectional()
