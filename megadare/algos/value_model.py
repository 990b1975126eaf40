"""TraceRL's diffusion value model (arXiv:2509.06949 section 4; dLLM-RL ``train/init_trado_value_model.py``,
``train_trado_value.py``, ``train_trado_policy.py``): the policy's backbone with a zero-initialised scalar head,
trained alongside the policy with its own optimizer and learning rate, giving token-wise values V_j on the same
trace fragments the policy trains on.

Step-level aggregation over the trace (steps t = 1..T in decoding order; the outcome reward sits on the tokens
of the last step, r*_t = mean reward of step t's tokens, V*_t = mean value of step t's tokens):

    R*_t = r*_t + gamma R*_{t+1}                      delta*_t = r*_t - V*_t + gamma V*_{t+1}
    A*_t = delta*_t + gamma lambda A*_{t+1}           (R*, V*, A* = 0 beyond T)
    token j of step t:   A_j = (r_j - V_j) + gamma V*_{t+1} + gamma lambda A*_{t+1},   R_j = r_j + gamma R*_{t+1}

(gamma = lambda = 1 gives A_j = R - V_j.) Value loss, clipped like PPO's (clip 0.2), aggregated like the policy
loss (the rows' head weights: each fragment's sum / the step's longest response on block families, as
``train/train_trado_value.py:1004-1005``; each fragment's mean on LLaDA, as ``train_lladav_value.py:787-788``):

    L_V = 1/2 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2).
"""

from __future__ import annotations

from typing import Optional

import torch

from megadare.data.rows import MicroBatch


class ValueHead(torch.nn.Module):
    """Drop-in for the GPT model's ``output_layer``: hidden [s, b, h] -> values [s, b, 1] (zero-initialised).
    Under sequence parallelism the hidden states are gathered over TP first (as the vocab projection does); the
    head is replicated, so every TP rank's input gradient is already complete and the gather's backward only
    splits it (the vocab projection's are partial sums and get reduce-scattered)."""

    def __init__(self, hidden_size: int, sequence_parallel: bool = False):
        super().__init__()
        # named weight / bias like the layer it replaces (megatron's checkpoint code looks up output_layer.weight)
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(1))
        self.sequence_parallel = sequence_parallel

    def forward(
        self, hidden: torch.Tensor, weight: Optional[torch.Tensor] = None, runtime_gather_output: Optional[bool] = None
    ):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import (
                gather_from_sequence_parallel_region,
            )  # heavy: algos imports without megatron

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight.to(hidden.dtype), self.bias.to(hidden.dtype)), None


def attach_value_head(chunks: list[torch.nn.Module]) -> None:
    """Replace the vocab projection of the last pipeline stage by a value head (the backbone stays). The word
    embedding is no longer tied to any output layer, on every stage: under PP a tied family's first stage would
    otherwise wait for the last stage in megatron's embedding-gradient all-reduce."""
    for c in chunks:
        m = getattr(c, "module", c)
        if getattr(m, "post_process", False):
            cfg = m.config
            device = next(m.parameters()).device  # the backbone's GPU, where there is one
            m.output_layer = ValueHead(cfg.hidden_size, cfg.sequence_parallel).to(device)
        m.share_embeddings_and_output_weights = False


def values_of(output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Per-position values from the value model's output [b, s, 1] (``per_position`` for trainer.step)."""
    return output[..., 0].float()


def step_advantages(
    values: list[float], steps: list[int], reward: float, gamma: float = 1.0, lam: float = 1.0
) -> tuple[list[float], list[float]]:
    """(A_j, R_j) per response token from token values, the tokens' decoding steps and the outcome reward."""
    order = sorted(set(steps))
    T = len(order)
    idx = {s: i for i, s in enumerate(order)}
    v_step = [0.0] * T
    n_step = [0] * T
    for v, s in zip(values, steps):
        v_step[idx[s]] += v
        n_step[idx[s]] += 1
    v_step = [v / n for v, n in zip(v_step, n_step)]
    r_step = [0.0] * (T - 1) + [reward] if T else []
    R = [0.0] * (T + 1)
    A = [0.0] * (T + 1)
    V = v_step + [0.0]
    for t in range(T - 1, -1, -1):
        R[t] = r_step[t] + gamma * R[t + 1]
        A[t] = r_step[t] - V[t] + gamma * V[t + 1] + gamma * lam * A[t + 1]
    adv, ret = [], []
    for v, s in zip(values, steps):
        t = idx[s]
        r = r_step[t]
        adv.append((r - v) + gamma * V[t + 1] + gamma * lam * A[t + 1])
        ret.append(r + gamma * R[t + 1])
    return adv, ret


def value_loss(v: torch.Tensor, v_old: torch.Tensor, ret: torch.Tensor, clip: float = 0.2) -> torch.Tensor:
    """1/2 max((V - R)^2, (clip(V, V_old +- c) - R)^2), elementwise."""
    clipped = v_old + (v - v_old).clamp(-clip, clip)
    return 0.5 * torch.maximum((v - ret) ** 2, (clipped - ret) ** 2)


class ValueObjective:
    """trainer.step objective for the value model: sum over scored positions of head * value loss."""

    def __init__(self, clip: float = 0.2):
        self.clip = clip

    def __call__(self, mb: MicroBatch, v: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x = mb.extras
        sel = mb.head != 0
        w = mb.head[sel].float()
        lv = value_loss(v[sel], x["v_old"][sel].float(), x["ret"][sel].float(), self.clip)
        total = (w * lv).sum() + (v * 0).sum()
        return total, {"value_loss": total.detach(), "value_mean": (w * v[sel].detach()).sum()}
