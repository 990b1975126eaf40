"""Every algorithm of the zoo trains through the real Megatron step on real rollouts (no Ray here: the loop's
Ray path is tests/test_rl_loop.py): rollouts of the built-in engine -> rewards -> the algorithm's rows ->
(old / reference log-probs) -> train_step. Checks: the loss and gradient are finite, the gradient is not zero,
the weights move, and -- with old log-probs computed by a separate forward pass over the same rows, as a
multi-update run does -- every ratio-based algorithm sees ratio == 1 at the first update (stored corruptions,
packing and old log-probs line up position by position).
Block-diffusion (SDAR), full attention (LLaDA) and shifted logits (Dream) are covered; MDPO runs on the
engine's recorded per-step predictions over 4 semi-AR blocks (LLaDA, block 2 of 8 tokens) and over the SDAR grid.
"""

from __future__ import annotations

import math

import pytest

from megadare.algos.algorithm import Algorithm
from megadare.parallel.launch import spawn
from tiny import write_tiny_hf  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def _worker(rank, world, hf_dir, algos, cfg_over):
    from megadare.algos import build_algorithm
    from megadare.config import config_from_dict
    from megadare.models import load_hf_model
    from megadare.models.family import family_of, read_hf_config
    from megadare.parallel import destroy_distributed, init_distributed
    from megadare.rollout.engine import SamplingParams
    from megadare.rollout.native import NativeEngine
    from megadare.trainer.model_setup import resolve_model_source
    from megadare.trainer.rl_rollout import build_samples
    from dist import fresh_update

    init_distributed()
    try:
        cfg = config_from_dict(
            {
                "model": {"hf_path": hf_dir},
                "train": {"seq_length": 512, "micro_batch_size": 2},
                "rl": {"n_samples": 4, "mini_batches": 1, **cfg_over},
            }
        )
        src = resolve_model_source(cfg)
        arch = src.arch
        hf_cfg = read_hf_config(hf_dir)
        needs_steps = any(build_algorithm(a).needs_step_predictions for a in algos)
        block = arch.block_size if arch.attention == "block_causal" else (2 if needs_steps else 4)
        kind = "block_diffusion" if arch.attention == "block_causal" else "bidirectional"
        engine = NativeEngine(load_hf_model(hf_dir), family_of(hf_cfg).arch(hf_cfg), eos_token_id=3)
        prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 21]]
        ids = [p for p in prompts for _ in range(4)]
        traj = engine.generate(
            ids,
            SamplingParams(
                max_new_tokens=8,
                block_size=block,
                steps_per_block=block // 2,
                temperature=1.0,
                seed=3,
                stop_at_eos=False,
                record_steps=needs_steps,
            ),
        )
        rewards = [float(i % 4 < 2) if i // 4 != 2 else float(i % 4 == 0) for i in range(len(traj))]
        samples, _ = build_samples(cfg, traj, rewards)
        out = {}
        for name in algos:
            if name == "d_treerpo":  # tree rollouts: 2 levels x 2 branches = 4 leaves per prompt
                tree = build_algorithm(name, {"branch": 2, "depth": 2})
                params = SamplingParams(
                    max_new_tokens=8, block_size=block, steps_per_block=block // 2, temperature=1.0, seed=5
                )
                engine.version = 3  # the leaves carry the weights' version their segments were decoded with
                leaves = tree.rollout(engine.generate, prompts, params, 4, global_grid=arch.attention == "block_causal")
                for t in leaves:
                    t.validate()
                    assert t.policy_version == 3
                samples = tree.samples_from(leaves, rewards, 4)
                out["tree_nodes"] = len(samples)
            algo = build_algorithm(name, {"branch": 2, "depth": 2} if name == "d_treerpo" else None)
            if type(algo).prepare is not Algorithm.prepare:  # as the trainer's collect (MDPO: a toy reward on
                # every intermediate answer; TraceRL / random masking: the step's longest response)
                algo.prepare(samples, lambda rs, idx: [sum(t % 2 == 0 for t in r) / len(r) for r in rs], 4)
            if name == "mdpo":
                assert all(len(s.extra["step_rewards"]) == len(s.extra["step_predictions"]) for s in samples)
                out["mdpo_blocks"] = min(
                    len({j // block for pred in s.extra["step_predictions"] for j, p in enumerate(pred) if p >= 0})
                    for s in samples
                )
                out["mdpo_steps"] = sorted({t for s in samples for t in s.extra["steps"]})
            out[name] = fresh_update(cfg, src, algo, samples, block, kind)
        return out
    finally:
        destroy_distributed()


@pytest.mark.parametrize(
    "family,algos",
    [
        (
            "sdar",
            ("d1", "coupled_grpo", "random_mask_rl", "tracerl", "cj_grpo", "bgpo", "ebpo", "spg", "vrpo", "d_treerpo"),
        ),
        ("llada", ("d1", "tracerl", "random_mask_rl")),
        ("llada", ("mdpo",)),
        ("sdar", ("mdpo",)),
        ("dream", ("coupled_grpo", "tracerl")),
    ],
)
def test_every_algorithm_trains(tmp_path, family, algos):
    over = {"block_size": 4} if family == "sdar" else {}
    hf = write_tiny_hf(tmp_path, family, seed=1, **over)
    res = spawn(_worker, 1, hf, algos, {}, timeout_s=600)[0]
    if algos == ("mdpo",):  # steps chosen across the batch (DARE): one shared set of step indices
        if family == "llada":
            assert res["mdpo_blocks"] == 4
        assert 0 < len(res["mdpo_steps"]) <= 16
    if "d_treerpo" in algos:  # 3 prompts x (2 + 4) nodes, minus empty segments of branches that hit EOS
        assert 0 < res["tree_nodes"] <= 18
    for name in algos:
        m = res[name]
        assert math.isfinite(m["pg_loss"]) and math.isfinite(m["grad_norm"]), (name, m)
        assert m["grad_norm"] > 0 and m["moved"] > 0, (name, m)
        if "ratio_dev" in m:  # old pass == current pass before the first update
            assert m["ratio_dev"] == pytest.approx(0.0, abs=1e-5), (name, m)


def _ar_worker(rank, world, hf_dir):
    """LLaDA: the engine's autoregressive-order rollout (block 1, one step) on the full canvas, JustGRPO's
    estimator through Megatron against the engine's recorded log-probs, then JustGRPO and ESPO updates."""
    from megadare.algos import build_algorithm
    from megadare.algos.sft import example_generator
    from megadare.config import config_from_dict
    from megadare.data.rows import pack_rows
    from megadare.models import load_hf_model
    from megadare.models.family import family_of, read_hf_config
    from megadare.parallel import destroy_distributed, init_distributed
    from megadare.rollout.native import NativeEngine
    from megadare.trainer.model_setup import build_training_chunks, resolve_model_source
    from megadare.rollout.setup import sampling_params
    from megadare.trainer.rl_rollout import build_samples
    from megadare.trainer.step import RowFormat, store_outputs
    from dist import fresh_update

    init_distributed()
    try:
        over = {
            "model": {"hf_path": hf_dir},
            "train": {"seq_length": 256, "micro_batch_size": 2},
            "rollout": {"block_size": 1, "steps_per_block": 1, "temperature": 0.7, "max_new_tokens": 6},
        }
        cfg = config_from_dict({**over, "rl": {"n_samples": 4}})
        src = resolve_model_source(cfg)
        arch, hf_cfg = src.arch, read_hf_config(hf_dir)
        engine = NativeEngine(load_hf_model(hf_dir), family_of(hf_cfg).arch(hf_cfg), eos_token_id=3)
        params = sampling_params(cfg, arch, seed=3)  # LLaDA's default canvas: the full one
        traj = engine.generate([p for p in ([5, 6, 7], [9, 10, 11, 12], [20, 21]) for _ in range(4)], params)
        out = {
            "stop_at_eos": params.stop_at_eos,
            "ar_order": all(t.commit_step == list(range(6)) for t in traj),
            "canvas": all(
                len(t.response_ids) == 6 and (t.finish_reason == "eos") == (3 in t.response_ids) for t in traj
            ),
        }
        samples, _ = build_samples(cfg, traj, [float(i % 2) for i in range(len(traj))])
        algo = build_algorithm("justgrpo")
        mbs = pack_rows(algo.batch_rows(samples, arch, 1, lambda i: example_generator(cfg.seed, 0, i)), 256, 2)
        store_outputs(build_training_chunks(cfg, src), mbs, "old", RowFormat("bidirectional", 1, arch.vocab_size))
        diff = 0.0
        for mb in mbs:
            sel = mb.weight > 0
            for i, k, lp in zip(mb.sample[sel].tolist(), mb.tok[sel].tolist(), mb.old[sel].tolist()):
                diff = max(diff, abs(lp - traj[i].logprobs[k]))
        out["engine_vs_trainer"] = diff
        for name, epochs in (("justgrpo", 1), ("espo", 2)):
            cfg = config_from_dict({**over, "rl": {"n_samples": 4, "ppo_epochs": epochs, "advantage": "rloo"}})
            out[name] = fresh_update(cfg, src, build_algorithm(name), samples, 1, "bidirectional")
        return out
    finally:
        destroy_distributed()


def test_justgrpo_and_espo_on_llada(tmp_path):
    """The built-in engine decodes LLaDA in autoregressive order on the full canvas (block 1, one step per
    token); JustGRPO's tempered estimator, through Megatron, equals the engine's recorded sampling log-probs (the
    ratio is 1 against the sampler); JustGRPO trains; ESPO trains two epochs on two corruption sets whose old
    ELBOs were both taken before the first update (so the second epoch's ratio has moved)."""
    hf = write_tiny_hf(tmp_path, "llada", seed=1)
    res = spawn(_ar_worker, 1, hf, timeout_s=600)[0]
    assert res["stop_at_eos"] is False and res["ar_order"] and res["canvas"]
    assert res["engine_vs_trainer"] < 2e-4, res["engine_vs_trainer"]
    for name in ("justgrpo", "espo"):
        m = res[name]
        assert math.isfinite(m["pg_loss"]) and m["grad_norm"] > 0 and m["moved"] > 0, (name, m)
    assert res["justgrpo"]["ratio_dev"] == pytest.approx(0.0, abs=1e-5)
    assert res["espo"]["ratio_dev"] > 1e-4 and res["espo"]["train_rows"] == 12
