"""Per-token log-probabilities from vocab-parallel logits, without gathering the vocabulary.

    log p(y_k) = z_k[y_k] - logsumexp_v z_k[v]

computed by megatron's vocab-parallel cross-entropy (each TP rank holds V/tp logits). Vocabulary padding
(added so V divides by 128 * tp) is masked to -inf first, so the result equals the HF model's log-softmax
over the true vocabulary.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy


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


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(labels) per position, fp32, differentiable. logits [..., V/tp] (this TP rank's slice)."""
    z = mask_vocab_padding(logits.float(), vocab_size)
    if z is logits:
        z = z.clone()  # megatron's kernel subtracts the max in place
    return -vocab_parallel_cross_entropy(z, labels)
