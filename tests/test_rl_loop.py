"""The RL loop end to end on CPU: Megatron actor + Ray-managed built-in engine + weight sync every step.

* the demo on a shortened schedule: RL raises held-out accuracy over the SFT model (same seed), writes
  tensorboard events and the reward-curve PNG;
* a crashed/stopped run resumes where it stopped: 2 steps straight == 1 step + resume + 1 step (same rollouts,
  same losses), because rollout seeds, corruptions and weights are all functions of the step;
* the layout does not change the learning signal: TP2+SP gives the same first-step rewards and gradient norm
  as TP1;
* config errors name the key.
"""

from __future__ import annotations

import glob
import json
import math
import os

import pytest

from ray_fixture import ray_cluster  # noqa: F401  (module-scoped local Ray cluster)

from megadare.config import load_config
from megadare.errors import ConfigError
from megadare.parallel.launch import spawn

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("ray_cluster")]


def _events(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# the demo's SFT length (demo_sft.yaml); 300 steps once sufficed, before block SFT redrew t as SDAR does (a tiny t
# then forced one token weighted up to 1/noise_low): its SFT model after 300 steps held 0.22 and 10 RL steps took it
# to 0.36 (0.25 -> 0.92 before); after 500, 0.44 -> 0.94
SFT_STEPS = 500


def test_demo_rl_improves_over_sft(tmp_path):
    from megadare.demo import run_demo
    from megadare.demo_setup import DemoRun

    res = run_demo(
        DemoRun(str(tmp_path), sft_steps=SFT_STEPS, rl_steps=10, overrides=("rl.eval_size=64", "rl.eval_interval=0"))
    )
    sft, rl = res["sft_accuracy"], res["rl_accuracy"]
    print(f"held-out accuracy: SFT {sft:.3f} -> RL {rl:.3f} ({res['seconds']:.0f} s)")
    assert rl >= sft + 0.15, (sft, rl)
    # the rollout reward on training prompts rose too
    rewards = [h["reward"] for h in res["history"]]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4
    ev = _events(str(tmp_path / "rl"))
    assert [s for s, _ in ev["train/reward"]] == list(range(1, 11))
    assert ev["eval/accuracy"][0][0] == 0 and ev["eval/accuracy"][-1][0] == 10
    with open(res["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert glob.glob(str(tmp_path / "rl" / "ckpt" / "iter_*"))
    # the same SFT checkpoint trained one-step-off (rollout k+1 overlaps update k): it learns like the sync run
    _, cfg = DemoRun(
        str(tmp_path), SFT_STEPS, 10, "tracerl", 1, ("rl.eval_size=64", "rl.eval_interval=0", "rl.mode=one_step_off")
    ).configs()
    cfg.logging.run_dir = str(tmp_path / "rl_off")
    off = _run(cfg)
    off_acc = off["evals"][max(off["evals"])]["accuracy"]
    print(f"one-step-off: SFT {sft:.3f} -> RL {off_acc:.3f}")
    assert off_acc >= sft + 0.15, (sft, off_acc)
    assert [h["async/staleness_max"] for h in off["history"]][1:] == [1.0] * 9


def letters_reward(response: str, record: dict) -> float:
    """A dense reward even an untrained model earns sometimes (share of letters a-h): non-zero advantages."""
    return sum(c in "abcdefgh" for c in response) / max(len(response), 1)


def _rl_cfg(tmp, *over):
    from importlib import resources

    base = resources.files("megadare") / "configs" / "demo_rl.yaml"
    return load_config(
        str(base),
        [
            f"logging.run_dir={tmp}",
            "rl.steps=2",
            "rl.eval_size=8",
            "rl.prompts_per_step=4",
            "rl.n_samples=4",
            "train.micro_batch_size=2",
            "checkpoint.save_interval=1",
            "rl.reward=test_rl_loop:letters_reward",
            *over,
        ],
    )


def _run(cfg, nproc=1, max_steps=None):
    from megadare.trainer.rl import rl_worker

    return spawn(rl_worker, nproc, cfg, max_steps, timeout_s=600)[0]


def _timing(key: str) -> bool:
    """A metric that measures time (differs between identical runs)."""
    return key.endswith("_s") or key in ("sync_seconds", "sync_gbps") or "idle_ratio" in key


def test_demo_decodes_a_step_in_one_request_and_learns_the_same(tmp_path):
    """The demo's one engine gets a step's prompts as one request (``rollout.chunk_size`` >= prompts x samples: one
    batch, not several small ones in a row); every step's rewards, losses and gradient norm, and the evaluation,
    equal those of small requests bit for bit (each prompt samples its own seeded stream, whatever the batch)."""
    from importlib import resources

    demo = load_config(str(resources.files("megadare") / "configs" / "demo_rl.yaml"), [])
    step_prompts = demo.rl.prompts_per_step * demo.rl.n_samples
    assert demo.rollout.chunk_size * demo.rollout.num_engines >= step_prompts, demo.rollout.chunk_size
    whole = _run(_rl_cfg(tmp_path / "whole", "checkpoint.save_interval=0"))
    small = _run(_rl_cfg(tmp_path / "small", "checkpoint.save_interval=0", "rollout.chunk_size=3"))
    assert whole["evals"] == small["evals"]
    for a, b in zip(whole["history"], small["history"], strict=True):
        same = {k: a[k] for k in a if not _timing(k)}
        assert same == {k: b[k] for k in b if not _timing(k)}
        assert same["pg_loss"] != 0.0 and same["grad_norm"] > 0  # a step that learned, not an empty one


def _frozen_during_steps(rank: int, world: int, cfg) -> tuple[list[int], int]:
    """(objects frozen out of the garbage collector's sight at each step's start, after the run) on this rank."""
    import gc

    from megadare.trainer import rl

    seen, step = [], rl.rl_step

    def probe(run):
        seen.append(gc.get_freeze_count())
        return step(run)

    rl.rl_step = probe
    rl.run_rl(cfg)
    return seen, gc.get_freeze_count()


def test_steps_run_with_the_set_up_heap_frozen(tmp_path):
    """The set-up's objects (torch, megatron, ray, the model) are frozen while the steps run, so a full garbage
    collection a step triggers does not walk them all (~0.4 s each on the demo); unfrozen when the loop ends."""
    seen, after = spawn(_frozen_during_steps, 1, _rl_cfg(tmp_path, "checkpoint.save_interval=0"), timeout_s=600)[0]
    assert len(seen) == 2 and min(seen) > 100_000, seen
    assert after == 0


def test_rl_resume_matches_straight_run(tmp_path):
    """With TraceRL's value model, so its weights and optimizer are checkpointed and restored too."""
    value = "algo.params={value_model: true, value_lr: 1e-3}"
    straight = _run(_rl_cfg(tmp_path / "a", value))
    first = _run(_rl_cfg(tmp_path / "b", value), max_steps=1)
    assert first["step"] == 1
    assert glob.glob(str(tmp_path / "b" / "ckpt_value" / "iter_*"))
    resumed = _run(_rl_cfg(tmp_path / "b", value))
    assert resumed["step"] == 2 and len(resumed["history"]) == 1
    a, b = straight["history"][1], resumed["history"][0]
    for k in ("reward", "pg_loss", "grad_norm", "train_rows", "value_loss", "value_grad_norm"):
        assert math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-9), (k, a[k], b[k])
    assert straight["evals"][2] == resumed["evals"][2]
    logged = [json.loads(line) for line in open(tmp_path / "b" / "metrics.jsonl")]
    kinds = [(m["step"], any(k.startswith("eval/") for k in m)) for m in logged]
    assert len(kinds) == len(set(kinds)) and (2, True) in kinds, kinds  # no step or evaluation twice
    # step k trained, its weights pushed as version k+1 (colocated: a one-host CPU run), the next rollout used them
    assert [h["async/staleness_max"] for h in straight["history"]] == [0.0, 0.0]
    assert all(h["sync_bytes"] > 0 and h["sync_buckets"] >= 1 for h in straight["history"])


def test_a_resumed_run_evaluates_the_steps_a_straight_one_does(tmp_path):
    """Stopped after its checkpoint at step 1 (no evaluation due: rl.eval_interval=2), the resumed run evaluated at
    its start step anyway (an evaluation a straight run never makes, its minutes spent again at every resume);
    stopped after its checkpoint at step 2 (evaluated before it), the resumed run does not evaluate step 2 again.
    Each evaluated step is logged once: metrics.jsonl and tensorboard hold steps 0, 2 and 3, as a straight run's."""
    cfg = _rl_cfg(tmp_path, "rl.steps=3", "rl.eval_interval=2")
    assert _run(cfg, max_steps=1)["step"] == 1
    assert sorted(_run(cfg, max_steps=1)["evals"]) == [0, 2]
    assert sorted(_run(cfg)["evals"]) == [0, 2, 3]
    logged = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in logged if "eval/accuracy" in m] == [0, 2, 3], logged
    assert [step for step, _ in _events(str(tmp_path))["eval/accuracy"]] == [0, 2, 3]


def test_rl_tp2_matches_tp1(tmp_path):
    """Also the multi-update path: 2 PPO epochs x 2 mini-batches, old log-probs from a separate pass; the TP2 run
    pushes its weights over the distributed transport (a gloo group with the engine), the TP1 run colocated."""
    common = ("rl.steps=1", "rl.ppo_epochs=2", "rl.mini_batches=2")
    one = _run(_rl_cfg(tmp_path / "tp1", *common))
    two = _run(
        _rl_cfg(tmp_path / "tp2", *common, "parallel.tp=2", "parallel.sp=true", "rollout.weight_transport=distributed"),
        nproc=2,
    )
    assert one["evals"][0] == two["evals"][0]
    a, b = one["history"][0], two["history"][0]
    assert a["reward"] == b["reward"]
    for k in ("grad_norm", "pg_loss", "clipfrac"):
        assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-7), (k, a[k], b[k])
    assert a["ratio_dev"] > 0  # later updates really saw ratios != 1


def test_rl_config_errors(tmp_path):
    from megadare.algos import build_algorithm

    with pytest.raises(ConfigError, match="algo.name='nope'"):
        build_algorithm("nope")
    with pytest.raises(ConfigError, match="algo.params.epsilon"):
        build_algorithm("d1", {"epsilon": 0.1})
    with pytest.raises(ConfigError, match="rl.advantage"):
        load_config(None, ["rl.advantage=ppo"])
    with pytest.raises(ConfigError, match="model.tiny_config"):
        load_config(None, ["model.tiny_config={hidden_size:128}"])
    pytest.importorskip("megadare.rollout.sglang_engine")
    try:
        import sglang  # noqa: F401
    except ImportError:  # without sglang, choosing it fails at once, saying how to install it
        from types import SimpleNamespace

        from megadare.rollout.setup import start_engines

        cfg = load_config(None, ["rollout.engine=sglang"])
        with pytest.raises(ImportError, match=r"pip install"):
            start_engines(cfg, SimpleNamespace(hf_dir=str(tmp_path)), SimpleNamespace(eos_token_id=1))


def test_one_step_off_overlaps_with_staleness_one(tmp_path):
    """Step k+1's rollout is generated on policy k while step k trains: staleness 0 at the first step, 1 after;
    the first step is the sync run's first step exactly; max_staleness=0 refuses the stale rollouts."""
    sync = _run(_rl_cfg(tmp_path / "sync", "rl.steps=2", "checkpoint.save_interval=0"))
    off = _run(_rl_cfg(tmp_path / "off", "rl.steps=2", "rl.mode=one_step_off", "checkpoint.save_interval=0"))
    assert [h["async/staleness_max"] for h in off["history"]] == [0.0, 1.0]
    assert [h["async/staleness_max"] for h in sync["history"]] == [0.0, 0.0]
    for k in ("reward", "pg_loss", "grad_norm"):
        assert sync["history"][0][k] == off["history"][0][k], k
    with pytest.raises(Exception, match="max_staleness=0"):
        _run(_rl_cfg(tmp_path / "strict", "rl.steps=2", "rl.mode=one_step_off", "rl.max_staleness=0"))
