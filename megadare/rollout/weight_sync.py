"""Weight sync: the trainer's TP/PP/EP/VPP shards -> full HF-named tensors -> size-bounded buckets -> engines.

Each RL step:

    pause engines -> for each bucket: gather shards -> map to HF names -> engine.update_weights(bucket, version)
                  -> resume engines

* Which slice of which global tensor a rank holds comes from megatron's own ``sharded_state_dict`` (the same
  layout-independent keys the checkpoint converter writes), so every layout is handled by one code path.
* Keys go in the family's mapping-table order, non-expert tensors first, then experts; a bucket closes when it
  reaches ``bucket_bytes`` (global size), so an expert batch is bounded by the bucket, not by the model.
* Global tensors are assembled on one rank (``dst``, the rank that talks to the engines) from the main replica
  of every shard; they become HF tensors through the family table (``ParamMap.to_hf``: the converter's code).

This generic path moves shards as Python objects over torch.distributed (``gather_object``): correct for every
layout and backend, measured in benchmarks/rollout_throughput.py. Time, bytes and GB/s are returned per sync.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megadare.models.mapping import ParamMap
from megadare.convert.mcore_ckpt import _drop_extra_state, model_sharded_state_dict


def _main_replica(replica_id) -> bool:
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


def _local_shards(chunks: list[torch.nn.Module]) -> dict[str, list[tuple[tuple, tuple, torch.Tensor, torch.dtype]]]:
    """key -> [(global_shape, global_offset, local data)] of this rank's main replicas."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sd = _drop_extra_state(model_sharded_state_dict([getattr(c, "module", c) for c in chunks]))
    apply_factories(sd)
    out: dict[str, list] = {}
    for x in nested_values(sd):
        if isinstance(x, ShardedTensor) and _main_replica(x.replica_id):
            out.setdefault(x.key, []).append((tuple(x.global_shape), tuple(x.global_offset), x.data, x.data.dtype))
    return out


def _is_expert(key: str) -> bool:
    return ".experts." in key


def plan_buckets(table: Sequence[ParamMap], shapes: dict[str, tuple[tuple, torch.dtype]],
                 bucket_bytes: int) -> list[list[ParamMap]]:
    """Table rows grouped into buckets of at most ``bucket_bytes`` (a larger tensor gets its own bucket),
    non-expert rows first."""
    rows = [r for r in table if not _is_expert(r.mcore)] + [r for r in table if _is_expert(r.mcore)]
    buckets: list[list[ParamMap]] = [[]]
    size = 0
    for r in rows:
        shape, dtype = shapes[r.mcore]
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if buckets[-1] and size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(r)
        size += n
    return [b for b in buckets if b]


def _assemble(key: str, pieces: list[tuple]) -> torch.Tensor:
    shape, dtype = pieces[0][0], pieces[0][3]
    full = torch.empty(shape, dtype=dtype)
    covered = 0
    for _, offset, data, _ in pieces:
        idx = tuple(slice(o, o + n) for o, n in zip(offset, data.shape))
        full[idx] = data.to("cpu")
        covered += data.numel()
    if covered != full.numel():
        raise RuntimeError(f"weight sync: shards of {key} cover {covered} of {full.numel()} elements")
    return full


def hf_buckets(chunks: list[torch.nn.Module], table: Sequence[ParamMap], bucket_bytes: int = 512 << 20,
               dst: int = 0) -> Iterator[Optional[list[tuple[str, torch.Tensor]]]]:
    """Collective generator: yields, bucket by bucket, HF-named full tensors on ``dst`` (None elsewhere)."""
    local = _local_shards(chunks)
    meta = {k: (v[0][0], v[0][3]) for k, v in local.items()}
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        metas: list[Any] = [None] * world
        dist.all_gather_object(metas, meta)
        for m in metas:
            meta.update(m)
    missing = [r.mcore for r in table if r.mcore not in meta]
    if missing:
        raise KeyError(f"weight sync: the model has no shards for table keys {missing[:4]}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    for bucket in plan_buckets(table, meta, bucket_bytes):
        mine = {r.mcore: [(s, o, d.detach().cpu(), t) for s, o, d, t in local.get(r.mcore, [])] for r in bucket}
        if world > 1:
            gathered: list[Any] = [None] * world if rank == dst else None
            dist.gather_object(mine, gathered, dst=dst)
        else:
            gathered = [mine]
        if rank != dst:
            yield None
            continue
        named: list[tuple[str, torch.Tensor]] = []
        for r in bucket:
            pieces = [p for g in gathered for p in g.get(r.mcore, [])]
            full = _assemble(r.mcore, pieces)
            named.extend(zip(r.hf, r.to_hf(full)))
        yield named


def sync_weights(chunks: list[torch.nn.Module], table: Sequence[ParamMap], engines: Sequence[Any], version: int,
                 bucket_bytes: int = 512 << 20, dst: int = 0,
                 fp8_block: Optional[tuple[int, int]] = None) -> dict[str, float]:
    """Push the trainer's current weights into every engine (collective over the trainer's ranks).

    ``engines`` (meaningful on ``dst``): objects with ``update_weights(named_tensors, version)`` and optional
    ``pause()`` / ``resume()``. ``fp8_block=(128, 128)`` sends the family's linear weights as float8_e4m3fn with
    one ``weight_scale_inv`` per block (megadare/convert/fp8.py), for SGLang engines started from a
    ``quantize_export(..., fmt="fp8-block")`` checkpoint. Returns bytes, seconds, GB/s and the number of buckets.
    """
    linear = None
    if fp8_block:
        from megadare.convert.fp8 import fp8_rollout_weights, linear_hf_names

        linear = linear_hf_names(table)
    rank = dist.get_rank() if dist.is_initialized() else 0
    t0 = time.perf_counter()
    if rank == dst:
        for e in engines:
            getattr(e, "pause", lambda: None)()
    nbytes, n_buckets = 0, 0
    for named in hf_buckets(chunks, table, bucket_bytes, dst):
        n_buckets += 1
        if named is None:
            continue
        if linear is not None:
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            named = list(fp8_rollout_weights(((n, t.to(dev)) for n, t in named), linear, block=fp8_block))
        nbytes += sum(t.numel() * t.element_size() for _, t in named)
        for e in engines:
            e.update_weights(named, version)
    if rank == dst:
        for e in engines:
            getattr(e, "resume", lambda: None)()
    dt = time.perf_counter() - t0
    return {"sync_bytes": float(nbytes), "sync_seconds": dt, "sync_gbps": nbytes / max(dt, 1e-9) / 1e9,
            "sync_buckets": float(n_buckets)}
