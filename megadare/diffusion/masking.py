"""Masking primitives shared by SFT, the RL estimators and the samplers.

All randomness comes from an explicit ``torch.Generator`` (never the global RNG), so old, reference and
current log-probs can be computed on the same stored corruptions.
"""

from __future__ import annotations

import torch


def iid_mask(
    eligible: torch.Tensor, p: torch.Tensor | float, generator: torch.Generator, force_one: bool = False
) -> torch.Tensor:
    """Mask each eligible position independently with probability p (scalar or per position).

    eligible: bool [..., L]; p broadcastable to it. With ``force_one`` a row with eligible positions but no
    masked one gets one uniformly chosen eligible position masked (SDAR's "at least one token" rule).
    """
    u = torch.rand(eligible.shape, generator=generator, dtype=torch.float64)
    p_t = torch.as_tensor(p, dtype=torch.float64)
    masked = (u < p_t) & eligible
    if force_one:
        flat_e = eligible.reshape(-1, eligible.shape[-1])
        flat_m = masked.reshape(-1, eligible.shape[-1])
        for r in range(flat_e.shape[0]):
            if flat_e[r].any() and not flat_m[r].any():
                idx = flat_e[r].nonzero().squeeze(1)
                pick = idx[torch.randint(len(idx), (1,), generator=generator)]
                flat_m[r, pick] = True
        masked = flat_m.reshape(eligible.shape)
    return masked


def complementary(masked: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """The complementary mask of Coupled-GRPO (arXiv:2506.20639): every eligible token is masked exactly once
    across the pair (masked, complementary(masked))."""
    return eligible & ~masked


def mask_tokens(tokens: torch.Tensor, masked: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """x_t: tokens with the masked positions replaced by the mask token."""
    return torch.where(masked, torch.full_like(tokens, mask_token_id), tokens)


def block_index(positions: torch.Tensor, block_size: int, offset: int = 0) -> torch.Tensor:
    """Block of each position on the global prompt+response grid: (position + offset) // block_size."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return (positions + offset) // block_size
