"""Estimators of the second kind: replay the decoding trajectory recorded by the engine.

The engine records for every response token the step at which it was committed (``commit_step``, global) and
the step inside its block (``block_step``). The trajectory's log-likelihood decomposes over steps,

    log pi(y | c) ~= sum_steps sum_{k committed at step s} log p_theta(y_k | x_s),

where x_s is the partially decoded state before step s (tokens committed earlier clean, the rest masked).
TraceRL (arXiv:2509.06949, dLLM-RL ``train/rl_trado.py::collect_training_data``) merges every ``shrink``
consecutive distinct steps into one fragment (trajectory shrinkage s); CJ-GRPO (arXiv:2509.23924) replays
every step.

* Block families (SDAR, TraDo, LLaDA2): steps are grouped per block (block-local step ids); round j takes the
  j-th group of every block at once. In the x_t ++ x_0 layout with the block-diffusion mask, each noisy block
  sees only the clean earlier blocks and itself -- exactly the state the sampler was in when it decoded that
  block -- so one row per round replays all blocks ("block-attention sliced training": #rows = max groups per
  block, not #steps).
* Full-attention families (LLaDA, Dream): one row per group of global steps, state = every token committed at a
  later step masked.

Canvas: with ``rl.canvas=eos`` the engine cuts the response after the first EOS; positions of the last block after
it (which the sampler also denoised) are not replayed, so the last block's states hold fewer masked positions.
With ``rl.canvas=full`` (LLaDA/Dream's default) every decoded position is replayed and each state is the
sampler's.
"""
from __future__ import annotations

import torch

from megadare.algos.base import RLSample, View
from megadare.diffusion.masking import mask_tokens


def _groups(ids: list[int], shrink: int) -> list[list[int]]:
    distinct = sorted(set(ids))
    return [distinct[i:i + shrink] for i in range(0, len(distinct), shrink)]


def _require_trace(s: RLSample, name: str) -> None:
    if s.commit_step is None or s.block_step is None:
        raise ValueError(f"sample {s.index}: the {name} estimator replays the decoding trace, but the rollout "
                         "recorded none (commit_step / block_step missing)")
    if len(s.commit_step) != len(s.response_ids) or len(s.block_step) != len(s.response_ids):
        raise ValueError(f"sample {s.index}: the trace has {len(s.commit_step)} steps for "
                         f"{len(s.response_ids)} response tokens")


def replay_views(s: RLSample, mask_id: int, block_size: int, shrink: int = 1,
                 block_family: bool = True) -> list[tuple[View, list[int]]]:
    """(view, steps it scores) for every replay round; token slots (each token is scored exactly once)."""
    _require_trace(s, "trace-replay")
    P, L = len(s.prompt_ids), len(s.response_ids)
    x0 = torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)
    slot_all = torch.cat([torch.full((P,), -1, dtype=torch.long), torch.arange(L)])
    out: list[tuple[View, list[int]]] = []
    if block_family:
        blocks = [(P + k) // block_size for k in range(L)]
        per_block: dict[int, list[list[int]]] = {}
        for b in sorted(set(blocks)):
            per_block[b] = _groups([s.block_step[k] for k in range(L) if blocks[k] == b], shrink)
        rounds = max(len(g) for g in per_block.values()) if per_block else 0
        for j in range(rounds):
            masked = torch.zeros(P + L, dtype=torch.bool)
            scored = torch.zeros(P + L, dtype=torch.bool)
            for k in range(L):
                gs = per_block[blocks[k]]
                if j < len(gs):
                    masked[P + k] = s.block_step[k] >= gs[j][0]
                    scored[P + k] = s.block_step[k] in gs[j]
            steps = sorted({s.commit_step[k] for k in range(L) if scored[P + k]})
            out.append((View(tokens=mask_tokens(x0, masked, mask_id), coef=scored.float(),
                             slot=torch.where(scored, slot_all, torch.full_like(slot_all, -1))), steps))
    else:
        for group in _groups(s.commit_step, shrink):
            step = torch.tensor([-1] * P + list(s.commit_step))
            masked = step >= group[0]
            scored = torch.isin(step, torch.tensor(group))
            out.append((View(tokens=mask_tokens(x0, masked, mask_id), coef=scored.float(),
                             slot=torch.where(scored, slot_all, torch.full_like(slot_all, -1))), list(group)))
    return out
