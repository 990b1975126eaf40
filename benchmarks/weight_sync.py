"""Weight sync of a generated >= 1 GB model from 4 gloo trainer ranks into 2 built-in engine actors (local Ray).

    python benchmarks/weight_sync.py                      # dense TP2xPP2, then MoE EP2xPP2
    python benchmarks/weight_sync.py --cases dense --bucket-mb 128
    python benchmarks/weight_sync.py --small --bucket-mb 4  # a small model: a quick check that every path runs

Per case and per path: seconds for one push (the second of two, so the new path's one-time plan and group set-up
are not counted; the old path has none), GB/s of HF bytes, and the peak RSS above its pre-push baseline of every
trainer rank and each engine (a sampler thread in each process; every process runs with
``MALLOC_MMAP_THRESHOLD_=65536``, so a freed buffer leaves the RSS and the first push cannot hide the second's
peak in a warm heap). Paths:

* ``old``: the path before issue 13, kept here only as the baseline: every rank pickles its shards of a bucket to
  rank 0 (``gather_object``), rank 0 assembles the bucket, ``ray.put``s it and every engine pulls it; the refs of
  all buckets are kept (the old replay store).
* ``object_store``: the new fallback without a group (per-stage tensor gather, rank 0 forwards one bucket at a time
  through Ray's store, nothing retained).
* ``distributed``: the new path: every pipeline stage gathers with tensor collectives and its sender broadcasts
  each flattened bucket over its gloo group to both engines, stages at once.
* ``colocated``: the new path over shared memory (what ``auto`` picks on a one-host CPU run).
* ``raw broadcast``: the same number of bytes broadcast from trainer rank 0 over its stage-0 group to the engines
  in bucket-sized pieces, with no gathering or mapping: this machine's limit for that group.

The last line: ``weight sync: new <s> s vs old <s> s (<x>x); <e>% of raw broadcast; peak extra RSS on any trainer
rank <y> x bucket`` (new = distributed; over the cases: the smallest speed-up, the smallest share of the raw
broadcast and the largest RSS ratio).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
EOS = 4094  # inside every vocabulary here
CASES = {
    # ~1.3 GB fp32: 4 layers of a 2048-wide SDAR, untied 32k vocabulary
    "dense": (
        "sdar",
        {"pp": 2, "tp": 2},
        dict(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=4,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=False,
            mask_token_id=31999,
        ),
    ),
    # ~1.2 GB fp32: 4 MoE layers of 16 experts
    "moe": (
        "sdar_moe",
        {"pp": 2, "ep": 2},
        dict(
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=2816,
            moe_intermediate_size=1024,
            num_experts=16,
            num_experts_per_tok=2,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=128,
            tie_word_embeddings=False,
            mask_token_id=31999,
        ),
    ),
}


# ---------------------------------------------------------------------------------------------- RSS sampling
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak resident set size of this process above the baseline taken at ``start()`` (sampled every 2 ms)."""

    def __init__(self):
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    def start(self) -> None:
        gc.collect()
        self.base = self.peak = _rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        return self.peak - self.base


# ---------------------------------------------------------------------------------------------- engine actor side
def bench_engine(family: str, config: dict):
    """The built-in engine on a randomly initialised HF model of ``config`` (no checkpoint on disk), with an RSS
    probe and a receiver for the raw-broadcast measurement (names starting with ``__raw__`` are dropped)."""
    from megadare.models import get_family
    from megadare.rollout.native import NativeEngine

    fam = get_family(family)
    cfg = fam.tiny_config(**config)

    class BenchEngine(NativeEngine):
        probe = PeakRSS()

        def rss_start(self) -> None:
            self.probe.start()

        def rss_peak(self) -> int:
            return self.probe.stop()

        def update_weights(self, named, version):
            named = list(named)
            if named and named[0][0].startswith("__raw__"):
                return {}
            return super().update_weights(named, version)

    torch.manual_seed(1)
    return BenchEngine(fam.hf_model(cfg), fam.arch(cfg), eos_token_id=EOS, device="cpu")


# ---------------------------------------------------------------------------------------------- the old path
def legacy_push(chunks, table, manager, version: int, bucket_bytes: int, keep: list) -> None:
    """The pre-issue-13 sync: pickled shards gathered to rank 0 per bucket, assembled there, ``ray.put`` and pulled
    by every engine, every bucket's ref kept (the old replay store)."""
    import ray
    import torch.distributed as dist

    from megadare.rollout.weight_sync.plan import local_shards

    keep.clear()  # the old manager kept the latest push's buckets
    local = local_shards(chunks)
    meta = {k: (v[0][0], v[0][2].dtype) for k, v in local.items()}
    metas: list = [None] * dist.get_world_size()
    dist.all_gather_object(metas, meta)
    for m in metas:
        meta.update(m)
    rank = dist.get_rank()
    for bucket in _legacy_buckets(table, meta, bucket_bytes):
        mine = {r.mcore: [(off, d.detach().cpu()) for _, off, d in local.get(r.mcore, [])] for r in bucket}
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if rank != 0:
            continue
        named = []
        for r in bucket:
            shape, dtype = meta[r.mcore]
            full = torch.empty(shape, dtype=dtype)
            for g in gathered:
                for off, d in g.get(r.mcore, []):
                    full[tuple(slice(o, o + n) for o, n in zip(off, d.shape))] = d
            named.extend(zip(r.hf, r.to_hf(full)))
        ref = ray.put(named)
        keep.append(ref)
        ray.get([a.call.remote("update_weights", ref, version) for a in manager.actors])


def _legacy_buckets(table, meta, bucket_bytes):
    rows = [r for r in table if ".experts." not in r.mcore] + [r for r in table if ".experts." in r.mcore]
    out, size = [[]], 0
    for r in rows:
        shape, dtype = meta[r.mcore]
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if out[-1] and size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(r)
        size += n
    return out


# ---------------------------------------------------------------------------------------------- trainer ranks
def _measured(push, manager, rank: int) -> dict:
    """Second of two pushes: seconds and every process's peak RSS above its baseline."""
    import torch.distributed as dist

    push(1)
    probe = PeakRSS()
    dist.barrier()
    if rank == 0:
        manager.call_all("rss_start")
    probe.start()
    dist.barrier()
    t0 = time.perf_counter()
    push(2)
    dist.barrier()
    dt = time.perf_counter() - t0
    mine = probe.stop()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"s": dt, "trainer_rss": every, "engine_rss": manager.call_all("rss_peak") if rank == 0 else None}


def _raw_broadcast(sync, manager, rank: int, nbytes: int, bucket_bytes: int) -> float:
    """Seconds to broadcast ``nbytes`` from rank 0 over its stage-0 group to the engines, bucket by bucket."""
    import torch.distributed as dist

    from megadare.rollout.weight_sync.groups import broadcast_from_sender
    from megadare.rollout.weight_sync.plan import Flat

    sizes = [min(bucket_bytes, nbytes - at) for at in range(0, nbytes, bucket_bytes)]
    dist.barrier()
    t0 = time.perf_counter()
    if rank == 0:
        plan = [
            (sync.transport.names[0], [[Flat(torch.uint8, (f"__raw__{i}",), ((n,),))] for i, n in enumerate(sizes)])
        ]
        for name in sync.transport.names[1:]:
            plan.append((name, []))
        refs = manager.start_receive("broadcast", plan, 0)
        buf = torch.ones(bucket_bytes, dtype=torch.uint8)
        for n in sizes:
            broadcast_from_sender(buf[:n], sync.transport.pg)
        manager.wait(refs)
    dist.barrier()
    return time.perf_counter() - t0


def _case_worker(rank, world, family, layout, config, bucket_mb, paths):
    import ray

    from megadare.convert.hf_megatron import mapping_for
    from megadare.models import get_family
    from megadare.models.gpt import build_model_chunks, transformer_config
    from megadare.parallel import Layout, destroy_distributed, init_distributed
    from megadare.rollout.manager import EngineSpec, RolloutManager
    from megadare.rollout.weight_sync.sync import SyncSettings, WeightSync

    import weight_sync as bench  # this file, importable by name in the engine actors too

    init_distributed(Layout(**layout))
    fam = get_family(family)
    cfg = fam.tiny_config(**config)
    arch = fam.arch(cfg)
    torch.manual_seed(0)
    chunks = build_model_chunks(arch, transformer_config(arch), attention_backend="sdpa")
    table = mapping_for(cfg)[2]
    bucket = bucket_mb << 20
    manager = None
    if rank == 0:
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        manager = RolloutManager(EngineSpec(bench.bench_engine, {"family": family, "config": config}), num_engines=2)
    out = {"bucket": bucket}
    try:
        if "old" in paths:
            keep: list = []
            out["old"] = _measured(lambda v: legacy_push(chunks, table, manager, v, bucket, keep), manager, rank)
            out["old"]["retained"] = len(keep)
            del keep[:]
        for name in [p for p in ("object_store", "colocated", "distributed") if p in paths]:
            sync = WeightSync(chunks, table, manager, SyncSettings(transport=name, bucket_bytes=bucket))
            out[name] = _measured(sync.push, manager, rank)
            out["nbytes"] = sync.plan.total_bytes()
            out["buckets"] = sum(len(s.buckets) for s in sync.plan.stages)
            if name == "distributed":
                out["raw_s"] = _raw_broadcast(sync, manager, rank, out["nbytes"], bucket)
            sync.close()
        return out
    finally:
        if manager is not None:
            manager.shutdown()
        destroy_distributed()


# ---------------------------------------------------------------------------------------------- report
def _report(case: str, r: dict) -> dict:
    gb, bucket = r["nbytes"] / 1e9, r["bucket"]
    print(f"[{case}] {gb:.2f} GB of HF tensors, {r['buckets']} buckets of <= {bucket >> 20} MiB")
    for name in ("old", "object_store", "colocated", "distributed"):
        if name not in r:
            continue
        p = r[name]
        trainer = " ".join(f"{x / 2**20:.0f}" for x in p["trainer_rss"])
        engines = " ".join(f"{x / 2**20:.0f}" for x in p["engine_rss"])
        extra = f"; {p['retained']} buckets retained in Ray's store" if "retained" in p else ""
        print(
            f"  {name:13s} {p['s']:7.2f} s  {gb / p['s']:6.3f} GB/s  peak extra RSS MiB: trainer ranks "
            f"[{trainer}] engines [{engines}] (max trainer {max(p['trainer_rss']) / bucket:.2f} x bucket){extra}"
        )
    out = {}
    if "raw_s" in r:
        print(f"  raw broadcast {r['raw_s']:7.2f} s  {gb / r['raw_s']:6.3f} GB/s  (rank 0 -> 2 engines, same group)")
        new = r["distributed"]
        out = {"new": new["s"], "e": 100 * r["raw_s"] / new["s"], "y": max(new["trainer_rss"]) / bucket}
        if "old" in r:
            out.update(old=r["old"]["s"], x=r["old"]["s"] / new["s"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="dense,moe")
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--paths", default="old,object_store,colocated,distributed")
    ap.add_argument("--small", action="store_true", help="a 512-wide, 2-layer version of each shape (smoke run)")
    args = ap.parse_args()
    import ray

    sys.path.insert(0, BENCH_DIR)
    import weight_sync as bench

    from megadare.parallel.launch import spawn

    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # spawned trainer ranks and the engine actors inherit it
    with open("/proc/loadavg") as f:
        print(f"load average at start: {' '.join(f.read().split()[:3])}; CPU, gloo; no GPU in this run")
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([REPO, BENCH_DIR]), "MALLOC_MMAP_THRESHOLD_": "65536"}},
    )
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    summary = []
    try:
        for case in args.cases.split(","):
            family, layout, config = CASES[case]
            if args.small:
                config = {
                    **config,
                    "hidden_size": 512,
                    "num_hidden_layers": 2,
                    "vocab_size": 4096,
                    "mask_token_id": 4095,
                }
            r = spawn(
                bench._case_worker, 4, family, layout, config, args.bucket_mb, args.paths.split(","), timeout_s=1800
            )[0]
            summary.append(_report(f"{case} {family} {layout}", r))
    finally:
        ray.shutdown()
    with open("/proc/loadavg") as f:
        print(f"load average at end: {' '.join(f.read().split()[:3])}")
    full = [s for s in summary if "x" in s]
    if full:
        worst = min(full, key=lambda s: s["x"])
        print(
            f"weight sync: new {worst['new']:.2f} s vs old {worst['old']:.2f} s ({worst['x']:.1f}x); "
            f"{min(s['e'] for s in full):.0f}% of raw broadcast; peak extra RSS on any trainer rank "
            f"{max(s['y'] for s in full):.2f} x bucket"
        )


if __name__ == "__main__":
    main()
