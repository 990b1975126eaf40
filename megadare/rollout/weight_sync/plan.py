"""The weight-sync plan: which rank sends which shard to which pipeline stage's sender, and how every stage's HF
tensors are cut into buckets of flattened per-dtype buffers. Built once per run from megatron's own sharding
metadata (collective, metadata only), identical on every trainer rank; the engines get its public part.

* Shards: every rank's ``sharded_state_dict`` (the layout-independent keys the checkpoint converter writes), main
  replicas only, so each element of every global tensor is held by exactly one (rank, shard). TP / SP / EP / ETP /
  VPP / DP only change which rank holds which shard, never the code path.
* Stages: each pipeline stage's lowest rank is its *sender*; a key belongs to the stage whose ranks hold its shards
  (its layers, plus embedding on the first and head on the last stage). Every stage assembles only its own keys.
* Buckets: a stage's table rows in the family's order, non-expert rows first, closed when their HF tensors reach
  ``bucket_bytes``. A bucket's HF tensors form one :class:`Flat` per dtype: the tensors packed back to back in list
  order, which is SGLang's ``flattened_bucket`` layout, so one broadcast carries a whole buffer.
* Sources: per bucket, the shards other ranks of the stage send to the sender, packed into one byte buffer per
  rank (16-byte aligned pieces, so each piece is viewed in place with its dtype).

HF names, dtypes and shapes come from the mapping table's transform run on meta tensors (no data), so the plan is
exact for any transform (plain ``ParamMap.to_hf``, or the block-fp8 stream that adds ``weight_scale_inv``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megadare.convert.mcore_ckpt import _drop_extra_state, model_sharded_state_dict
from megadare.models.mapping import ParamMap

ALIGN = 16
# table row + its global Megatron tensor -> [(HF name, tensor)]
Transform = Callable[[ParamMap, torch.Tensor], list[tuple[str, torch.Tensor]]]


def plain_hf(row: ParamMap, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The family table's Megatron -> HF transform (``ParamMap.to_hf``)."""
    return list(zip(row.hf, row.to_hf(full)))


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    return int(torch.Size(shape).numel()) * dtype.itemsize


@dataclass(frozen=True)
class Flat:
    """One flattened buffer: HF tensors of one dtype, packed back to back in order (sent as bytes)."""

    dtype: torch.dtype
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numels(self) -> list[int]:
        return [int(torch.Size(s).numel()) for s in self.shapes]

    @property
    def nbytes(self) -> int:
        return sum(self.numels) * self.dtype.itemsize

    def views(self, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) views into ``buf`` (bytes, or a tensor of ``dtype``) of this layout."""
        typed = buf.view(self.dtype) if buf.dtype != self.dtype else buf
        out, at = [], 0
        for name, shape, n in zip(self.names, self.shapes, self.numels):
            out.append((name, typed[at : at + n].view(shape)))
            at += n
        return out


@dataclass(frozen=True)
class Piece:
    """One main-replica shard of a Megatron key: where it sits in the global tensor and in its source buffer."""

    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    at: int = 0  # byte offset in the source rank's buffer for the bucket


@dataclass
class Bucket:
    """Table rows assembled and sent together, their flats, and who sends the sender which shards."""

    rows: list[ParamMap]
    flats: list[Flat]
    key_dtype: dict[str, torch.dtype]  # Megatron key -> its dtype
    sources: dict[int, list[Piece]] = field(default_factory=dict)  # rank (not the sender) -> its pieces, in order

    def source_bytes(self, rank: int) -> int:
        """Size of the byte buffer ``rank`` sends for this bucket."""
        ps = self.sources.get(rank, [])
        return ps[-1].at + _aligned(nbytes(ps[-1].shape, self.key_dtype[ps[-1].key])) if ps else 0


@dataclass
class StagePlan:
    """One pipeline stage: its ranks, its sender and its buckets in send order."""

    stage: int
    sender: int  # global trainer rank that assembles and sends the stage's buckets
    ranks: list[int]
    buckets: list[Bucket]


@dataclass
class SyncPlan:
    """Identical on every trainer rank; the engines get each stage's buckets' flats (names, dtypes, shapes)."""

    stages: list[StagePlan]
    global_meta: dict[str, tuple[tuple[int, ...], torch.dtype]]  # key -> global shape, dtype
    signature: list[list[tuple]]  # per rank: its shards' metadata (checked at every push)

    def stage_of(self, rank: int) -> StagePlan:
        return next(s for s in self.stages if rank in s.ranks)

    def total_bytes(self) -> int:
        return sum(f.nbytes for s in self.stages for b in s.buckets for f in b.flats)


def flat_layout(flats: Sequence[Flat]) -> tuple[list[int], int]:
    """Byte offsets of a bucket's flats in one buffer (16-byte aligned, so each is viewed with its dtype), and
    the buffer's size."""
    offsets, at = [], 0
    for f in flats:
        offsets.append(at)
        at += _aligned(f.nbytes)
    return offsets, at


# ---------------------------------------------------------------------------------------------- local shards
def _main_replica(replica_id) -> bool:
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


def local_shards(chunks: Sequence[torch.nn.Module]) -> dict[str, list[tuple[tuple, tuple, torch.Tensor]]]:
    """key -> [(global shape, global offset, local data)] of this rank's main replicas, from megatron's
    ``sharded_state_dict`` of the (DDP-wrapped or bare) model chunks."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values  # heavy: megatron
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories  # heavy: megatron

    sd = _drop_extra_state(model_sharded_state_dict([getattr(c, "module", c) for c in chunks]))
    apply_factories(sd)
    out: dict[str, list] = {}
    for x in nested_values(sd):
        if isinstance(x, ShardedTensor) and _main_replica(x.replica_id):
            out.setdefault(x.key, []).append((tuple(x.global_shape), tuple(x.global_offset), x.data.detach()))
    return out


def shard_signature(local: dict[str, list]) -> list[tuple]:
    """This rank's shards as plain metadata: (key, global shape, global offset, local shape, dtype name)."""
    return sorted(
        (k, gs, off, tuple(d.shape), str(d.dtype).removeprefix("torch.")) for k, v in local.items() for gs, off, d in v
    )


def _pipeline_stage() -> int:
    from megatron.core import parallel_state as ps  # heavy: megatron

    return ps.get_pipeline_model_parallel_rank() if ps.model_parallel_is_initialized() else 0


# ---------------------------------------------------------------------------------------------- the plan
def build_plan(
    chunks: Sequence[torch.nn.Module], table: Sequence[ParamMap], bucket_bytes: int, transform: Transform = plain_hf
) -> SyncPlan:
    """The plan of this run (collective over the trainer's ranks: exchanges shard metadata, never weights)."""
    mine = (_pipeline_stage(), shard_signature(local_shards(chunks)))
    world = dist.get_world_size() if dist.is_initialized() else 1
    every: list = [None] * world
    if world > 1:
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    global_meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    pieces: dict[str, list[tuple[int, Piece]]] = {}
    for rank, (_, sig) in enumerate(every):
        for key, gshape, off, shape, dtype in sig:
            global_meta[key] = (tuple(gshape), getattr(torch, dtype))
            pieces.setdefault(key, []).append((rank, Piece(key, tuple(off), tuple(shape))))
    missing = [r.mcore for r in table if r.mcore not in global_meta]
    if missing:
        raise KeyError(f"weight sync: the model has no shards for table keys {missing[:4]}")
    stage_of_rank = [st for st, _ in every]
    stages = []
    for st in sorted(set(stage_of_rank)):
        ranks = [r for r in range(world) if stage_of_rank[r] == st]
        rows = stage_rows(table, pieces, stage_of_rank, st)
        stages.append(
            StagePlan(st, ranks[0], ranks, _buckets(rows, global_meta, pieces, ranks[0], bucket_bytes, transform))
        )
    return SyncPlan(stages, global_meta, [sig for _, sig in every])


def stage_rows(
    table: Sequence[ParamMap], pieces: dict[str, list[tuple[int, Piece]]], stage_of_rank: list[int], stage: int
) -> list[ParamMap]:
    """The table rows whose main-replica shards lie on pipeline ``stage``. In megatron-core every parameter lives on
    one stage (the last stage's copy of tied embeddings is a replica, not a main shard), so a key whose main shards
    span stages means the sharded-state-dict metadata is inconsistent: refused, naming the key and the stages."""
    rows = []
    for row in table:
        stages = sorted({stage_of_rank[rank] for rank, _ in pieces[row.mcore]})
        if len(stages) > 1:
            raise RuntimeError(
                f"weight sync: megatron's sharded state dict gives main-replica shards of {row.mcore} "
                f"on pipeline stages {stages}; every parameter must live on one stage (a model whose "
                "sharded_state_dict marks a cross-stage copy with replica_id 0 breaks this)"
            )
        if stages[0] == stage:
            rows.append(row)
    return rows


def _is_expert(key: str) -> bool:
    return ".experts." in key


def _outputs(row: ParamMap, meta: dict, transform: Transform) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    shape, dtype = meta[row.mcore]
    return [(n, t.dtype, tuple(t.shape)) for n, t in transform(row, torch.empty(shape, dtype=dtype, device="meta"))]


def _buckets(
    rows: list[ParamMap], meta: dict, pieces: dict, sender: int, bucket_bytes: int, transform: Transform
) -> list[Bucket]:
    """A stage's rows (non-experts first) cut into buckets of at most ``bucket_bytes`` of HF tensors (a larger
    row gets its own bucket), each with its per-dtype flats and its source pieces."""
    ordered = [r for r in rows if not _is_expert(r.mcore)] + [r for r in rows if _is_expert(r.mcore)]
    groups: list[list[tuple[ParamMap, list]]] = [[]]
    size = 0
    for r in ordered:
        outs = _outputs(r, meta, transform)
        n = sum(nbytes(s, d) for _, d, s in outs)
        if groups[-1] and size + n > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append((r, outs))
        size += n
    return [_bucket(g, meta, pieces, sender) for g in groups if g]


def _bucket(group: list[tuple[ParamMap, list]], meta: dict, pieces: dict, sender: int) -> Bucket:
    by_dtype: dict[torch.dtype, list[tuple[str, tuple]]] = {}
    for _, outs in group:
        for name, dtype, shape in outs:
            by_dtype.setdefault(dtype, []).append((name, shape))
    flats = [Flat(d, tuple(n for n, _ in items), tuple(s for _, s in items)) for d, items in by_dtype.items()]
    bucket = Bucket([r for r, _ in group], flats, key_dtype={r.mcore: meta[r.mcore][1] for r, _ in group})
    at: dict[int, int] = {}
    for r, _ in group:
        for rank, p in pieces[r.mcore]:
            if rank == sender:
                continue
            pos = at.get(rank, 0)
            bucket.sources.setdefault(rank, []).append(Piece(p.key, p.offset, p.shape, pos))
            at[rank] = pos + _aligned(nbytes(p.shape, meta[r.mcore][1]))
    return bucket
