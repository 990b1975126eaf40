"""Forward-only passes of a (pipelined) Megatron model through megatron's own schedules.

``forward_logits`` runs the model chunks of this rank over micro-batches with ``get_forward_backward_func``
(1F1B or interleaved under PP, plain loop otherwise) and returns full-vocabulary logits on the last pipeline
stage (gathered over TP, vocab padding cut off); other stages get None. Used for parity tests, reference/old
log-probs and weight-sync checks. ``run_schedule`` is that schedule call over this rank's chunks, shared with the
training pass (trainer/step.py).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megadare.models.attention import MaskSpec
from megadare.parallel.cpu import hot_section, in_hot_section


def _gather_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    return logits[..., :vocab_size]


def run_schedule(chunks: list[torch.nn.Module], micro_batches: list, forward_step, seq_length: int, mbs: int, **flags):
    """Megatron's schedule (``get_forward_backward_func``) over ``micro_batches`` with this rank's model ``chunks``:
    one data iterator per virtual pipeline chunk when there are several (interleaved 1F1B), else one iterator and
    the single chunk. ``flags``: ``forward_only``, ``collect_non_loss_data``."""
    several = len(chunks) > 1

    def hot_forward_step(data_iterator, model):  # on CPU without the CUDA-to-CPU mode (parallel/cpu.py): the
        with hot_section():  # forward, and the loss the schedule calls on its output (megadare's own code)
            output, loss_func = forward_step(data_iterator, model)
        return output, in_hot_section(loss_func)

    return get_forward_backward_func()(
        forward_step_func=hot_forward_step,
        data_iterator=[iter(micro_batches) for _ in chunks] if several else iter(micro_batches),
        model=chunks if several else chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=mbs,
        **flags,
    )


@torch.no_grad()
def forward_logits(
    chunks: list[torch.nn.Module],
    input_ids: torch.Tensor,
    vocab_size: int,
    mask: Optional[MaskSpec] = None,
    position_ids: Optional[torch.Tensor] = None,
    micro_batch_size: Optional[int] = None,
) -> Optional[torch.Tensor]:
    """Logits [B, S, vocab] on the last pipeline stage (None elsewhere). Every rank passes the same batch."""
    B, S = input_ids.shape
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if micro_batch_size is None:
        # the interleaved schedule needs at least PP micro-batches
        micro_batch_size = B // pp if len(chunks) > 1 and B % pp == 0 else B
    mbs = micro_batch_size
    if B % mbs:
        raise ValueError(f"batch {B} is not divisible by micro_batch_size {mbs}")
    n_micro = B // mbs
    device = next(chunks[0].parameters()).device  # the callers' tensors usually sit on the CPU
    input_ids = input_ids.to(device)
    position_ids = (
        torch.arange(S, device=device).unsqueeze(0).expand(B, S) if position_ids is None else position_ids.to(device)
    )
    if mask is not None:  # a MaskSpec, or a bool tensor (``local`` attention)
        mask = mask.to(device)
    for c in chunks:
        c.eval()
    micro = [(input_ids[i * mbs : (i + 1) * mbs], position_ids[i * mbs : (i + 1) * mbs]) for i in range(n_micro)]

    def forward_step(data_iterator, model):
        ids, pos = next(data_iterator)
        out = model(ids, pos, mask)

        def collect(output_tensor, non_loss_data=False):
            return _gather_vocab(output_tensor, vocab_size)

        return out, collect

    # seq_length=S: megatron divides by TP itself under sequence parallelism
    out = run_schedule(chunks, micro, forward_step, S, mbs, forward_only=True, collect_non_loss_data=True)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return torch.cat(list(out), dim=0)
