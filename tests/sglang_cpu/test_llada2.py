"""A real SGLang engine serving a tiny LLaDA2 export (megadare's configuration_llada2_moe.py) inside a Ray actor of
megadare's rollout manager, driven by an EP2 Megatron trainer (2 gloo ranks; rank 0 owns the manager):

* trajectories equal the built-in engine's, greedy and sampled, for several prompts;
* ``WeightSync(SyncSettings(transport="distributed"))``: the engine's TP rank joins a gloo group per pipeline stage
  (``SGLangEngine.join_weight_groups`` -> sglang's ``init_weights_update_group``) and receives the trainer's
  flattened buckets (``SGLangEngine.receive_weights`` -> ``update_weights_from_distributed``); afterwards its greedy
  trajectories equal the built-in engine's given the same weights, stamped with the pushed version;
* the engine actor is killed: the manager restarts it and, since no engine holds the current weights any more,
  the rollout waits for a push of them (``run_on_rank0``) that both trainer ranks join; the trajectories again
  equal the built-in engine's and carry the version.
(routed_scaling_factor is 1.0 here: sglang's CPU MoE path ignores it, see real_sglang.py.)
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("sglang", reason="real-SGLang tests: run tests/sglang_cpu/run.sh")

from ray_fixture import ray_cluster  # noqa: E402,F401  (module-scoped local Ray cluster)
from real_sglang import assert_same_trajectories, export_checkpoint, greedy_and_sampled  # noqa: E402

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28], [3] * 40]
PARAMS = greedy_and_sampled(32, 8)[:2]
VERSION = 3


def _trainer_and_engine(rank, world, served, trainer_hf):
    """EP2 trainer ranks; rank 0 also runs the rollout manager (one SGLang engine actor) and a built-in engine."""
    import ray

    from dist import stepped_trainer
    from real_sglang import EOS, engine_kwargs, native_engine

    from megadare.convert.hf_megatron import mapping_for
    from megadare.parallel import Layout, destroy_distributed, init_distributed
    from megadare.rollout.manager import EngineSpec, RolloutManager
    from megadare.rollout.sglang_engine import build_sglang_engine
    from megadare.parallel.rank0 import run_on_rank0
    from megadare.rollout.weight_sync.sync import SyncSettings, WeightSync, sync_weights

    init_distributed(Layout(ep=2))
    r0 = rank == 0
    out: dict = {}
    manager = None
    try:
        _, model, _, cfg = stepped_trainer({"ep": 2}, trainer_hf)
        table = mapping_for(cfg)[2]
        if r0:
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
            spec = EngineSpec(build_sglang_engine, {"model_path": served, "eos_token_id": EOS, **engine_kwargs()})
            manager = RolloutManager(spec, num_engines=1, resources={"num_cpus": 1}, chunk_size=8)
            native = native_engine(served)
            out["before"] = {name: (manager.generate(PROMPTS, p), native.generate(PROMPTS, p)) for name, p in PARAMS}
        sync = WeightSync(model, table, manager, SyncSettings(transport="distributed", bucket_bytes=64 << 10))
        out["stats"] = sync.push(VERSION)
        sync_weights(model, table, [native] if r0 else [], VERSION)  # the same weights, in process
        greedy = PARAMS[0][1]
        if r0:
            out["pushed"] = (manager.generate(PROMPTS, greedy), native.generate(PROMPTS, greedy))
            ray.kill(manager.actors[0])  # the engine dies
        trajs = run_on_rank0(lambda: manager.generate(PROMPTS, greedy), lambda: sync.push(VERSION), manager)
        if r0:
            out["restarted"] = (trajs, native.generate(PROMPTS, greedy))
            out["restarts"] = manager.restarts
        sync.close()
        return out
    finally:
        if manager is not None:
            manager.shutdown()  # each engine's own shutdown first, then the actors
        destroy_distributed()


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):  # noqa: F811
    from dist import run_distributed

    root = str(tmp_path_factory.mktemp("llada2"))
    served = export_checkpoint(root, "llada2", 0)
    return run_distributed(
        _trainer_and_engine, 2, served, export_checkpoint(root, "llada2", 1, export=False), timeout_s=900
    )[0]


@pytest.mark.parametrize("name", [n for n, _ in PARAMS])
def test_trajectories_equal_the_builtin_engine(run, name):
    got, want = run["before"][name]
    assert_same_trajectories(f"llada2 (fdfo loop, Ray actor) {name}", got, want)


def test_distributed_weight_push_from_an_ep2_trainer(run):
    got, want = run["pushed"]
    assert run["stats"]["sync_buckets"] > 2 and all(t.policy_version == VERSION for t in got)
    before = run["before"]["greedy"][0]
    assert [t.response_ids for t in got] != [t.response_ids for t in before]  # the weights changed
    assert_same_trajectories("llada2 after WeightSync(distributed, gloo) from an EP2 trainer, greedy", got, want)


def test_restarted_engine_gets_the_current_weights_before_serving(run):
    got, want = run["restarted"]
    assert run["restarts"] == 1 and all(t.policy_version == VERSION for t in got)
    assert_same_trajectories("llada2 after a restart through the Ray manager (weights pushed again), greedy", got, want)
