"""A real SGLang engine serving a tiny SDAR-MoE export (a Qwen3-MoE config) with megadare's dLLM algorithm, in
sglang's first-done-first-out loop (its default): trajectories equal the built-in engine's, greedy and sampled,
for several prompts in one batch. (Weights from an EP2 trainer: test_llada2.py.)"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="real-SGLang tests: run tests/sglang_cpu/run.sh")

from real_sglang import (
    assert_same_trajectories,
    export_checkpoint,
    greedy_and_sampled,  # noqa: E402
    native_engine,
    start_engine,
)

PROMPTS = [[5, 6, 7, 8, 9], [9, 10], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
PARAMS = greedy_and_sampled(4, 4)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("sdar_moe"))
    return {"served": export_checkpoint(root, "sdar_moe", 0)}


@pytest.fixture(scope="module")
def engine(ckpts):
    eng = start_engine(ckpts["served"])
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("name,params", PARAMS[:2], ids=[n for n, _ in PARAMS[:2]])
def test_trajectories_equal_the_builtin_engine(engine, ckpts, name, params):
    assert_same_trajectories(
        f"sdar_moe (fdfo loop) {name}",
        engine.generate(PROMPTS, params),
        native_engine(ckpts["served"]).generate(PROMPTS, params),
    )
