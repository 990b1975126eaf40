"""A toy block-diffusion LM for the rollout-step and SGLang tests: integer-valued logits (exact in float32 for
any batch or padding, so two engines see bit-identical logits), its arch, and the per-block logits the way
sglang's model runner hands them to a dLLM algorithm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megadare.models.family import ModelArch


V, MASK, EOS, B = 12, 11, 10, 4
PROMPTS = [[5, 1, 9, 3, 4, 7], [2, 8], [8, 8, 8, 8, 1, 6, 6, 0, 3], [4, 5, 6, 7]]


# ---------------------------------------------------------------------------------------------- a toy dLLM
class ToyBlockLM(torch.nn.Module):
    """Logits = token term + visible-context counts + position term, integer-valued then scaled by 1/8, so every
    forward is exact in float32 whatever the batch or padding: the two engines see bit-identical logits."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("W", torch.randint(-6, 7, (V, V), generator=g).float())
        self.register_buffer("U", torch.randint(-2, 3, (V, V), generator=g).float())
        self.register_buffer("P", torch.randint(-4, 5, (64, V), generator=g).float())

    def forward(self, ids, attention_mask=None, position_ids=None, logits_index=None, **_):
        """The engine's model protocol without a KV cache; ``logits_index`` [n, m]: those positions' logits."""
        n, L = ids.shape
        onehot = F.one_hot(ids, V).float()
        vis = attention_mask[:, 0].float() if attention_mask is not None else torch.ones(n, L, L)
        pos = position_ids if position_ids is not None else torch.arange(L).expand(n, L)
        out = (onehot @ self.W + (vis @ onehot) @ self.U + self.P[pos]) * 0.125
        return out if logits_index is None else out.gather(1, logits_index[..., None].expand(-1, -1, V))


def toy_arch() -> ModelArch:
    return ModelArch(
        family="sdar",
        architecture="SDARForCausalLM",
        vocab_size=V,
        hidden_size=8,
        num_layers=1,
        num_attention_heads=1,
        num_kv_heads=1,
        head_dim=8,
        ffn_hidden_size=8,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=64,
        mask_token_id=MASK,
        attention="block_causal",
        block_size=B,
    )


def block_logits(model: ToyBlockLM, grid: list[int], block: torch.Tensor) -> torch.Tensor:
    """What sglang's model runner gives the algorithm: logits of the current block [n=1, B, V] given the
    committed grid before it (prompt blocks and earlier blocks, block-causal)."""
    ids = torch.cat([torch.tensor(grid, dtype=torch.long), block[0]])[None]
    bl = torch.arange(ids.shape[1]) // B
    return model(ids, attention_mask=(bl[None, :] <= bl[:, None])[None, None])[:, -B:]
