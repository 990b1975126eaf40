"""The dense attention mask (SDPA / reference backends) is built once per micro-batch's mask spec, not once per
layer: every layer gets the same tensor, equal to ``MaskSpec.dense``; another micro-batch's spec of the same shape
gets its own mask, and only a few masks stay cached."""

from __future__ import annotations

import torch

from megadare.models import attention as A
from megadare.models.attention import MaskSpec, allowed_from_megatron


def packed_spec(seed: int, B: int = 2, S: int = 16) -> MaskSpec:
    g = torch.Generator().manual_seed(seed)
    cut = torch.randint(2, S - 2, (B, 1), generator=g)
    seg = (torch.arange(S)[None, :] >= cut).long()
    pos = torch.where(seg == 0, torch.arange(S)[None, :], torch.arange(S)[None, :] - cut)
    return MaskSpec("block_causal", block_size=4, segment_ids=seg, position_ids=pos)


def test_every_layer_gets_the_micro_batchs_one_dense_mask():
    S = 16
    first, second = packed_spec(0), packed_spec(1)
    layers = [allowed_from_megatron(first, S, S, torch.device("cpu")) for _ in range(3)]
    assert all(m is layers[0] for m in layers)
    assert torch.equal(layers[0], first.dense(S, S, 2))
    other = allowed_from_megatron(second, S, S, torch.device("cpu"))  # same shape, other contents
    assert torch.equal(other, second.dense(S, S, 2)) and not torch.equal(other, layers[0])
    plain = MaskSpec("bidirectional")  # no per-position tensors: an equal spec is the same mask
    assert allowed_from_megatron(plain, S, S, "cpu") is allowed_from_megatron(MaskSpec("bidirectional"), S, S, "cpu")
    for seed in range(2, 8):
        allowed_from_megatron(packed_spec(seed), S, S, torch.device("cpu"))
    assert len(A._DENSE_MASKS) <= A._DENSE_MASKS_KEPT
