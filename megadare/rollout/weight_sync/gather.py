"""Per-stage gather of the trainer's shards into HF-named flattened buckets, with tensor collectives.

Every pipeline stage runs this at the same time, independently: the stage's other ranks send the shards of the
next bucket (one byte buffer per rank, point-to-point on the trainer's group; this is the TP gather and
the expert gather over the EP ranks of the stage), the stage's sender receives them and assembles the bucket's
global tensors straight into its flattened per-dtype buffers through the family table (``ParamMap.to_hf``, or the
plan's transform), then hands the buffers to the transport. Memory on the sender: the received pieces (the
bucket minus its own shards) plus the bucket's flats, in staging areas allocated once per push and reused bucket
after bucket (no page faults per bucket); other ranks hold one packed buffer of their own pieces.
(Receiving the next bucket's pieces while the current one is sent was slower on a 2-core CPU: not done.)
Nothing is pickled; the plan (plan.py) says who sends what.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megadare.rollout.weight_sync.plan import (
    Bucket,
    Flat,
    SyncPlan,
    Transform,
    flat_layout,
    local_shards,
    nbytes,
    plain_hf,
    shard_signature,
)

# nbytes -> a uint8 buffer for a bucket's flats (the colocated transport hands out shared memory)
Alloc = Callable[[int], torch.Tensor]


def _empty(n: int, device: torch.device) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, device=device)


def current_shards(chunks, plan: SyncPlan, rank: int) -> dict[str, list[tuple[tuple, torch.Tensor]]]:
    """This rank's main-replica shards now (key -> [(global offset, data)]), checked against the plan."""
    local = local_shards(chunks)
    if shard_signature(local) != plan.signature[rank]:
        raise RuntimeError(
            "weight sync: this rank's shards no longer match the sync plan (the model was rebuilt or "
            "re-sharded); build a new WeightSync"
        )
    return {k: [(off, d) for _, off, d in v] for k, v in local.items()}


def _pack(bucket: Bucket, rank: int, mine: dict, area: torch.Tensor) -> torch.Tensor:
    """This rank's pieces of ``bucket`` packed into the front of ``area`` (the plan's byte layout)."""
    buf = area[: bucket.source_bytes(rank)]
    for p in bucket.sources[rank]:
        data = next(d for off, d in mine[p.key] if off == p.offset)
        n = data.numel() * data.element_size()
        buf[p.at : p.at + n].view(data.dtype).view(data.shape).copy_(data)
    return buf


def _received_pieces(bucket: Bucket, bufs: dict[int, torch.Tensor]) -> dict[str, list[tuple[tuple, torch.Tensor]]]:
    out: dict[str, list] = {}
    for rank, ps in bucket.sources.items():
        for p in ps:
            dtype = bucket.key_dtype[p.key]
            n = nbytes(p.shape, dtype)
            out.setdefault(p.key, []).append((p.offset, bufs[rank][p.at : p.at + n].view(dtype).view(p.shape)))
    return out


def _fill(dest: torch.Tensor, key: str, pieces: list[tuple[tuple, torch.Tensor]], full_shape: tuple) -> None:
    """Write the shards into ``dest`` (the global tensor, or its first rows when ``dest`` drops vocab padding)."""
    covered = 0
    for offset, data in pieces:
        covered += data.numel()
        lo, n = offset[0], data.shape[0]
        hi = min(lo + n, dest.shape[0])
        if hi <= lo:
            continue
        idx = (slice(lo, hi),) + tuple(slice(o, o + s) for o, s in zip(offset[1:], data.shape[1:]))
        dest[idx] = data[: hi - lo]
    if covered != int(torch.Size(full_shape).numel()):
        raise RuntimeError(
            f"weight sync: shards of {key} cover {covered} of {torch.Size(full_shape).numel()} "
            f"elements (offsets {[off for off, _ in pieces]})"
        )


def _assemble(bucket: Bucket, flats: list[torch.Tensor], pieces: dict, plan: SyncPlan, transform: Transform) -> None:
    """Each row of the bucket -> its HF tensors, written into their slots of the flats."""
    slot = {name: view for f, buf in zip(bucket.flats, flats) for name, view in f.views(buf)}
    for row in bucket.rows:
        shape, dtype = plan.global_meta[row.mcore]
        if transform is plain_hf and row.op in ("copy", "vocab"):  # straight into the flat: no temporary
            _fill(slot[row.hf[0]], row.mcore, pieces[row.mcore], shape)
            continue
        full = torch.empty(shape, dtype=dtype, device=flats[0].device)
        _fill(full, row.mcore, pieces[row.mcore], shape)
        for name, t in transform(row, full):
            slot[name].copy_(t)
        del full


def stage_buckets(
    chunks,
    plan: SyncPlan,
    transform: Transform = plain_hf,
    alloc: Optional[Alloc] = None,
    device: Optional[torch.device] = None,
) -> Iterator[tuple[int, Bucket, list[torch.Tensor]]]:
    """Collective over the trainer's ranks. On each stage's sender yields ``(bucket index, bucket, flats)`` (flats:
    uint8 buffers laid out as ``bucket.flats``, in a staging area the next bucket overwrites: send them before
    asking for it); yields nothing on the other ranks, which send their pieces to their stage's sender."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    stage = plan.stage_of(rank)
    mine = current_shards(chunks, plan, rank)
    dev = device or next((d.device for v in mine.values() for _, d in v), torch.device("cpu"))
    if rank != stage.sender:
        area = _empty(max(b.source_bytes(rank) for b in stage.buckets), dev)  # reused bucket after bucket
        for i, bucket in enumerate(stage.buckets):
            if rank in bucket.sources:
                dist.send(_pack(bucket, rank, mine, area), dst=stage.sender, tag=i)
        return
    # one staging area per source and one for the flats, reused bucket after bucket (allocated once per push)
    areas = {
        r: _empty(max(b.source_bytes(r) for b in stage.buckets), dev)
        for r in {r for b in stage.buckets for r in b.sources}
    }
    flat_area = None if alloc else _empty(max(flat_layout(b.flats)[1] for b in stage.buckets), dev)
    for i, bucket in enumerate(stage.buckets):
        bufs = {r: areas[r][: bucket.source_bytes(r)] for r in bucket.sources}
        for w in [dist.irecv(b, src=r, tag=i) for r, b in bufs.items()]:
            w.wait()
        pieces = _received_pieces(bucket, bufs)
        for key, v in mine.items():
            if key in bucket.key_dtype:
                pieces.setdefault(key, []).extend(v)
        flats = _flat_buffers(bucket.flats, alloc or (lambda n: flat_area[:n]))
        _assemble(bucket, flats, pieces, plan, transform)
        del bufs, pieces
        yield i, bucket, flats


def _flat_buffers(flats: list[Flat], alloc: Alloc) -> list[torch.Tensor]:
    """One allocation for the bucket, cut into its flats (``flat_layout``)."""
    offsets, total = flat_layout(flats)
    whole = alloc(total)
    return [whole[at : at + f.nbytes] for f, at in zip(flats, offsets)]
