"""Training rows, sequence packing and micro-batches.

A ``Row`` is one training sequence as the model sees it (already corrupted): input tokens, targets, a float
loss weight per token (0 = not scored) and positions (restarting at 0 for every sample; block diffusion rows
hold x_t ++ x_0 with the positions repeated and ``stream_ids`` 0/1). Its ``denom`` is its share of the global
loss denominator, so that

    loss = sum_{rows, tokens} weight * CE  /  sum_{rows} denom

is one number for the whole global batch, however the rows are packed, split into micro-batches or spread
over data-parallel ranks (the per-token mean over the global batch, not a mean of means).

``pack_rows`` packs rows first-fit-decreasing into sequences of ``seq_length`` tokens; packed samples get
their own segment ids, so attention never crosses samples (the masks of models/attention.py respect them).
A row longer than ``seq_length`` made of several segments (the views of one RL sample whose estimate spans them)
is cut at segment boundaries into pieces that share one micro-batch (up to ``micro_batch_size`` sequences), so an
estimate over all its views is still formed in one forward; ``MicroBatch.row_ids`` names the input row of every
position, wherever it was packed.

What every RL algorithm's rows and micro-batches carry is a named field (``ROW_COLUMNS``: the estimator's slots,
advantages, ...; ``PASSES``: the trainer's old / reference / behaviour log-probs); ``extras`` holds only what one
algorithm (or one test) adds of its own. Both are per-position tensors, carried through packing and splits alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megadare.models.attention import MaskSpec
from megadare.models.family import MaskKind

ROW_COLUMNS = ("slot", "head", "adv", "tok", "sample")  # RL rows (algos/base.py views_to_row)
PASSES = ("old", "ref", "behave", "is_weight")  # the trainer's passes over packed micro-batches
MB_COLUMNS = ("row_ids",) + ROW_COLUMNS + PASSES  # every per-position field of a micro-batch


@dataclass
class Row:
    tokens: torch.Tensor  # [n] long, model input
    labels: torch.Tensor  # [n] long, target token at each position
    weight: torch.Tensor  # [n] float, loss weight (0 = not scored)
    position_ids: torch.Tensor  # [n] long, position inside the sample (global prompt+response grid)
    stream_ids: Optional[torch.Tensor] = None  # [n] long, block diffusion: 0 = x_t, 1 = x_0
    denom: float = 0.0  # share of the global loss denominator
    segment_ids: Optional[torch.Tensor] = None  # [n] long, 0.. : several views of one sample kept in one row
    # (attention never crosses them); None = one segment
    # RL rows (algos/base.py views_to_row; None in SFT rows), each [n]:
    slot: Optional[torch.Tensor] = None  # long, the estimator slot a scored position adds into (-1: none)
    head: Optional[torch.Tensor] = None  # float, the slot's aggregation weight, on its first position
    adv: Optional[torch.Tensor] = None  # float, advantage
    tok: Optional[torch.Tensor] = None  # long, which response token the position's target is (-1: prompt)
    sample: Optional[torch.Tensor] = None  # long, the RLSample's index
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # one algorithm's own per-position [n] tensors
    # (JustGRPO's logit_scale, ``per_slot_<name>``), carried through packing

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        for name in ("labels", "weight", "position_ids", "stream_ids", "segment_ids") + ROW_COLUMNS:
            t = getattr(self, name)
            if t is not None and t.shape != (n,):
                raise ValueError(f"Row.{name} has shape {tuple(t.shape)}, expected ({n},)")
        for name, t in self.extras.items():
            if t.shape != (n,):
                raise ValueError(f"Row.extras[{name!r}] has shape {tuple(t.shape)}, expected ({n},)")

    @property
    def num_segments(self) -> int:
        return 1 if self.segment_ids is None else int(self.segment_ids.max()) + 1

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [b, S]
    labels: torch.Tensor  # [b, S]
    weight: torch.Tensor  # [b, S] float
    position_ids: torch.Tensor  # [b, S]
    segment_ids: torch.Tensor  # [b, S]; padding has its own segment
    stream_ids: Optional[torch.Tensor] = None
    padding: Optional[torch.Tensor] = None  # [b, S] bool, True = packing padding (kept out of MoE routing stats)
    denom: float = 0.0
    num_rows: int = 0
    row_ids: Optional[torch.Tensor] = None  # [b, S] long, the input row of every position (-1: padding)
    # ROW_COLUMNS, packed ([b, S]; None when the rows have none):
    slot: Optional[torch.Tensor] = None
    head: Optional[torch.Tensor] = None
    adv: Optional[torch.Tensor] = None
    tok: Optional[torch.Tensor] = None
    sample: Optional[torch.Tensor] = None
    # PASSES ([b, S] per-position log-probs / weights; set on the last pipeline stage by the trainer's passes):
    old: Optional[torch.Tensor] = None  # under the policy before the update (the proximal policy)
    ref: Optional[torch.Tensor] = None  # under the reference model
    behave: Optional[torch.Tensor] = None  # under each sample's behaviour policy (trainer/offpolicy/correction.py)
    is_weight: Optional[torch.Tensor] = None  # the slot's behaviour -> proximal IS weight (decoupled loss)
    version_logp: dict[int, torch.Tensor] = field(default_factory=dict)  # policy version -> log-probs under it
    extras: dict = field(default_factory=dict)  # one algorithm's own per-position tensors (as Row.extras)
    context: Optional[dict] = None  # context parallelism: this is one CP rank's slice; the whole sequence's
    # 'slot' and 'row_ids', the CP 'group' and its 'size' (trainer/step.py)

    def put(self, key: str, value: torch.Tensor) -> None:
        """Store a pass's per-position outputs: in its field when ``key`` is one of ``PASSES``, else in extras."""
        if key in PASSES:
            setattr(self, key, value)
        else:
            self.extras[key] = value

    def mask(self, kind: MaskKind, block_size: int) -> MaskSpec:
        """The attention mask of this micro-batch (packing-aware)."""
        return MaskSpec(
            kind,
            block_size=max(1, block_size),
            segment_ids=self.segment_ids,
            position_ids=self.position_ids,
            stream_ids=self.stream_ids if kind == MaskKind.BLOCK_DIFFUSION else None,
        )

    def megatron_mask(self, kind: str, block_size: int) -> torch.Tensor:
        """The same mask materialised in Megatron's convention ([b, 1, S, S] bool, True = masked out), for
        megatron's own DotProductAttention (the ``local`` attention backend)."""
        S = self.tokens.shape[1]
        return ~self.mask(kind, block_size).dense(S, S, self.tokens.shape[0], device=self.tokens.device)

    @property
    def scored(self) -> torch.Tensor:
        """[b, S] bool: the positions a loss reads -- a loss weight, or an RL slot (``slot`` >= 0,
        algos/base.py) -- and the only ones where the trainer runs the output layer (models/head.py)."""
        s = self.weight != 0
        if self.slot is not None:
            s = s | (self.slot >= 0)
        return s


def _first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    shortest = min(lengths, default=0)
    bins: list[list[int]] = []
    free: list[int] = []
    open_: list[int] = []  # the bins, in order, that can still take the shortest row (the others take none)
    for i in order:
        for b in open_:
            if lengths[i] <= free[b]:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            b = len(bins)
            bins.append([i])
            free.append(capacity - lengths[i])
            open_.append(b)
        if free[b] < shortest:
            open_.remove(b)
    return bins


def _columns(row: Row) -> dict[str, torch.Tensor]:
    """The row's optional per-position tensors by packing key: ``f:<field>`` (ROW_COLUMNS), ``x:<extra>``."""
    out = {"f:" + k: getattr(row, k) for k in ROW_COLUMNS if getattr(row, k) is not None}
    out.update({"x:" + k: v for k, v in row.extras.items()})
    return out


def _concat_bin(rows: list[Row], seq_length: int, pad_id: int, origins: list[int]) -> dict[str, torch.Tensor]:
    n = sum(len(r) for r in rows)
    pad = seq_length - n
    streams = any(r.stream_ids is not None for r in rows)
    segs, first = [], 0
    for r in rows:
        segs.append(first + (r.segment_ids if r.segment_ids is not None else torch.zeros(len(r), dtype=torch.long)))
        first += r.num_segments
    seg = torch.cat(segs + [torch.full((pad,), first, dtype=torch.long)])
    out = {
        "tokens": torch.cat([r.tokens for r in rows] + [torch.full((pad,), pad_id, dtype=torch.long)]),
        "labels": torch.cat([r.labels for r in rows] + [torch.zeros(pad, dtype=torch.long)]),
        "weight": torch.cat([r.weight.float() for r in rows] + [torch.zeros(pad)]),
        "position_ids": torch.cat([r.position_ids for r in rows] + [torch.arange(pad, dtype=torch.long)]),
        "segment_ids": seg,
        "padding": torch.cat([torch.zeros(n, dtype=torch.bool), torch.ones(pad, dtype=torch.bool)]),
        # which input row each position came from (-1 = padding): per-row quantities survive packing and splits
        "row_ids": torch.cat(
            [torch.full((len(r),), o, dtype=torch.long) for o, r in zip(origins, rows)]
            + [torch.full((pad,), -1, dtype=torch.long)]
        ),
    }
    columns = [_columns(r) for r in rows]
    for key in sorted({k for c in columns for k in c}):
        parts = []
        for c in columns:
            if key not in c:
                raise ValueError(f"rows packed together disagree on extras: one lacks {key[2:]!r}")
            parts.append(c[key])
        fill = -1 if not parts[0].is_floating_point() else 0.0
        out[key] = torch.cat(parts + [torch.full((pad,), fill, dtype=parts[0].dtype)])
    if streams:
        out["stream_ids"] = torch.cat(
            [r.stream_ids if r.stream_ids is not None else torch.zeros(len(r), dtype=torch.long) for r in rows]
            + [torch.zeros(pad, dtype=torch.long)]
        )
    return out


def split_at_segments(row: Row, seq_length: int, where: str = "row") -> list[Row]:
    """Pieces of ``row``, cut at segment boundaries, each at most ``seq_length`` tokens (greedy, in order); the
    first piece carries the row's ``denom``. A single segment longer than ``seq_length`` cannot be cut."""
    seg = row.segment_ids if row.segment_ids is not None else torch.zeros(len(row), dtype=torch.long)
    bounds = [0] + (torch.nonzero(seg[1:] != seg[:-1]).flatten() + 1).tolist() + [len(row)]
    pieces, lo = [], 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b - a > seq_length:
            raise ValueError(
                f"{where} has a view of {b - a} tokens, more than train.seq_length={seq_length}; "
                "raise train.seq_length or lower data.max_length / rollout.max_new_tokens"
            )
        if b - lo > seq_length:
            pieces.append((lo, a))
            lo = a
    pieces.append((lo, len(row)))
    out = []
    for i, (a, b) in enumerate(pieces):
        sl = slice(a, b)
        out.append(
            Row(
                tokens=row.tokens[sl],
                labels=row.labels[sl],
                weight=row.weight[sl],
                position_ids=row.position_ids[sl],
                stream_ids=None if row.stream_ids is None else row.stream_ids[sl],
                denom=row.denom if i == 0 else 0.0,
                segment_ids=seg[sl] - seg[a],
                extras={k: v[sl] for k, v in row.extras.items()},
                **{k: None if getattr(row, k) is None else getattr(row, k)[sl] for k in ROW_COLUMNS},
            )
        )
    return out


def _micro_batch(
    group: list[tuple[dict, float, int]], seq_length: int, pad_id: int, micro_batch_size: int
) -> MicroBatch:
    """Stack packed sequences (filled up with padding sequences) into one micro-batch."""
    group = list(group)
    while len(group) < micro_batch_size:
        group.append((_concat_bin([], seq_length, pad_id, []), 0.0, 0))
    stack = {
        key: torch.stack([g[0][key] for g in group])
        for key in group[0][0]
        if key != "stream_ids" and key[:2] not in ("x:", "f:")
    }
    streams = None
    if any("stream_ids" in g[0] for g in group):
        streams = torch.stack([g[0].get("stream_ids", torch.zeros(seq_length, dtype=torch.long)) for g in group])
    fields: dict[str, torch.Tensor] = {}
    extras: dict[str, torch.Tensor] = {}
    for key in sorted({k for g in group for k in g[0] if k[:2] in ("x:", "f:")}):
        like = next(g[0][key] for g in group if key in g[0])
        fill = -1 if not like.is_floating_point() else 0.0
        (fields if key.startswith("f:") else extras)[key[2:]] = torch.stack(
            [g[0].get(key, torch.full((seq_length,), fill, dtype=like.dtype)) for g in group]
        )
    return MicroBatch(
        stream_ids=streams,
        denom=sum(g[1] for g in group),
        num_rows=sum(g[2] for g in group),
        extras=extras,
        **fields,
        **stack,
    )


def pack_rows(rows: list[Row], seq_length: int, micro_batch_size: int = 1, pad_id: int = 0) -> list[MicroBatch]:
    """Pack rows into sequences of ``seq_length`` (first-fit decreasing) and group them into micro-batches; a
    longer multi-segment row is split at segment boundaries into one micro-batch of its own."""
    fits, split = [], []
    for i, r in enumerate(rows):
        if len(r) <= seq_length:
            fits.append(i)
        elif r.num_segments == 1:
            raise ValueError(
                f"row {i} has {len(r)} tokens, more than train.seq_length={seq_length}; "
                "raise train.seq_length or lower data.max_length"
            )
        else:
            split.append(i)
    bins = _first_fit_decreasing([len(rows[i]) for i in fits], seq_length)
    seqs = [
        (
            _concat_bin([rows[fits[j]] for j in b], seq_length, pad_id, [fits[j] for j in b]),
            sum(rows[fits[j]].denom for j in b),
            len(b),
        )
        for b in bins
    ]
    out = [
        _micro_batch(seqs[k : k + micro_batch_size], seq_length, pad_id, micro_batch_size)
        for k in range(0, len(seqs), micro_batch_size)
    ]
    for i in split:
        pieces = split_at_segments(rows[i], seq_length, f"row {i}")
        piece_bins = _first_fit_decreasing([len(p) for p in pieces], seq_length)
        if len(piece_bins) > micro_batch_size:
            raise ValueError(
                f"row {i} has {len(rows[i])} tokens in views that must share a micro-batch, more than "
                f"train.micro_batch_size={micro_batch_size} x train.seq_length={seq_length} hold; "
                "raise either, or lower the algorithm's Monte-Carlo samples (algo.params.n_mc)"
            )
        group = [
            (
                _concat_bin([pieces[j] for j in b], seq_length, pad_id, [i] * len(b)),
                sum(pieces[j].denom for j in b),
                int(k == 0),
            )
            for k, b in enumerate(piece_bins)
        ]
        out.append(_micro_batch(group, seq_length, pad_id, micro_batch_size))
    return out


def empty_micro_batch(like: MicroBatch) -> MicroBatch:
    """A micro-batch of padding with zero weight (evens out micro-batch counts across ranks)."""
    b, s = like.tokens.shape
    z = torch.zeros(b, s, dtype=torch.long)
    empty = lambda v: None if v is None else torch.full_like(v, 0.0 if v.is_floating_point() else -1)  # noqa: E731
    extras = {k: empty(v) for k, v in like.extras.items()}
    return MicroBatch(
        tokens=z.clone(),
        labels=z.clone(),
        weight=torch.zeros(b, s),
        position_ids=torch.arange(s).expand(b, s).clone(),
        segment_ids=z.clone(),
        stream_ids=None if like.stream_ids is None else z.clone(),
        padding=torch.ones(b, s, dtype=torch.bool),
        denom=0.0,
        num_rows=0,
        extras=extras,
        **{k: empty(getattr(like, k)) for k in MB_COLUMNS},
    )


def split_for_data_parallel(
    micro_batches: list[MicroBatch], dp_size: int, dp_rank: int, multiple_of: int = 1
) -> list[MicroBatch]:
    """This DP rank's micro-batches (round robin); every rank gets the same count, a multiple of
    ``multiple_of`` (the interleaved pipeline schedule needs one), padded with empty micro-batches."""
    if not micro_batches:
        raise ValueError("no micro-batches to split: the global batch is empty")
    per_rank = -(-len(micro_batches) // dp_size)
    per_rank = -(-per_rank // multiple_of) * multiple_of
    mine = micro_batches[dp_rank::dp_size]
    while len(mine) < per_rank:
        mine.append(empty_micro_batch(micro_batches[0]))
    return mine


def global_denominator(micro_batches: list[MicroBatch]) -> float:
    d = float(sum(m.denom for m in micro_batches))
    if d <= 0:
        raise ValueError("the global batch has no scored tokens (loss denominator is 0)")
    return d
