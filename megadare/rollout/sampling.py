"""Token sampling and commit selection for dLLM decoding (shared by the built-in engine and the SGLang plugin).

One denoising step turns the model's logits at the still-masked positions into proposals and decides which of
them to commit:

* ``sample_tokens``: x0 ~ softmax(filter(logits / T)) with top-k / top-p filters (argmax when T = 0). Returns the
  proposal, its log-probability under that sampling distribution (0 for greedy: a point mass) and its confidence
  p_theta(x0) under the unfiltered model distribution (SDAR's ``generate.py`` and LLaDA's low-confidence
  remasking rank by the model probability of the proposal).
* ``transfer_schedule``: how many tokens a static schedule commits per step -- n // S each, the remainder to the
  earliest steps (LLaDA ``get_num_transfer_tokens``; SDAR over the block length).
* ``select_commits``: ``low_confidence_static`` commits the top-n confident masked positions; ``random`` commits
  n random masked positions (LLaDA's random remasking); ``low_confidence_dynamic`` (SDAR / TraDo, Fast-dLLM
  threshold decoding) commits every masked position with confidence > threshold when that is at least n,
  otherwise the top-n. n is clamped to the number of masked positions (the reference SDAR code could overwrite
  prompt tokens in a first block that holds the prompt's remainder; here it cannot).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """-inf outside the top-k logits and outside the smallest set with cumulative probability >= top_p."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
        drop = cum > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def sample_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                  generator: Optional[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, log-prob under the sampling distribution, model confidence) for logits [..., V]."""
    logits = logits.float()
    model_probs = F.softmax(logits, dim=-1)
    if temperature == 0:
        tokens = filter_logits(logits, top_k, top_p).argmax(dim=-1)
        logp = torch.zeros(tokens.shape)
    else:
        dist_logits = filter_logits(logits / temperature, top_k, top_p)
        logp_all = F.log_softmax(dist_logits, dim=-1)
        flat = logp_all.reshape(-1, logp_all.shape[-1]).exp()
        tokens = torch.multinomial(flat, 1, generator=generator).view(logits.shape[:-1])
        logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    conf = model_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, logp, conf


def transfer_schedule(n: int, steps: int) -> list[int]:
    """Tokens committed at each of ``steps`` steps for ``n`` masked tokens: n // steps each, remainder first."""
    base, rem = divmod(n, steps)
    return [base + (1 if s < rem else 0) for s in range(steps)]


def select_commits(confidence: torch.Tensor, masked: torch.Tensor, n: torch.Tensor, algorithm: str,
                   threshold: float = 0.9, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Which positions to commit. confidence, masked [B, L]; n [B] tokens the static schedule asks for."""
    out = torch.zeros_like(masked)
    for b in range(masked.shape[0]):
        idx = masked[b].nonzero().squeeze(1)
        k = min(int(n[b]), len(idx))
        if len(idx) == 0 or k <= 0:
            continue
        if algorithm == "random":
            pick = idx[torch.randperm(len(idx), generator=generator)[:k]]
        else:
            c = confidence[b, idx]
            if algorithm == "low_confidence_dynamic" and int((c > threshold).sum()) >= k:
                pick = idx[c > threshold]
            else:
                pick = idx[torch.topk(c, k).indices]
        out[b, pick] = True
    return out
