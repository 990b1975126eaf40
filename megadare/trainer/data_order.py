"""Which examples form the global batch of step s: a pure function of (seed, s), so a resumed run sees the
same data in the same order without saving a data-loader state, and every rank agrees without communication.

Epoch e is a permutation of the examples seeded by (seed, e); the global batch of step s is the slice
[s * B, (s + 1) * B) of the concatenated epochs.
"""

from __future__ import annotations

from typing import Any

import torch

from megadare.errors import RunStateError

# the settings that fix the order, with the config key that sets each
ORDER_KEYS = {"examples": "the number of examples (data files)", "batch": "", "seed": "seed", "shuffle": "data.shuffle"}


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
            if len(self._orders) > 4:  # the oldest cached epoch goes, never the one just made
                self._orders.pop(next(iter(self._orders)))
        return self._orders[epoch]

    def batch(self, step: int) -> list[int]:
        """Example indices of the global batch of ``step`` (0-based)."""
        out = []
        for k in range(step * self.bs, (step + 1) * self.bs):
            out.append(int(self._order(k // self.n)[k % self.n]))
        return out

    def epoch(self, step: int) -> float:
        return step * self.bs / self.n

    def settings(self) -> dict[str, Any]:
        """What fixes the order (saved in a checkpoint, compared on resume: ``check_same_order``)."""
        return {"examples": self.n, "batch": self.bs, "seed": self.seed, "shuffle": self.shuffle}


def check_same_order(state: dict[str, Any], sampler: StepSampler, batch_key: str, consumed_key: str) -> None:
    """Refuse (RunStateError, one line) to resume a checkpoint's ``state`` with a sampler that orders the data
    otherwise: the batch of step s would no longer follow the batches already trained on, so examples would be
    skipped or repeated without a word. ``batch_key`` names the batch-size setting; a checkpoint from before
    the order was saved is checked by its ``consumed_key`` count."""
    now, step = sampler.settings(), int(state.get("step", 0))
    saved = dict(state.get("data_order") or {})
    if not saved and step and isinstance(state.get(consumed_key), int):
        saved["batch"] = state[consumed_key] // step if state[consumed_key] % step == 0 else state[consumed_key] / step
    names = dict(ORDER_KEYS, batch=batch_key)
    diff = [f"{names[k]} {saved[k]} -> {now[k]}" for k in now if k in saved and saved[k] != now[k]]
    if diff:
        raise RunStateError(
            f"{state.get('resumed_from', 'the checkpoint')} was trained {step} steps in another data order "
            f"({', '.join(diff)}): resuming would skip or repeat examples; set them back, or start a new run from "
            "its weights (checkpoint.load=<that checkpoint> with a new logging.run_dir)"
        )
