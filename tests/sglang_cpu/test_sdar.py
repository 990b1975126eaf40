"""A real SGLang engine serving a tiny SDAR export (tied embeddings: the loader fix in megadare's plugin) with
megadare's dLLM algorithm, in sglang's synchronous loop (``dllm_fdfo=False``):

* the plugin loads through the ``sglang.srt.plugins`` entry point; the mask ids megadare checks are sglang's;
* trajectories equal the built-in engine's, greedy and sampled, for several prompts in one batch;
* ``update_weights`` (``update_weights_from_tensor``, flattened buckets) from a TP2 + sequence-parallel Megatron
  trainer through ``weight_sync.sync_weights``: afterwards the engine's greedy trajectories equal the built-in
  engine's with the same weights, stamped with the new policy version.
(``update_weights_from_distributed`` over gloo and a restart through the Ray manager: test_llada2.py.)
"""

from __future__ import annotations

import inspect
import json
from importlib.metadata import entry_points

import pytest

sglang = pytest.importorskip("sglang", reason="real-SGLang tests: run tests/sglang_cpu/run.sh")

from real_sglang import (
    assert_same_trajectories,
    greedy_and_sampled,
    native_engine,
    set_weights,  # noqa: E402
    start_engine,
    sync_from_trainer,
)

from megadare.rollout import sglang_engine as se  # noqa: E402
from megadare.rollout.sglang_plugin import ALGORITHM_NAME  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [9, 10], [3, 4, 5, 6, 7, 8, 9, 10, 11], [151000, 7, 12, 99]]
PARAMS = greedy_and_sampled(4, 4)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from real_sglang import export_checkpoint

    root = str(tmp_path_factory.mktemp("sdar"))
    served = export_checkpoint(root, "sdar", 0)
    with open(f"{served}/config.json") as f:
        assert json.load(f)["tie_word_embeddings"] is True  # sglang's SDAR loader fails on these unfixed
    return {"served": served, "other": export_checkpoint(root, "sdar", 1, export=False)}


@pytest.fixture(scope="module")
def engine(ckpts):
    eng = start_engine(ckpts["served"], dllm_fdfo=False)
    yield eng
    eng.shutdown()


def test_plugin_loads_through_the_entry_point(engine):
    ours = {ep.name: ep.value for ep in entry_points(group=se.PLUGIN_GROUP)}
    assert ours["megadare"].replace(" ", "") == se.PLUGIN_ENTRY_POINT
    h = engine.health()
    assert h["alive"] and h["dllm_algorithm"] == ALGORITHM_NAME and h["sglang_version"] == sglang.__version__


def test_megadare_knows_sglangs_hard_coded_mask_ids_and_blocks():
    """SGLANG_MASK_ID / DEFAULT_BLOCK_SIZE (what SGLangEngine checks checkpoints against) are what the installed
    sglang hard-codes in DllmConfig.from_server_args."""
    from sglang.srt.dllm.config import DllmConfig

    src = "".join(inspect.getsource(DllmConfig.from_server_args).split())
    for arch, mask in se.SGLANG_MASK_ID.items():
        assert f'"{arch}":{{"block_size":{se.DEFAULT_BLOCK_SIZE[arch]},"mask_id":{mask}}}' in src, arch


@pytest.mark.parametrize("name,params", PARAMS, ids=[n for n, _ in PARAMS])
def test_trajectories_equal_the_builtin_engine(engine, ckpts, name, params):
    set_weights([engine], ckpts["served"], version=0)
    got = engine.generate(PROMPTS, params)
    assert_same_trajectories(
        f"sdar (tied, sync loop) {name}", got, native_engine(ckpts["served"]).generate(PROMPTS, params)
    )
    if params.temperature > 0:
        assert any(lp < 0 for t in got for lp in t.logprobs)


def test_update_weights_from_a_tp2_sp_megatron_trainer(engine, ckpts):
    greedy = PARAMS[0][1]
    set_weights([engine], ckpts["served"], version=0)
    before = engine.generate(PROMPTS, greedy)
    native = native_engine(ckpts["served"])
    stats = sync_from_trainer({"tp": 2, "sp": True}, ckpts["other"], [engine, native], version=5)
    assert stats["buckets_received"] >= stats["sync_buckets"] > 2  # one call per bucket and dtype
    after = engine.generate(PROMPTS, greedy)
    assert [t.response_ids for t in after] != [t.response_ids for t in before]  # the weights changed
    assert all(t.policy_version == 5 for t in after)
    assert_same_trajectories(
        "sdar after sync_weights from a TP2+SP trainer, greedy", after, native.generate(PROMPTS, greedy)
    )
