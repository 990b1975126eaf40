"""Which examples form the global batch of step s: a pure function of (seed, s), so a resumed run sees the
same data in the same order without saving a data-loader state, and every rank agrees without communication.

Epoch e is a permutation of the examples seeded by (seed, e); the global batch of step s is the slice
[s * B, (s + 1) * B) of the concatenated epochs.
"""

from __future__ import annotations

import torch


class StepSampler:
    def __init__(self, num_examples: int, global_batch_size: int, seed: int, shuffle: bool = True):
        if num_examples < 1:
            raise ValueError("the dataset is empty: no examples to train on")
        self.n, self.bs, self.seed, self.shuffle = num_examples, global_batch_size, seed, shuffle
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
                self._orders[epoch] = torch.randperm(self.n, generator=g)
            else:
                self._orders[epoch] = torch.arange(self.n)
            if len(self._orders) > 4:
                self._orders.pop(min(self._orders))
        return self._orders[epoch]

    def batch(self, step: int) -> list[int]:
        """Example indices of the global batch of ``step`` (0-based)."""
        out = []
        for k in range(step * self.bs, (step + 1) * self.bs):
            out.append(int(self._order(k // self.n)[k % self.n]))
        return out

    def epoch(self, step: int) -> float:
        return step * self.bs / self.n
