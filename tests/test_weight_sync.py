"""Weight sync from a sharded Megatron trainer (2 gloo ranks) into 2 built-in engine actors on a local Ray cluster.

One launch serves every case (the model-parallel groups are rebuilt between layouts): for TP2+SP, PP2, PP2+VPP2,
EP2 SDAR-MoE and EP2 LLaDA2, after a training step changed the weights, a push over the ``distributed`` transport
(a gloo group per pipeline-stage sender and both engines) leaves both engines with the trainer's logits. On the
TP2+SP trainer also: the ``colocated`` (shared memory) and ``object_store`` transports, an engine killed between
steps (it comes back with the current version; Ray's object store holds nothing after a push), an engine killed
before a rollout (its chunks go to the engine that holds the current weights), every engine restarted during a
rollout (the rollout waits for a push of the current weights, which both ranks join), and block-fp8 weights.
"""

from __future__ import annotations

import os
import re
import time
from types import SimpleNamespace

import pytest
import torch

ray = pytest.importorskip("ray")

from dist import (  # noqa: E402
    outcomes_differ_on_a_job_stop,
    push_refused_on_every_rank,
    relayout,
    run_distributed,
    stale_push_failing,
    stale_push_interrupted,
    stepped_trainer,
)
from ray_fixture import ray_cluster  # noqa: E402,F401  (module-scoped local Ray cluster)
from tiny import write_tiny_hf  # noqa: E402
from megadare.models.mapping import ParamMap  # noqa: E402
from megadare.rollout.engine import SamplingParams  # noqa: E402
from megadare.rollout.weight_sync.plan import Flat, _buckets, flat_layout  # noqa: E402

SEQ, EOS = 12, 253
LAYOUTS = [
    ("sdar-tp2sp", "sdar", {"tp": 2, "sp": True}),
    ("sdar-pp2", "sdar", {"pp": 2}),
    ("sdar-pp2vpp2", "sdar", {"pp": 2, "vpp": 2}),
    ("sdar_moe-ep2", "sdar_moe", {"ep": 2}),
    ("llada2-ep2", "llada2", {"ep": 2}),
]
PARAMS = SamplingParams(max_new_tokens=4, block_size=4, steps_per_block=4, temperature=1.0, seed=3, stop_at_eos=False)
PROMPTS = [[(5 * i + j) % 200 + 1 for j in range(3 + i % 4)] for i in range(6)]
BUCKET = 64 << 10


def plasma_objects(settle_s: float = 0.0) -> int:
    """Objects in Ray's shared-memory object store (what a retained weight bucket would occupy). Ray frees released
    objects asynchronously: with ``settle_s`` wait up to that long for the count to reach 0 (a retained object
    never goes)."""
    import time

    from ray._private.internal_api import memory_summary

    deadline = time.monotonic() + settle_s
    while True:
        text = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
        n = int(re.search(r"Plasma memory usage \d+ MiB, (\d+) objects", text).group(1))
        if n == 0 or time.monotonic() >= deadline:
            return n
        time.sleep(0.2)


def _kill(actor, timeout_s: float = 60.0) -> None:
    """ray.kill is asynchronous: wait until the actor answers as dead, so 'dies between steps' is what happens."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    ray.kill(actor)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.info.remote(), timeout=10)
        except RayActorError:
            return
        except GetTimeoutError:
            continue
        time.sleep(0.2)
    raise AssertionError(f"actor still answers {timeout_s:.0f} s after ray.kill")


def _perturb(chunks, seed: int) -> None:
    """The same noise sequence on every rank: replicated parameters stay identical across ranks."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)


class _Recorder:
    def __init__(self):
        self.named: dict[str, torch.Tensor] = {}

    def update_weights(self, named, version):
        self.named.update({n: t.clone() for n, t in named})


def _layout_case(rank, family, layout, lr, hfs, ids, manager, version, extras):
    from megadare.convert.hf_megatron import mapping_for
    from megadare.models.attention import family_mask
    from megadare.rollout.weight_sync.sync import SyncSettings, WeightSync
    from megadare.trainer.forward import forward_logits

    relayout(layout)
    chunks, model, arch, cfg = stepped_trainer(layout, hfs[0], n_rows=4, lr=lr)
    table = mapping_for(cfg)[2]

    def logits():
        return forward_logits(chunks, ids, arch.vocab_size, family_mask(arch))

    def engines():
        return manager.call_all("logits", ids) if rank == 0 else None

    out = {"before": engines()}
    sync = WeightSync(
        model, table, manager if rank == 0 else None, SyncSettings(transport="distributed", bucket_bytes=BUCKET)
    )
    health = manager.call_all("health") if rank == 0 else None
    out.update(
        stats=sync.push(version),
        trainer=logits(),
        engines=engines(),
        versions=[h["version"] for h in manager.call_all("health")] if rank == 0 else None,
        devices=[h["device"] for h in health] if rank == 0 else None,
    )
    if extras:
        out.update(_extras(rank, chunks, model, table, manager, sync, logits, engines))
    sync.close()
    return out


def _extras(rank, chunks, model, table, manager, sync, logits, engines):
    from megadare.parallel.rank0 import run_on_rank0
    from megadare.rollout.weight_sync.sync import SyncSettings, WeightSync, sync_weights

    out = {}
    r0 = rank == 0
    for version, transport in ((2, "colocated"), (3, "object_store")):
        _perturb(chunks, version)
        other = WeightSync(
            model, table, manager if r0 else None, SyncSettings(transport=transport, bucket_bytes=256 << 10)
        )
        other.push(version)
        other.close()
        out[transport] = {"trainer": logits(), "engines": engines(), "plasma": plasma_objects(10) if r0 else None}
    if r0:  # the probe sees an object that is held
        ref = ray.put(torch.zeros(1 << 20, dtype=torch.uint8))
        out["probe_held"] = plasma_objects()
        del ref
        _kill(manager.actors[1])  # dies between steps
    _perturb(chunks, 4)
    sync.push(4)  # replaces it, rebuilds the groups, reaches it
    out["restarted"] = {
        "trainer": logits(),
        "engines": engines(),
        "plasma": plasma_objects(10) if r0 else None,
        "versions": [h["version"] for h in manager.call_all("health")] if r0 else None,
        "restarts": manager.restarts if r0 else None,
    }
    if r0:
        ray.kill(manager.actors[0])  # dies before the rollout
        trajs = manager.generate(PROMPTS, PARAMS)
        out["one_dead"] = {"versions": [t.policy_version for t in trajs], "fresh": list(manager.fresh), "n": len(trajs)}
        for a in manager.actors:  # the engine that served is killed too: no engine holds v4
            ray.kill(a)
    trajs = run_on_rank0(lambda: manager.generate(PROMPTS, PARAMS), lambda: sync.push(4), manager if r0 else None)
    out["all_dead"] = {
        "versions": [t.policy_version for t in trajs],
        "engines": engines(),
        "restarts": manager.restarts if r0 else None,
    }
    plain, fp8 = _Recorder(), _Recorder()
    sync_weights(
        model,
        table,
        [plain] if r0 else [],
        version=1,
        settings=SyncSettings(transport="object_store", bucket_bytes=BUCKET),
    )
    sync_weights(
        model,
        table,
        [fp8] if r0 else [],
        version=1,
        settings=SyncSettings(transport="object_store", bucket_bytes=BUCKET, fp8_block=(128, 128)),
    )
    out["fp8"] = _fp8_summary(plain.named, fp8.named) if r0 else None
    return out


def _fp8_summary(plain, fp8):
    """What arrived: fp8 tensors as their bytes and dequantized (fp8 storages do not cross processes)."""
    from fp8_reference import dequantize_fp8

    deq = {
        n[: -len("_scale_inv")]: dequantize_fp8(fp8[n[: -len("_scale_inv")]], t, block=(128, 128))
        for n, t in fp8.items()
        if n.endswith("weight_scale_inv")
    }
    return {
        "plain": plain,
        "deq": deq,
        "dtypes": {n: str(t.dtype) for n, t in fp8.items()},
        "fp8": {n: (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t) for n, t in fp8.items()},
    }


def _worker(rank, world, hf, ids):
    from megadare.parallel import destroy_distributed
    from megadare.rollout.manager import EngineSpec, RolloutManager, build_native_engine

    if rank == 0:
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    results, version = {}, 0
    try:
        for family in dict.fromkeys(f for _, f, _ in LAYOUTS):
            manager = None
            if rank == 0:
                manager = RolloutManager(
                    EngineSpec(build_native_engine, {"hf_dir": hf[family][1], "eos_token_id": EOS}), num_engines=2
                )
            for i, (case, fam, layout) in enumerate(LAYOUTS):
                if fam == family:
                    version += 1
                    results[case] = _layout_case(
                        rank, fam, layout, 1e-2 * (1 + i), hf[fam], ids, manager, version, extras=case == LAYOUTS[0][0]
                    )
            if manager is not None:
                manager.shutdown()
        return results
    finally:
        destroy_distributed()


@pytest.fixture(scope="module")
def synced(ray_cluster, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("weight_sync")
    hf = {
        fam: tuple(write_tiny_hf(tmp, fam, seed, num_hidden_layers=4, block_size=4) for seed in (0, 1))
        for fam in dict.fromkeys(f for _, f, _ in LAYOUTS)
    }
    ids = torch.randint(0, 250, (2, SEQ), generator=torch.Generator().manual_seed(5))
    outs = run_distributed(_worker, 2, hf, ids, timeout_s=900)
    merged = {}
    for case in outs[0]:
        merged[case] = dict(outs[0][case])
        merged[case]["trainer"] = next(o[case]["trainer"] for o in outs if o[case]["trainer"] is not None)
    return merged, outs


def _close(engines, trainer) -> None:
    assert len(engines) == 2
    for logits in engines:
        assert (logits - trainer).abs().max() < 1e-4


@pytest.mark.parametrize("case", [c for c, _, _ in LAYOUTS])
def test_engines_hold_the_trained_weights_after_a_distributed_push(synced, case):
    r = synced[0][case]
    v = [c for c, _, _ in LAYOUTS].index(case) + 1
    assert r["versions"] == [v, v]
    assert r["devices"] == ["cpu", "cpu"]  # rollout.device=auto in an actor Ray gave no GPU
    assert r["stats"]["sync_buckets"] > 2 and r["stats"]["sync_bytes"] > 0  # bucketed
    assert (r["before"][0] - r["trainer"]).abs().max() > 1e-2  # the engines really changed
    _close(r["engines"], r["trainer"])


def _last_stage(outs, key):
    return next(o["sdar-tp2sp"][key]["trainer"] for o in outs if o["sdar-tp2sp"][key]["trainer"] is not None)


@pytest.mark.parametrize("transport", ["colocated", "object_store"])
def test_colocated_and_object_store_transports(synced, transport):
    merged, outs = synced
    r = merged["sdar-tp2sp"][transport]
    trainer = _last_stage(outs, transport)
    assert (trainer - merged["sdar-tp2sp"]["trainer"]).abs().max() > 1e-3  # perturbed since the last push
    _close(r["engines"], trainer)
    assert r["plasma"] == 0  # no bucket left in Ray's store


def test_an_engine_killed_between_steps_gets_the_current_version(synced):
    merged, outs = synced
    r = merged["sdar-tp2sp"]
    assert r["probe_held"] >= 1  # the object-store probe does see a held object
    back = r["restarted"]
    assert back["restarts"] == 1 and back["versions"] == [4, 4] and back["plasma"] == 0
    _close(back["engines"], _last_stage(outs, "restarted"))


def test_rollouts_use_engines_that_hold_the_current_weights(synced):
    merged, outs = synced
    r = merged["sdar-tp2sp"]
    one = r["one_dead"]  # engine 0 died before the rollout: its replacement serves nothing yet
    assert one["n"] == len(PROMPTS) and one["versions"] == [4] * len(PROMPTS) and one["fresh"] == [False, True]
    every = r["all_dead"]  # no engine held v4: the rollout waited for a push of v4 that both ranks joined
    assert every["versions"] == [4] * len(PROMPTS) and every["restarts"] == 4
    assert outs[1]["sdar-tp2sp"]["all_dead"]["versions"] == every["versions"]
    _close(every["engines"], _last_stage(outs, "restarted"))


def test_fp8_rollout_weights_through_sync(synced):
    """fp8_block=(128, 128) from the TP2 trainer: every linear weight arrives as float8_e4m3fn with a
    weight_scale_inv per 128x128 block, its dequantization is the plain push's tensor within fp8 precision (e4m3:
    3 mantissa bits, relative error <= 1/16), and every other tensor arrives unchanged."""
    out = synced[0]["sdar-tp2sp"]["fp8"]
    plain, fp8, deq = out["plain"], out["fp8"], out["deq"]
    scales = [n for n in fp8 if n.endswith("weight_scale_inv")]
    assert len(scales) >= 4 * 7 and set(fp8) == set(plain) | set(scales)  # 4 layers x (q, k, v, o, gate, up, down)
    for w, d in deq.items():
        assert out["dtypes"][w] == "torch.float8_e4m3fn"
        ref = plain[w].float()
        assert ((d - ref).abs() <= torch.maximum(ref.abs() / 16, torch.full_like(ref, 1e-3))).all(), w
    for n in set(plain) - set(deq):
        assert torch.equal(fp8[n], plain[n]), n


# ---------------------------------------------------------------------------------------------- the plan alone
def test_buckets_are_bounded_per_dtype_and_experts_come_last():
    from megadare.rollout.weight_sync.plan import Piece

    table = [ParamMap(f"decoder.layers.{i}.mlp.experts.experts.0.linear_fc2.weight", (f"e{i}",)) for i in range(3)]
    table += [ParamMap(f"decoder.layers.{i}.self_attention.linear_proj.weight", (f"a{i}",)) for i in range(3)]
    meta = {r.mcore: ((256, 256), torch.float32) for r in table}  # 256 KiB each
    meta[table[3].mcore] = ((256, 256), torch.bfloat16)
    pieces = {
        r.mcore: [(0, Piece(r.mcore, (0, 0), (256, 128))), (1, Piece(r.mcore, (0, 128), (256, 128)))] for r in table
    }
    buckets = _buckets(table, meta, pieces, sender=0, bucket_bytes=600 << 10, transform=lambda r, t: [(r.hf[0], t)])
    assert [[r.hf[0] for r in b.rows] for b in buckets] == [["a0", "a1"], ["a2", "e0"], ["e1", "e2"]]
    assert [[f.dtype for f in b.flats] for b in buckets][0] == [torch.bfloat16, torch.float32]  # one flat per dtype
    assert all(list(b.sources) == [1] for b in buckets)  # rank 1 sends its halves
    assert buckets[0].source_bytes(1) == (256 * 128 * 2) + (256 * 128 * 4)


def test_each_stage_takes_its_own_rows_and_a_key_spanning_stages_is_refused():
    """Ranks 0, 1 form stage 0, ranks 2, 3 stage 1: a key goes to the stage whose ranks hold its main shards; a key
    with main shards on both stages (inconsistent metadata: megatron keeps every parameter on one stage) is
    refused, naming the key and the stages."""
    from megadare.rollout.weight_sync.plan import Piece, stage_rows

    emb, head = ParamMap("embedding.word_embeddings.weight", ("e",)), ParamMap("output_layer.weight", ("h",))
    on = {emb.mcore: (0, 1), head.mcore: (2, 3)}
    pieces = {k: [(r, Piece(k, (i * 4, 0), (4, 8))) for i, r in enumerate(rs)] for k, rs in on.items()}
    stage_of_rank = [0, 0, 1, 1]
    assert stage_rows([emb, head], pieces, stage_of_rank, 0) == [emb]
    assert stage_rows([emb, head], pieces, stage_of_rank, 1) == [head]
    pieces[emb.mcore].append((3, Piece(emb.mcore, (8, 0), (4, 8))))
    with pytest.raises(RuntimeError, match=r"embedding\.word_embeddings\.weight on pipeline stages \[0, 1\]"):
        stage_rows([emb, head], pieces, stage_of_rank, 0)


def test_a_flat_is_sglangs_flattened_bucket_layout():
    """Tensors of one dtype back to back in list order (sglang FlattenedTensorBucket), each flat 16-byte aligned."""
    a, b = torch.arange(6.0).reshape(2, 3), torch.arange(5.0)
    f = Flat(torch.float32, ("a", "b"), ((2, 3), (5,)))
    buf = torch.cat([a.flatten(), b]).view(torch.uint8)
    assert f.nbytes == buf.numel() and [torch.equal(t, x) for (_, t), x in zip(f.views(buf), (a, b))] == [True, True]
    g = Flat(torch.bfloat16, ("c",), ((3,),))
    assert flat_layout([g, f]) == ([0, 16], 16 + 48)


def test_auto_transport_is_colocated_only_on_one_cpu_host():
    from types import SimpleNamespace

    from megadare.errors import ConfigError
    from megadare.rollout.weight_sync.sync import SyncSettings, WeightSync

    def engines(*ips):
        return SimpleNamespace(engine_info=lambda: [{"ip": ip, "gpu": None} for ip in ips])

    def resolve(transport, trainer_ips, engine_ips):
        ranks = [(ip, None) for ip in trainer_ips]
        return WeightSync([], [], engines(*engine_ips), SyncSettings(transport=transport))._resolve(ranks)

    assert resolve("auto", ["10.0.0.1"] * 4, ["10.0.0.1"] * 2) == "colocated"
    assert resolve("auto", ["10.0.0.1"] * 4, ["10.0.0.1", "10.0.0.2"]) == "distributed"
    assert (
        WeightSync([], [], [object()], SyncSettings(transport="auto"))._resolve(None) == "object_store"
    )  # in-process engines
    with pytest.raises(ConfigError, match="engines on .*10.0.0.2.*weight_transport=distributed"):
        resolve("colocated", ["10.0.0.1"], ["10.0.0.2"])


def test_auto_transport_on_gpus_never_puts_two_nccl_ranks_on_one_gpu():
    """Trainer on GPUs (issue 23): an engine on the trainer's own GPU gets CUDA IPC (colocated), never NCCL, which
    refuses two ranks of one group on one device; engines on GPUs of their own get NCCL (distributed)."""
    from types import SimpleNamespace

    from megadare.errors import ConfigError
    from megadare.rollout.weight_sync.sync import SyncSettings, WeightSync

    def resolve(transport, trainer_gpus, engine_gpus, ip2="h1"):
        manager = SimpleNamespace(engine_info=lambda: [{"ip": ip2, "gpu": g} for g in engine_gpus])
        sync = WeightSync([], [], manager, SyncSettings(transport=transport))
        sync.device = torch.device("cuda", 0)  # what a trainer on a GPU reports (no GPU needed to decide)
        return sync._resolve([("h1", g) for g in trainer_gpus])

    assert resolve("auto", ["GPU-a"], ["GPU-a"]) == "colocated"  # one GPU: trainer and engine share it
    assert resolve("auto", ["GPU-a"], ["GPU-a", "GPU-a"]) == "colocated"
    assert resolve("auto", ["GPU-a", "GPU-b"], ["GPU-c", "GPU-d"]) == "distributed"  # engines on GPUs of their own
    assert resolve("auto", ["GPU-a"], [None]) == "distributed"  # a CPU engine cannot map CUDA IPC
    assert resolve("auto", ["GPU-a"], ["GPU-c"], ip2="h2") == "distributed"
    # engines on GPU-a and GPU-b, the sender (rank 0) on GPU-a: NCCL clashes on GPU-a, and the engine on GPU-b
    # cannot map the sender's buffer on GPU-a
    assert resolve("auto", ["GPU-a", "GPU-b"], ["GPU-a", "GPU-b"]) == "object_store"
    with pytest.raises(ConfigError, match="NCCL refuses two ranks .*weight_transport=auto"):
        resolve("distributed", ["GPU-a"], ["GPU-a"])
    with pytest.raises(ConfigError, match="colocated on GPUs needs every engine on the GPU"):
        resolve("colocated", ["GPU-a"], ["GPU-c"])


def test_a_push_rank0_cannot_decide_fails_on_every_rank():
    """The Ray head gone (a SIGTERM to the whole job): rank 0's check of the engines raises in the push's header,
    which carries the error to every rank (rl's push_weights drops the push on all of them together, no broadcast
    of its own before it); the other ranks waited on the header until the collective timeout."""
    assert run_distributed(push_refused_on_every_rank, 2, timeout_s=120) == [
        f"rank {r}: the Ray head is gone (gcs_server at 127.0.0.1:6379)" for r in (0, 1)
    ]


def test_a_job_stop_on_one_rank_prevails_over_another_ranks_error():
    """Rank 1's part of a push broke before it noted the job's SIGTERM, rank 0's after: rank 1 raised its plain
    error and failed the run while rank 0 saved (on_every_rank raised each rank's own error first)."""
    assert run_distributed(outcomes_differ_on_a_job_stop, 2, timeout_s=120) == [
        f"rank {r}: LostToSigterm: the engines went down with the job" for r in (0, 1)
    ]


@pytest.mark.parametrize(
    "failing,swallow,raised",
    [
        ("every", False, ["broke on trainer rank 0", "broke on trainer rank 1"]),  # the header's (Ray head gone)
        ("rank0", False, ["broke on trainer rank 0"] * 2),
        ("others", False, ["broke on trainer rank 1"] * 2),  # a transfer that broke on rank 1 only
        ("others", True, ["broke on trainer rank 1"] * 2),  # the rollout caught it and asked again
    ],
)
def test_a_repeat_push_that_fails_inside_a_rollout_ends_it_on_every_rank(failing, swallow, raised):
    """Every engine restarted mid-rollout: rank 0 calls for a push inside ``run_on_rank0``. Should it raise on any
    rank, every rank raises (rl's ``unless_ray_lost`` then saves: collectives) and rank 0 tells nothing more: no
    stray 'error' or 'done' broadcast pairs with the next collective, none waits on one that never comes."""
    got = run_distributed(stale_push_failing, 2, failing, swallow, timeout_s=120)
    assert got == [(f"the weight push of version 3 {r}", "the next step's word") for r in raised]


def test_a_repeat_push_interrupted_on_one_rank_ends_the_rollout_on_every_rank():
    """A repeat push interrupted on rank 0 (KeyboardInterrupt, a BaseException) left ``on_every_rank`` and
    ``run_on_rank0`` past their shared outcome: rank 0 raised it alone while rank 1 waited for rank 0's part of the
    push's outcome until the collective timeout, and rank 0's next broadcast paired with nothing. Now every rank
    raises it and the next collective pairs as it should."""
    got = run_distributed(stale_push_interrupted, 2, timeout_s=120)
    assert got == [("KeyboardInterrupt", "the next step's word")] * 2


class _Call:
    """An actor method's ``.remote``: records the call, returns a stand-in ref."""

    def __init__(self, calls: list, name: str):
        self.calls, self.name = calls, name

    def remote(self, *args):
        self.calls.append(self.name)
        return f"{self.name} ref"


@pytest.mark.parametrize("transport", ["distributed", "object_store"])
def test_engines_a_push_broke_half_way_serve_nothing_until_a_whole_push(monkeypatch, transport):
    """A push that broke after some buckets reached the engines (their receive raised mid-way; object_store: the
    second bucket failed) left every engine counted as holding the last whole version, so a rollout asked next was
    served from half-pushed weights, stamped with either version. Now no engine is fresh from the push's start
    until ``synced``: the rollout waits for a whole push (``on_stale``), or fails naming the version."""
    import megadare.rollout.manager as manager_module
    from megadare.errors import PeerError
    from megadare.rollout.manager import RolloutManager

    calls: list = []
    manager = RolloutManager.__new__(RolloutManager)  # no Ray: only what a push and fresh_slots touch
    manager.actors = [SimpleNamespace(receive_weights=_Call(calls, "receive"), load_flats=_Call(calls, "load"))] * 2
    manager.version, manager.fresh, manager.on_stale = 3, [True, True], None
    flat = Flat(torch.float32, ("w",), ((4,),))
    if transport == "distributed":
        manager.start_receive("broadcast", [("megadare_w_s0", [[flat], [flat]])], 4)  # the push of v4 then broke
    else:
        monkeypatch.setattr(manager_module, "_ray", lambda: SimpleNamespace(put=lambda buf: buf))
        answers = iter([None, PeerError("rollout engine 1 raised while loading")])

        def gather(refs, what):  # the first bucket reaches both engines, the second breaks
            error = next(answers)
            if error is not None:
                raise error
            return [None] * len(refs)

        manager.gather = gather
        manager.load_flats([flat], [torch.zeros(16, dtype=torch.uint8)], 4)
        with pytest.raises(PeerError):
            manager.load_flats([flat], [torch.zeros(16, dtype=torch.uint8)], 4)
    assert calls and manager.version == 3
    with pytest.raises(RuntimeError, match="no rollout engine holds weight version 3"):
        manager.fresh_slots()
    manager.on_stale = lambda: manager.synced(4)  # the RL driver pushes the current weights again, whole
    assert manager.fresh_slots() == [0, 1] and manager.version == 4


def test_the_engines_check_raises_a_dead_ray_head_before_asking_the_engines():
    from types import SimpleNamespace

    from megadare.errors import PeerError
    from megadare.rollout.manager import RolloutManager

    def dead():
        raise PeerError("the Ray head died")

    manager = RolloutManager.__new__(RolloutManager)  # no Ray: only what check_engines reads
    manager.gcs = SimpleNamespace(check=dead)
    manager.engine_info = lambda: pytest.fail("the engines were asked through a dead Ray head")
    with pytest.raises(PeerError, match="the Ray head died"):
        manager.check_engines()


class _LostMember:
    """A weight group whose member left mid-push, as gloo reports it to the sender."""

    refs = ["receive 0", "receive 1"]  # each engine's receive_weights call

    def connect(self, header):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:5034: Connection reset by peer.")


class _OneDead:
    def dead_slots(self, refs):
        return [1] if refs == _LostMember.refs else []

    def peer(self, slot):
        return f"rollout engine {slot} on 10.0.0.3"


def test_an_engine_lost_mid_push_is_one_line_naming_it():
    """An engine killed during a push broke the sender's collective with gloo's multi-line traceback; now one line
    names the push, the engine seen dead and the resume (a trainer's own RuntimeError is left as it is)."""
    from megadare.errors import PeerError
    from megadare.rollout.weight_sync.sync import SyncSettings, WeightSync

    sync = WeightSync([], [], None, SyncSettings(transport="object_store"))
    sync.transport, sync.engines = _LostMember(), _OneDead()
    with pytest.raises(PeerError) as err:
        sync.push(3)
    msg = str(err.value)
    assert msg.startswith("the weight push of version 3 broke: rollout engine 1 on 10.0.0.3 left or stopped ")
    assert "Connection reset by peer" in msg and "resume from its last checkpoint" in msg and "\n" not in msg


def _silent_sender(ports, name: str) -> None:
    """A trainer-side sender (another process: one process registers a group name once) that joins the group with a
    2 s push timeout and then sends nothing, as a trainer that hangs or died mid-push."""
    from megadare.rollout.weight_sync.groups import GroupSpec, host_store, join_group

    store = host_store()
    ports.put(store.port)
    join_group(GroupSpec(name, "127.0.0.1", store.port, 2, 0, "gloo", timeout_s=2.0), store=store)
    time.sleep(300)


@pytest.mark.timeout(120)  # the old engine side waited torch's 30 minutes here
def test_an_engine_stops_waiting_for_a_silent_sender_after_the_push_timeout():
    """The engines' side of a weight group waited up to 30 minutes for a trainer that died or hung mid-push; it now
    fails after the sender's push timeout (rollout.timeout_s, carried in the group spec), as the sender does."""
    import multiprocessing

    from megadare.rollout.weight_sync.groups import GroupSpec, WeightReceiver

    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    sender = ctx.Process(target=_silent_sender, args=(ports, "megadare_silent_sender"), daemon=True)
    sender.start()
    try:
        spec = GroupSpec("megadare_silent_sender", "127.0.0.1", ports.get(timeout=60), 2, 1, "gloo", timeout_s=2.0)
        receiver = WeightReceiver("cpu")
        receiver.join([spec])
        flat = Flat(torch.float32, ("w",), ((4,),))
        with pytest.raises(RuntimeError, match=r"(?i)timed out"):  # the sender joined, then sends nothing
            receiver.receive([(spec.name, [[flat]])], lambda named: None)
    finally:
        sender.kill()
        sender.join()


_HOLD_A_BUFFER = """
import sys, time, torch
from megadare.rollout.weight_sync.groups import SharedBuffer
print(SharedBuffer(4096, torch.device("cpu")).path, flush=True)
time.sleep(300)
"""


def test_a_push_removes_the_shared_buffer_a_killed_push_left_and_keeps_live_ones():
    """A trainer SIGKILLed mid colocated push (between ``begin`` and ``end``) left its ``/dev/shm/megadare_w_*``
    segment forever, one per kill; the next buffer now removes it (its pid@host is gone) and keeps a live one's."""
    import signal
    import subprocess
    import sys

    from megadare.rollout.weight_sync.groups import SharedBuffer

    child = subprocess.Popen([sys.executable, "-c", _HOLD_A_BUFFER], stdout=subprocess.PIPE, text=True)
    left = child.stdout.readline().strip()
    child.kill()
    child.wait()
    assert child.returncode == -signal.SIGKILL and os.path.exists(left), left
    live = SharedBuffer(4096, torch.device("cpu"))  # this process's, alive
    try:
        nxt = SharedBuffer(4096, torch.device("cpu"))
        nxt.close()
        assert not os.path.exists(left), f"{left} left by the killed push is still there"
        assert os.path.exists(live.path)
    finally:
        live.close()
        if os.path.exists(left):
            os.remove(left)
