"""Token sampling and commit selection for dLLM decoding (shared by the built-in engine and the SGLang plugin).

One denoising step turns the model's logits at the still-masked positions into proposals and decides which of
them to commit:

* ``sample_tokens``: x0 ~ softmax(filter(logits / T)) with top-k / top-p filters (argmax when T = 0). Returns the
  proposal, its log-probability under that sampling distribution (0 for greedy: a point mass) and its confidence
  p_theta(x0) under the unfiltered model distribution (SDAR's ``generate.py`` and LLaDA's low-confidence
  remasking rank by the model probability of the proposal).
* ``transfer_schedule``: how many tokens a static schedule commits per step -- n // S each, the remainder to the
  earliest steps (LLaDA ``get_num_transfer_tokens``; SDAR over the block length).
* ``linspace_count``: Dream's schedule (``generation_utils.py``): ``int(n_masked * (1 - s/t))`` with t, s
  consecutive points of ``linspace(1, eps, S + 1)``, computed in float32 as Dream does; the last step commits
  the rest.
* ``dream_confidence``: Dream's ``sample_tokens`` confidence rules on its sampling distribution
  p = softmax(filter(logits / T)) (T = 0: softmax(filter(logits))): ``maskgit_plus`` p(x0), ``topk_margin``
  p_(1) - p_(2), ``entropy`` sum_v p_v log(p_v + 1e-10) (negative entropy: larger = more certain).
* ``select_commits``: ``low_confidence_static`` commits the top-n confident masked positions (``alg_temp`` > 0:
  n positions drawn without replacement with probabilities softmax(confidence / alg_temp), Dream's
  ``alg_temp``); ``random`` commits n random masked positions (LLaDA's random remasking);
  ``low_confidence_dynamic`` (SDAR / TraDo, Fast-dLLM threshold decoding) and ``editing`` (LLaDA2.1, n =
  num_to_transfer) commit every masked position with confidence > threshold when that is at least n, otherwise
  the top-n. n is clamped to the number of masked positions (the reference SDAR code could overwrite prompt
  tokens in a first block that holds the prompt's remainder; here it cannot).
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
        flat = F.softmax(dist_logits, dim=-1).reshape(-1, logp_all.shape[-1])   # the publishers' probs, bitwise
        tokens = torch.multinomial(flat, 1, generator=generator).view(logits.shape[:-1])
        logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    conf = model_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, logp, conf


def transfer_schedule(n: int, steps: int) -> list[int]:
    """Tokens committed at each of ``steps`` steps for ``n`` masked tokens: n // steps each, remainder first."""
    base, rem = divmod(n, steps)
    return [base + (1 if s < rem else 0) for s in range(steps)]


def linspace_count(n_masked: int, step: int, steps: int, eps: float) -> int:
    """Dream's tokens to commit at ``step`` of ``steps`` with ``n_masked`` still masked: int(n_masked * (1 - s/t)),
    t = linspace(1, eps, steps + 1)[step], s = the next point (float32, as ``generation_utils.py``); the last step
    (and any later one) commits every masked position."""
    if step >= steps - 1:
        return n_masked
    ts = torch.linspace(1, eps, steps + 1)
    return int(torch.tensor(n_masked, dtype=torch.long) / 1 * (1 - ts[step + 1] / ts[step]))


def dream_confidence(logits: torch.Tensor, tokens: torch.Tensor, rule: str, temperature: float, top_k: int,
                     top_p: float) -> torch.Tensor:
    """Dream's confidence of the proposals ``tokens`` [...] for logits [..., V] under ``rule`` (maskgit_plus,
    topk_margin, entropy), computed on Dream's sampling distribution softmax(filter(logits / T)) (T = 0: the
    logits unscaled). Follows ``sample_tokens`` of Dream's ``generation_utils.py``."""
    logits = logits.float()
    probs = F.softmax(filter_logits(logits / temperature if temperature > 0 else logits, top_k, top_p), dim=-1)
    if rule == "maskgit_plus":
        return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if rule == "topk_margin":
        top2 = torch.topk(probs, 2, dim=-1).values
        return top2[..., 0] - top2[..., 1]
    if rule == "entropy":
        return (probs * torch.log(probs + 1e-10)).sum(-1)
    raise ValueError(f"dream_confidence: rule {rule!r} unknown (maskgit_plus, topk_margin, entropy)")


def select_commits(confidence: torch.Tensor, masked: torch.Tensor, n: torch.Tensor, algorithm: str,
                   threshold: float = 0.9, generator: Optional[torch.Generator] = None,
                   alg_temp: float = 0.0) -> torch.Tensor:
    """Which positions to commit. confidence, masked [B, L]; n [B] tokens the schedule asks for."""
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
            if algorithm in ("low_confidence_dynamic", "editing") and int((c > threshold).sum()) >= k:
                pick = idx[c > threshold]
            elif alg_temp > 0:   # drawn on the CPU: the commit generator is a CPU one (dllm_step)
                weights = F.softmax(c.float().cpu() / alg_temp, dim=-1)
                pick = idx[torch.multinomial(weights, k, replacement=False, generator=generator).to(idx.device)]
            else:
                pick = idx[torch.topk(c, k).indices]
        out[b, pick] = True
    return out
