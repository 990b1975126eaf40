"""Noise schedules for masked diffusion: how the masking probability t is drawn, and the ELBO weight.

The linear schedule alpha_t = 1 - t (LLaDA, MDLM, SDAR) masks each token with probability t; its continuous-time
ELBO weights a masked token's cross-entropy by w(t) = -alpha'_t / (1 - alpha_t) = 1/t. LLaDA draws
t ~ U(0, 1) and uses p_mask = (1 - eps) t + eps, i.e. t ~ U(eps, 1) with eps = 1e-3; LLaDA2's SFT draws
t ~ U(0.3, 0.8) with no weighting (``weighting='none'``); dLLM-RL draws U(0.1, 0.9).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHTINGS = ("inv_t", "none")


@dataclass(frozen=True)
class NoiseSchedule:
    """t ~ U(low, high); masked tokens weighted by 1/t (``inv_t``, the ELBO) or 1 (``none``)."""

    low: float = 1e-3
    high: float = 1.0
    weighting: str = "inv_t"

    def __post_init__(self) -> None:
        if not 0.0 < self.low <= self.high <= 1.0:
            raise ValueError(f"noise range must satisfy 0 < low <= high <= 1, got ({self.low}, {self.high})")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting {self.weighting!r} unknown; choose one of {WEIGHTINGS}")

    def sample(self, shape: tuple[int, ...] | int, generator: torch.Generator) -> torch.Tensor:
        """Masking probabilities t of the given shape (float64 -> float32), from ``generator`` only."""
        shape = (shape,) if isinstance(shape, int) else shape
        u = torch.rand(shape, generator=generator, dtype=torch.float64)
        return (self.low + (self.high - self.low) * u).float()

    def weight(self, t: torch.Tensor) -> torch.Tensor:
        return elbo_weight(t, self.weighting)


def elbo_weight(t: torch.Tensor, weighting: str = "inv_t") -> torch.Tensor:
    """Per-token weight of a masked token's cross-entropy: 1/t for the linear-schedule ELBO, or 1."""
    if weighting == "inv_t":
        return 1.0 / t
    if weighting == "none":
        return torch.ones_like(t)
    raise ValueError(f"weighting {weighting!r} unknown; choose one of {WEIGHTINGS}")
