"""A real SGLang engine serving a tiny SDAR-MoE export (Qwen3-MoE config) with megadare's dLLM algorithm, in
sglang's first-done-first-out loop (its default): trajectories equal the built-in engine's, greedy and sampled,
for several prompts in one batch; ``update_weights`` from an EP2 Megatron trainer through
``weight_sync.sync_weights``, then the engine's greedy trajectories equal the built-in engine's with the same
weights, stamped with the new policy version."""
from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="real-SGLang tests: run tests/sglang_cpu/run.sh")

from real_sglang import (assert_same_trajectories, export_checkpoint, greedy_and_sampled,  # noqa: E402
                         native_engine, set_weights, start_engine, sync_from_trainer)

PROMPTS = [[5, 6, 7, 8, 9], [9, 10], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
PARAMS = greedy_and_sampled(4, 4)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("sdar_moe"))
    return {"served": export_checkpoint(root, "sdar_moe", 0),
            "other": export_checkpoint(root, "sdar_moe", 1, export=False)}


@pytest.fixture(scope="module")
def engine(ckpts):
    eng = start_engine(ckpts["served"])
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("name,params", PARAMS[:2], ids=[n for n, _ in PARAMS[:2]])
def test_trajectories_equal_the_builtin_engine(engine, ckpts, name, params):
    set_weights([engine], ckpts["served"], version=0)
    assert_same_trajectories(f"sdar_moe (fdfo loop) {name}", engine.generate(PROMPTS, params),
                             native_engine(ckpts["served"]).generate(PROMPTS, params))


def test_update_weights_from_an_ep2_megatron_trainer(engine, ckpts):
    greedy = PARAMS[0][1]
    set_weights([engine], ckpts["served"], version=0)
    before = engine.generate(PROMPTS, greedy)
    native = native_engine(ckpts["served"])
    stats = sync_from_trainer({"ep": 2}, ckpts["other"], [engine, native], version=4)
    assert stats["buckets_received"] == stats["sync_buckets"] > 2
    after = engine.generate(PROMPTS, greedy)
    assert [t.response_ids for t in after] != [t.response_ids for t in before]      # the weights changed
    assert all(t.policy_version == 4 for t in after)
    assert_same_trajectories("sdar_moe after sync_weights from an EP2 trainer, greedy", after,
                             native.generate(PROMPTS, greedy))
