"""dLLM masks against their definitions written as loops, and the core-attention backends against each other."""

from __future__ import annotations

import pytest
import torch

from megadare.models.attention import (
    bidirectional,
    block_causal,
    block_diffusion,
    reference_attention,
    resolve_backend,
    sdpa_attention,
)


def test_block_diffusion_mask_definition():
    L, bs = 8, 3  # ragged last block on purpose
    m = block_diffusion(L, bs).dense(2 * L, 2 * L)[0, 0]
    for i in range(2 * L):
        for j in range(2 * L):
            bi, bj = (i % L) // bs, (j % L) // bs
            if i < L and j < L:
                want = bi == bj
            elif i < L:
                want = bj < bi
            elif j < L:
                want = False
            else:
                want = bj <= bi
            assert bool(m[i, j]) == want, (i, j)


def _mask_mod_dense(spec, S: int, batch: int) -> torch.Tensor:
    """``spec.mask_mod`` evaluated on the full grid: the construction ``dense`` used before its fast path."""
    b, q, k = torch.arange(batch).view(-1, 1, 1), torch.arange(S).view(1, -1, 1), torch.arange(S).view(1, 1, -1)
    return spec.mask_mod(b, torch.zeros((), dtype=torch.long), q, k).expand(batch, S, S).unsqueeze(1)


def _random_packing(g: torch.Generator, batch: int, S: int, bs: int) -> dict:
    """Per-position ids of ``batch`` rows, each a random packing of x_t ++ x_0 samples (random lengths, streams
    in either order, padding segments) into ``S`` positions."""
    seg, pos, stream = (torch.zeros(batch, S, dtype=torch.long) for _ in range(3))
    for r in range(batch):
        at, s = 0, 0
        while at < S:
            n = int(torch.randint(1, 3 * bs + 2, (1,), generator=g))
            first = int(torch.randint(0, 2, (1,), generator=g))
            for st in (first, 1 - first):
                end = min(S, at + n)
                seg[r, at:end], pos[r, at:end], stream[r, at:end] = s, torch.arange(end - at), st
                at = end
            s += 1
    return {"segment_ids": seg, "position_ids": pos, "stream_ids": stream}


def test_dense_block_diffusion_equals_its_mask_mod_over_random_packings():
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        bs = int(torch.randint(1, 6, (1,), generator=g))
        batch, S = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(2, 40, (1,), generator=g))
        ids = _random_packing(g, batch, S, bs)
        L = S // 2
        cases = [
            (block_diffusion(0, bs, **ids), batch, S),  # packed x_t ++ x_0 samples
            (block_diffusion(L, bs), 1, 2 * L),  # one x_t ++ x_0
            (block_diffusion(L, bs, segment_ids=ids["segment_ids"][:, : 2 * L]), batch, 2 * L),
        ]
        for spec, n, length in cases:
            got, want = spec.dense(length, length, n), _mask_mod_dense(spec, length, n)
            assert got.shape == want.shape and got.dtype == want.dtype == torch.bool, (trial, got.shape)
            assert torch.equal(got, want), (trial, spec.kind, bs, length)


def test_block_causal_with_offset_and_packing():
    m = block_causal(2, q_offset=4).dense(2, 6)[0, 0]  # queries are global positions 4, 5
    assert m.tolist() == [[True] * 6, [True] * 6]
    seg = torch.tensor([[0, 0, 0, 1, 1, 1]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    p = block_causal(2, segment_ids=seg, position_ids=pos).dense(6, 6)[0, 0]
    assert not p[3, 0] and not p[0, 3]  # no attention across packed samples
    assert p[4, 3] and p[3, 4] and not p[3, 5] and p[5, 3]  # blocks restart inside each sample
    assert bidirectional(segment_ids=seg).dense(6, 6)[0, 0].sum() == 18


@pytest.mark.parametrize("spec", [block_causal(4), bidirectional(), block_diffusion(8, 4)])
def test_sdpa_matches_reference(spec):
    torch.manual_seed(0)
    S = 16
    q, k, v = torch.randn(2, 4, S, 8), torch.randn(2, 2, S, 8), torch.randn(2, 2, S, 8)
    allowed = spec.dense(S, S)
    a = sdpa_attention(q, k, v, allowed, 8**-0.5)
    b = reference_attention(q, k, v, allowed, 8**-0.5)
    assert (a - b).abs().max() < 1e-5


def test_backend_choice():
    assert resolve_backend("auto", torch.device("cpu")) == "sdpa"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend("flex", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown"):
        resolve_backend("xformers", torch.device("cpu"))


def test_flex_compiles_once_per_mask_structure_across_micro_batches(monkeypatch):
    """FlexAttention under torch.compile (issue 23, item 6): a fresh MaskSpec per micro-batch -- new packing ids,
    KV-cache offsets that move every block, a new block-diffusion length -- must reuse one compiled graph per mask
    structure; a Python int in the mask_mod would recompile per value and, past dynamo's limit of 8, fall back to
    the kernel that materialises the scores. Counted with a counting backend on the CPU (the product compiles only
    on CUDA); every output is checked against SDPA on the dense mask."""
    import megadare.models.attention as A
    from megadare.models.attention import MaskSpec
    from torch.nn.attention.flex_attention import flex_attention as eager_flex

    graphs = []
    torch._dynamo.reset()
    kernel = torch.compile(eager_flex, backend=lambda gm, _: graphs.append(gm) or gm.forward, dynamic=False)
    monkeypatch.setattr(A, "_flex_kernel", lambda device: kernel)
    B, H, S, D = 2, 2, 64, 16
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for i in range(10):  # more micro-batches than dynamo's recompile limit
        seg = torch.cumsum(torch.rand(B, S, generator=g) < 0.1, dim=1)
        pos = torch.arange(S).repeat(B, 1)
        specs = [
            MaskSpec("block_causal", block_size=4, segment_ids=seg, position_ids=pos),  # packed training
            MaskSpec("block_causal", block_size=4, q_offset=4 * i),  # KV-cached decoding
            MaskSpec("block_diffusion", block_size=4, seq_len=S // 2 + i),
        ]  # x_t ++ x_0, L varies
        for spec in specs:
            q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
            out = A.flex_attention(q, k, v, spec, D**-0.5)
            assert A.flex_block_mask(spec, S, S, q.device) is A.flex_block_mask(spec, S, S, q.device)  # per layer
            ref = sdpa_attention(q, k, v, spec.dense(S, S, B), D**-0.5)
            worst = max(worst, float((out - ref).abs().max()))
    assert worst < 1e-5
    assert len(graphs) == 3, f"{len(graphs)} compiled graphs for 3 mask structures over 30 micro-batches"
    assert len(A._BLOCK_MASKS) <= A._BLOCK_MASKS_KEPT
    spec = MaskSpec("bidirectional")  # no per-position tensors: an equal spec hits the cache
    assert A.flex_block_mask(spec, S, S, torch.device("cpu")) is A.flex_block_mask(
        MaskSpec("bidirectional"), S, S, torch.device("cpu")
    )
