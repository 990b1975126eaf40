"""One optimizer step through megatron's pipeline schedules.

``train_step`` runs this rank's micro-batches through ``get_forward_backward_func`` (no pipelining, 1F1B, or
interleaved 1F1B with virtual stages), then megatron's ``finalize_model_grads`` (DP / expert-DP grad reduction,
tied-embedding and SP-norm all-reduces, MoE expert-bias updates) and the optimizer step with gradient clipping.

Loss scaling. The objective of a micro-batch returns a sum over its tokens, sum_k w_k * l_k. The step minimises

    L = sum_{global batch} w_k * l_k / D,     D = sum of the rows' ``denom`` over the global batch,

computed on the host before the step. megatron divides each micro-batch loss by the number of micro-batches
(and multiplies by CP), and DDP averages gradients over the DP x CP ranks; the loss handed to megatron is
therefore sum_k w_k l_k / D * n_micro * dp, which makes the reduced gradient exactly dL/dtheta -- the
per-token mean over the global batch, not a mean of micro-batch means.

Output layer. The model runs its vocab projection only at the positions the objective reads
(``MicroBatch.scored``), without [tokens, vocab] logits (models/head.py, the chunk's ``head_settings``); with
``train.logits=full`` it returns the logits of every position and the log-probs come from trainer/logprob.py.
Either way the objective sees per-position log-probs [b, S] (zero where not scored under the default path).
With ``entropy`` the micro-batch handed to the objective also carries the entropy per position
(``extras['entropy']``, differentiable) and the step reports its mean over the scored positions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import finalize_model_grads
from megatron.core.utils import unwrap_model

from megadare.data.rows import MB_COLUMNS, MicroBatch
from megadare.models.family import MaskKind
from megadare.models.head import HeadSettings, ScoredOutput, ScoredTargets
from megadare.trainer.forward import run_schedule
from megadare.trainer.logprob import token_entropy, token_logprobs
from megadare.trainer.optim import Trainable


class Objective(Protocol):
    """Turns one micro-batch's per-token log-probs into (sum of weighted per-token losses, report sums)."""

    def __call__(self, mb: MicroBatch, logp: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


@dataclass(frozen=True)
class RowFormat:
    """How the model reads a micro-batch's rows: the attention mask (``kind`` with the denoising ``block`` size,
    or a ``mask_fn`` building it from the micro-batch) and the vocabulary size of the output layer."""

    kind: MaskKind
    block: int
    vocab: int
    mask_fn: Optional[Callable[[MicroBatch], Any]] = None

    def mask(self, mb: MicroBatch):
        return self.mask_fn(mb) if self.mask_fn is not None else mb.mask(self.kind, self.block)


@dataclass(frozen=True)
class Readout:
    """What a pass reads from the model's output at each position: the labels' log-probs (``entropy``: also the
    entropies, module doc), or ``per_position(output, micro-batch)`` (a value head's outputs)."""

    per_position: Optional[Callable[[torch.Tensor, MicroBatch], torch.Tensor]] = None
    entropy: bool = False


LOGPROBS = Readout()


def weighted_nll(mb: MicroBatch, logp: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SFT objective: sum_k w_k * (-log p_theta(y_k | x_t)) (the ELBO weights live in ``mb.weight``)."""
    loss = -(mb.weight * logp).sum()
    return loss, {"loss": loss.detach()}


def cp_slice(mb: MicroBatch) -> MicroBatch:
    """This context-parallel rank's contiguous chunk of the sequence (the mask keeps the full sequence); RL
    micro-batches also carry the whole sequence's slots (``context``: algos/base.py ``SlotIndex``)."""
    cp = ps.get_context_parallel_world_size()
    if cp == 1:
        return mb
    r = ps.get_context_parallel_rank()
    S = mb.tokens.shape[1]
    if S % cp:
        raise ValueError(f"sequence length {S} is not divisible by parallel.cp={cp}")
    sl = slice(r * S // cp, (r + 1) * S // cp)
    cut = lambda v: v[:, sl] if torch.is_tensor(v) and v.dim() == 2 and v.shape[1] == S else v  # noqa: E731
    extras = {k: cut(v) for k, v in mb.extras.items()}
    context = (
        {"slot": mb.slot, "row_ids": mb.row_ids, "size": cp, "group": ps.get_context_parallel_group()}
        if mb.slot is not None
        else None
    )
    return MicroBatch(
        tokens=mb.tokens[:, sl],
        labels=mb.labels[:, sl],
        weight=mb.weight[:, sl],
        position_ids=mb.position_ids[:, sl],
        segment_ids=mb.segment_ids[:, sl],
        stream_ids=None if mb.stream_ids is None else mb.stream_ids[:, sl],
        padding=None if mb.padding is None else mb.padding[:, sl],
        denom=mb.denom,
        num_rows=mb.num_rows,
        extras=extras,
        context=context,
        **{k: cut(getattr(mb, k)) for k in MB_COLUMNS},
    )


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _to(mb: MicroBatch, device: torch.device) -> MicroBatch:
    if device.type == "cpu":
        return mb
    mv = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
    return MicroBatch(
        tokens=mv(mb.tokens),
        labels=mv(mb.labels),
        weight=mv(mb.weight),
        position_ids=mv(mb.position_ids),
        segment_ids=mv(mb.segment_ids),
        stream_ids=mv(mb.stream_ids),
        padding=mv(mb.padding),
        denom=mb.denom,
        num_rows=mb.num_rows,
        extras={k: mv(v) if torch.is_tensor(v) else v for k, v in mb.extras.items()},
        **{k: mv(getattr(mb, k)) for k in MB_COLUMNS},
    )


def head_settings(chunks: list[torch.nn.Module]) -> HeadSettings:
    """How the model chunks compute their output layer (``DLLMGPTModel.head_settings``, inside any wrapper)."""
    return getattr(unwrap_model(chunks[-1]), "head_settings", HeadSettings())


def _targets(
    mb: MicroBatch, head: HeadSettings, vocab_size: int, logprobs: bool, entropy: bool
) -> Optional[ScoredTargets]:
    """What the model's output layer computes for ``mb``: the scored positions (None: logits everywhere)."""
    if head.mode != "scored":
        return None
    x = mb.extras
    return ScoredTargets(
        positions=mb.scored,
        labels=mb.labels if logprobs else None,
        vocab_size=vocab_size,
        logit_scale=x.get("logit_scale"),
        excluded_token=x.get("excluded_token"),
        entropy=entropy,
        chunk_mb=head.chunk_mb,
    )


def _per_position(out, mb: MicroBatch, vocab_size: int, per_position, entropy: bool):
    """(per-position log-probs or ``per_position`` outputs [b, S], entropies or None) of a model output."""
    if isinstance(out, ScoredOutput):
        return (per_position(out.values, mb) if per_position is not None else out.values), out.entropy
    if per_position is not None:
        return per_position(out, mb), None
    x = mb.extras
    args = (x.get("logit_scale"), x.get("excluded_token"))
    return (
        token_logprobs(out, mb.labels, vocab_size, *args),
        token_entropy(out, vocab_size, *args) if entropy else None,
    )


def run_micro_batches(
    chunks: list[torch.nn.Module],
    micro_batches: list[MicroBatch],
    fmt: RowFormat,
    objective: Objective,
    loss_scale: Optional[float] = None,
    readout: Readout = LOGPROBS,
) -> dict[str, float]:
    """Forward and backward of this rank's micro-batches; returns report sums reduced over the whole global batch
    (DP x CP) and broadcast over PP, each divided by ``loss_scale``'s D (see module doc). ``loss_scale`` None:
    a forward-only pass (no backward, no scaling).

    The objective sees what ``readout`` reads at each position: label log-probs (and entropies, module doc) or
    ``per_position(model output, micro-batch)`` (a value head's outputs)."""
    forward_only = loss_scale is None
    loss_scale = 1.0 if loss_scale is None else loss_scale
    per_position, entropy, vocab_size = readout.per_position, readout.entropy, fmt.vocab
    device = _device()
    n_micro = len(micro_batches)
    dp = ps.get_data_parallel_world_size()
    seq_len = micro_batches[0].tokens.shape[1]
    mbs = micro_batches[0].tokens.shape[0]
    head = head_settings(chunks)

    def forward_step(data_iterator, model):
        full = _to(next(data_iterator), device)
        mb = cp_slice(full)
        mask = fmt.mask(full)
        moe = getattr(chunks[0].config, "num_moe_experts", None)
        out = model(
            mb.tokens,
            mb.position_ids,
            mask,
            labels=_targets(mb, head, vocab_size, per_position is None, entropy),
            padding_mask=mb.padding if moe else None,
        )

        def loss_func(output):
            logp, ent = _per_position(output, mb, vocab_size, per_position, entropy)
            seen = mb
            if ent is not None:  # the objective may read it (an entropy bonus); the report takes its mean
                seen = dataclasses.replace(mb, extras={**mb.extras, "entropy": ent})
            loss_sum, report = objective(seen, logp)
            if ent is not None:
                scored = mb.scored
                report = {
                    **report,
                    "entropy_sum": (ent.detach() * scored).sum(),
                    "scored_tokens": scored.sum().to(ent.dtype),
                }
            return loss_sum * (loss_scale * n_micro * dp), report

        return out, loss_func

    cp_len = seq_len // ps.get_context_parallel_world_size()
    reports = run_schedule(chunks, micro_batches, forward_step, cp_len, mbs, forward_only=forward_only)
    metrics = _reduce_reports(reports, loss_scale, device)
    if "entropy_sum" in metrics:
        metrics["entropy"] = metrics.pop("entropy_sum") / max(metrics.pop("scored_tokens"), 1e-30)
    return metrics


def store_outputs(chunks, micro_batches, key: str, fmt: RowFormat, readout: Readout = LOGPROBS) -> None:
    """Per-position log-probs (or ``readout``'s per-position outputs, e.g. values) of the micro-batches under
    ``chunks`` into ``mb.put(key, ...)`` (a ``PASSES`` field, else extras; on the last pipeline stage)."""
    for mb, out in zip(micro_batches, outputs_of(chunks, micro_batches, fmt, readout)):
        mb.put(key, out)


def outputs_of(chunks, micro_batches, fmt: RowFormat, readout: Readout = LOGPROBS) -> list[torch.Tensor]:
    """Per-position log-probs (or ``readout``'s per-position outputs) [b, S] of each micro-batch under ``chunks``,
    on the micro-batches' device; empty on the stages before the last pipeline stage."""
    got: list[torch.Tensor] = []

    def grab(mb, logp):
        got.append(logp.detach())
        return (logp * 0).sum(), {}

    with torch.no_grad():
        run_micro_batches(chunks, micro_batches, fmt, grab, readout=readout)
    cp = ps.get_context_parallel_world_size()
    out = []
    for mb, lp in zip(micro_batches, got):
        if cp > 1:  # each CP rank scored its slice: the whole sequence, in rank order (cp_slice)
            parts = [torch.empty_like(lp) for _ in range(cp)]
            dist.all_gather(parts, lp.contiguous(), group=ps.get_context_parallel_group())
            lp = torch.cat(parts, dim=1)
        out.append(lp.to(mb.weight.device))
    return out


def _reduce_reports(reports: list[dict], scale: float, device: torch.device) -> dict[str, float]:
    keys = sorted(reports[0].keys()) if reports else []
    # only the last pipeline stage has reports: it tells the other stages the key set, then the sums
    pp_group = ps.get_pipeline_model_parallel_group()
    last = ps.get_pipeline_model_parallel_last_rank()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        names = [keys]
        dist.broadcast_object_list(names, src=last, group=pp_group)
        keys = names[0]
    vals = torch.zeros(len(keys), dtype=torch.float64, device=device)
    for r in reports:
        for i, k in enumerate(keys):
            vals[i] += r[k].double().sum()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(vals, src=last, group=pp_group)
    dist.all_reduce(vals, group=ps.get_data_parallel_group(with_context_parallel=True))
    return {k: float(v) * scale for k, v in zip(keys, vals.tolist())}


def train_step(
    trained: Trainable,
    micro_batches: list[MicroBatch],
    global_denom: float,
    fmt: RowFormat,
    objective: Objective = weighted_nll,
    readout: Readout = LOGPROBS,
) -> dict[str, float]:
    """One optimizer step of ``trained`` (model chunks, optimiser, LR schedule) on this rank's micro-batches.
    Returns metrics (same on every rank); with ``readout.entropy`` also the mean entropy of the scored positions
    (module doc)."""
    chunks, optimizer, scheduler = trained.model, trained.optimizer, trained.scheduler
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    for c in chunks:
        c.train()
        c.zero_grad_buffer()
    optimizer.zero_grad()
    metrics = run_micro_batches(chunks, micro_batches, fmt, objective, 1.0 / global_denom, readout)
    metrics["lr"] = float(optimizer.param_groups[0]["lr"])
    ok, grad_norm, _ = optimizer.step()
    if ok:
        scheduler.step(increment=1)
    metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    metrics["skipped"] = 0.0 if ok else 1.0
    return metrics
