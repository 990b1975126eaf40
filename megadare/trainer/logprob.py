"""Per-token log-probabilities from vocab-parallel logits, without gathering the vocabulary.

    log p(y_k) = z_k[y_k] - logsumexp_v z_k[v]

computed by megatron's vocab-parallel cross-entropy (each TP rank holds V/tp logits). Vocabulary padding
(added so V divides by 128 * tp) is masked to -inf first, so the result equals the HF model's log-softmax
over the true vocabulary.

Rows may score under a sampler's distribution instead of the model's (JustGRPO: the likelihood of a token is
its probability under the rollout's sampling distribution): per-position ``logit_scale`` s (1/T) and
``excluded_token`` e (a token the sampler never proposes, e.g. the mask token; -1 none) give

    log p(y_k) = s z_k[y_k] - logsumexp_{v != e} s z_k[v].

``token_entropy`` is the entropy of the same distribution, H_k = -sum_v p_kv log p_kv, vocab-parallel too. Both
read full [tokens, V/tp] logits (``train.logits=full``); the default path computes them without logits, on the
scored positions only (models/head.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region, vocab_parallel_cross_entropy


def mask_vocab_padding(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """-inf on the padded vocabulary entries of this TP rank's logit slice (a new tensor when any)."""
    part = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * part
    n_real = max(0, min(part, vocab_size - start))
    if n_real == part:
        return logits
    pad = torch.zeros(part, dtype=torch.bool, device=logits.device)
    pad[n_real:] = True
    return logits.masked_fill(pad, float("-inf"))


def exclude_tokens(logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """-inf at vocabulary entry ``token[...]`` of each position (-1: none) of this TP rank's logit slice."""
    part = logits.shape[-1]
    local = token - parallel_state.get_tensor_model_parallel_rank() * part
    hit = ((token >= 0) & (local >= 0) & (local < part)).unsqueeze(-1)
    idx = local.clamp(0, part - 1).unsqueeze(-1)  # no host sync: a miss writes its own value back
    return logits.scatter(-1, idx, logits.gather(-1, idx).masked_fill(hit, float("-inf")))


def _scaled(
    logits: torch.Tensor, vocab_size: int, logit_scale: Optional[torch.Tensor], excluded_token: Optional[torch.Tensor]
) -> torch.Tensor:
    z = logits.float()
    if logit_scale is not None:
        z = z * logit_scale.unsqueeze(-1).to(z.dtype)
    z = mask_vocab_padding(z, vocab_size)
    if excluded_token is not None:
        z = exclude_tokens(z, excluded_token)
    return z


def token_entropy(
    logits: torch.Tensor,
    vocab_size: int,
    logit_scale: Optional[torch.Tensor] = None,
    excluded_token: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Entropy per position of the distribution ``token_logprobs`` scores under, fp32, differentiable."""
    z = _scaled(logits, vocab_size, logit_scale, excluded_token)
    m = z.detach().amax(-1, keepdim=True)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    d = z - m
    e = d.exp()
    s = reduce_from_tensor_model_parallel_region(e.sum(-1))
    ed = reduce_from_tensor_model_parallel_region((e * torch.where(torch.isfinite(d), d, 0.0)).sum(-1))
    return s.log() - ed / s


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    logit_scale: Optional[torch.Tensor] = None,
    excluded_token: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """log p(labels) per position, fp32, differentiable. logits [..., V/tp] (this TP rank's slice); optional
    per-position ``logit_scale`` and ``excluded_token`` [...] (module doc)."""
    z = _scaled(logits, vocab_size, logit_scale, excluded_token)
    if z is logits:
        z = z.clone()  # megatron's kernel subtracts the max in place
    return -vocab_parallel_cross_entropy(z, labels)
