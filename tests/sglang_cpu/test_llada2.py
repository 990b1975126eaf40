"""A real SGLang engine serving a tiny LLaDA2 export (megadare's configuration_llada2_moe.py) inside a Ray actor of
megadare's rollout manager: trajectories equal the built-in engine's, greedy and sampled, for several prompts;
after a weight update through the manager the engine actor is killed, and the manager restarts it, replays the
weights and re-issues the rollout: the trajectories equal the built-in engine's with those weights and carry their
policy version. (routed_scaling_factor is 1.0 here: sglang's CPU MoE path ignores it, see real_sglang.py.)"""
from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="real-SGLang tests: run tests/sglang_cpu/run.sh")

from ray_fixture import ray_cluster  # noqa: E402,F401  (fixture)
from real_sglang import (EOS, assert_same_trajectories, checkpoint_tensors, engine_kwargs,  # noqa: E402
                         export_checkpoint, greedy_and_sampled, native_engine)

from megadare.rollout.manager import EngineSpec, RolloutManager  # noqa: E402
from megadare.rollout.sglang_engine import build_sglang_engine  # noqa: E402

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28],
           [3] * 40]
PARAMS = greedy_and_sampled(32, 8)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("llada2"))
    return {"served": export_checkpoint(root, "llada2", 0),
            "other": export_checkpoint(root, "llada2", 1, export=False)}


@pytest.fixture(scope="module")
def manager(ray_cluster, ckpts):  # noqa: F811
    spec = EngineSpec(build_sglang_engine, {"model_path": ckpts["served"], "eos_token_id": EOS, **engine_kwargs()})
    m = RolloutManager(spec, num_engines=1, resources={"num_cpus": 1}, chunk_size=8)
    yield m
    try:
        m.call_all("shutdown")
    finally:
        m.shutdown()


@pytest.mark.parametrize("name,params", PARAMS[:2], ids=[n for n, _ in PARAMS[:2]])
def test_trajectories_equal_the_builtin_engine(manager, ckpts, name, params):
    assert_same_trajectories(f"llada2 (fdfo loop, Ray actor) {name}", manager.generate(PROMPTS, params),
                             native_engine(ckpts["served"]).generate(PROMPTS, params))


def test_engine_restarted_by_the_manager_gets_the_weights_back(manager, ckpts):
    import ray

    greedy = PARAMS[0][1]
    manager.pause()
    manager.update_weights(checkpoint_tensors(ckpts["other"]), 6)
    manager.resume()
    assert manager.call_all("health")[0]["version"] == 6
    ray.kill(manager.actors[0])                      # the engine dies; the next rollout finds it dead
    got = manager.generate(PROMPTS, greedy)
    assert manager.restarts == 1 and manager.call_all("health")[0]["version"] == 6
    assert all(t.policy_version == 6 for t in got)
    native = native_engine(ckpts["other"])
    native.version = 6
    assert_same_trajectories("llada2 after a restart through the Ray manager (weights replayed), greedy", got,
                             native.generate(PROMPTS, greedy))
