"""Ray-managed engines on a local Ray cluster (CPU): every prompt once and in order, recovery from a dead engine,
weight sync from a Megatron trainer under TP2+SP, PP2 and EP2 (MoE) into two engine actors."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

ray = pytest.importorskip("ray")

from dist import run_distributed, stepped_trainer  # noqa: E402
from tiny import write_tiny_hf  # noqa: E402
from megadare.rollout.engine import SamplingParams  # noqa: E402
from megadare.rollout.manager import EngineSpec, RolloutManager, build_native_engine  # noqa: E402

EOS = 253
PARAMS = SamplingParams(max_new_tokens=8, block_size=4, steps_per_block=4, temperature=1.0, seed=11,
                        stop_at_eos=False)
PROMPTS = [[(7 * i + j) % 200 + 1 for j in range(3 + i % 5)] for i in range(10)]


def _hf(path, seed: int, name: str = "sdar") -> str:
    return write_tiny_hf(path, name, seed, block_size=4)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                 [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))])}})
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _expected(hf_dir: str) -> list:
    """The same chunks (3 prompts, seed + chunk index) on a local engine."""
    eng = build_native_engine(hf_dir, EOS)
    out = []
    for c in range(0, len(PROMPTS), 3):
        out += eng.generate(PROMPTS[c:c + 3], dataclasses.replace(PARAMS, seed=PARAMS.seed + c // 3))
    return [t.response_ids for t in out]


def test_every_prompt_once_in_order_and_recovery_from_a_dead_engine(cluster, tmp_path):
    hf_dir = _hf(tmp_path, 0)
    expected = _expected(hf_dir)
    healthy = RolloutManager(EngineSpec(build_native_engine, {"hf_dir": hf_dir, "eos_token_id": EOS}),
                             num_engines=2, chunk_size=3)
    got = healthy.generate(PROMPTS, PARAMS)
    assert [t.prompt_ids for t in got] == PROMPTS and [t.response_ids for t in got] == expected
    healthy.shutdown()

    marker = str(tmp_path / "crashed")
    flaky = RolloutManager(EngineSpec(build_native_engine, {"hf_dir": hf_dir, "eos_token_id": EOS,
                                                            "fail_once_marker": marker}),
                           num_engines=2, chunk_size=3)
    got = flaky.generate(PROMPTS, PARAMS)
    assert os.path.exists(marker) and flaky.restarts == 1          # one engine really died
    assert [t.prompt_ids for t in got] == PROMPTS and [t.response_ids for t in got] == expected
    assert all(h["alive"] for h in flaky.call_all("health"))
    flaky.shutdown()


def _trainer_worker(rank, world, gcs, trainer_hf, engine_hf, ids, layout):
    from megadare.convert import mapping_for
    from megadare.models.attention import family_mask
    from megadare.parallel import destroy_distributed, init_distributed
    from megadare.rollout.weight_sync import sync_weights
    from megadare.trainer.forward import forward_logits

    init_distributed(**layout)
    try:
        chunks, model, arch, cfg = stepped_trainer(layout, trainer_hf, n_rows=2)
        _, _, table = mapping_for(cfg)
        managers = []
        if rank == 0:
            ray.init(address=gcs, log_to_driver=False)
            managers = [RolloutManager(EngineSpec(build_native_engine, {"hf_dir": engine_hf, "eos_token_id": EOS}),
                                       num_engines=2)]
        stats = sync_weights(model, table, managers, version=5, bucket_bytes=64 << 10)
        out = {"trainer": forward_logits(chunks, ids, arch.vocab_size, family_mask(arch)), "stats": stats}
        if rank == 0:
            out["engines"] = managers[0].call_all("logits", ids)
            out["versions"] = [h["version"] for h in managers[0].call_all("health")]
            managers[0].shutdown()
            ray.shutdown()
        return out
    finally:
        destroy_distributed()


@pytest.mark.parametrize("name,layout", [("sdar", {"tp": 2, "sp": True}), ("sdar", {"pp": 2}),
                                         ("sdar_moe", {"ep": 2})], ids=["tp2sp", "pp2", "ep2-moe"])
def test_trainer_syncs_into_two_engine_actors(cluster, tmp_path, name, layout):
    """After a training step changed the weights, both engine actors hold the trainer's weights."""
    trainer_hf, engine_hf = _hf(tmp_path, 0, name), _hf(tmp_path, 1, name)
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(3))
    outs = run_distributed(_trainer_worker, 2, cluster, trainer_hf, engine_hf, ids, layout, timeout_s=400)
    trainer = outs[-1]["trainer"]  # the last pipeline stage holds the logits
    assert outs[0]["versions"] == [5, 5] and outs[0]["stats"]["sync_buckets"] > 2
    for logits in outs[0]["engines"]:
        assert (logits - trainer).abs().max() < 1e-4


def test_engines_no_node_can_hold_fail_at_once(cluster, tmp_path):
    """An infeasible engine bundle (a GPU on a CPU cluster, more CPUs than a node has) is refused before the
    placement group would wait out its timeout (and end in GetTimeoutError, not this error)."""
    from megadare.errors import ConfigError

    spec = EngineSpec(build_native_engine, {"hf_dir": str(tmp_path), "eos_token_id": EOS})
    for resources in ({"num_cpus": 1, "num_gpus": 1}, {"num_cpus": 64}):
        with pytest.raises(ConfigError, match=r"rollout.engine_resources=.*no node of the Ray cluster has"):
            RolloutManager(spec, num_engines=1, resources=resources)
