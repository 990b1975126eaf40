"""RL on DARE's RL files as they are (a math + countdown mix, ``rl.reward=auto``) on the demo-sized model, and the
stop before the update when a reward cannot be computed (on every rank)."""

from __future__ import annotations

import glob
import json
import os

import pytest

from dare_files import countdown_rows, math_rows, rl_row, write_parquet
from dist import reward_error_on_every_rank
from ray_fixture import ray_cluster  # noqa: F401  (module-scoped local Ray cluster)

from megadare.config import load_config
from megadare.parallel.launch import WorkerError, spawn

pytestmark = pytest.mark.timeout(600)


def _cfg(tmp, paths, *over):
    from importlib import resources

    base = resources.files("megadare") / "configs" / "demo_rl.yaml"
    return load_config(
        str(base),
        [
            f"logging.run_dir={tmp}",
            "data.synthetic=null",
            f"data.path=[{','.join(paths)}]",
            f"data.eval_path={paths[0]}",
            "data.shuffle=false",
            "rl.reward=auto",
            "rl.steps=2",
            "rl.eval_size=2",
            "rl.prompts_per_step=3",
            "rl.n_samples=2",
            "rollout.max_new_tokens=8",
            "train.micro_batch_size=2",
            "checkpoint.save_interval=1",
            *over,
        ],
    )


@pytest.mark.usefixtures("ray_cluster")
def test_rl_on_a_dare_mix_then_a_failing_reward_stops_before_the_update(tmp_path):
    """Step 1 trains on math + countdown rows scored by their own rules; step 2 meets a countdown row whose
    numbers are not JSON: the run stops there, before the update, naming the reward, the row and the exception."""
    from megadare.trainer.rl import rl_worker

    broken = rl_row("countdown", "Use [1, 3] to make 4.", "4", 7, numbers="[1, 3")
    paths = [
        write_parquet(tmp_path / "math.parquet", math_rows(2)),
        write_parquet(tmp_path / "countdown.parquet", countdown_rows(2) + [broken]),
    ]
    with pytest.raises(WorkerError) as err:  # rows: math 0, 1, countdown 0 | countdown 1, broken, math 0
        spawn(rl_worker, 1, _cfg(tmp_path / "run", paths), None, timeout_s=600)
    message = str(err.value)
    assert "RewardError: RL step 2: reward 'auto' could not be computed for 2 of 6 samples" in message
    assert f"first failure: {paths[1]}:row 3: ValueError: countdown numbers must be a JSON list" in message
    logged = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [m for m in logged if "reward" in m]  # (step 0 is the held-out evaluation)
    assert [s["step"] for s in steps] == [1] and steps[0]["reward_errors"] == 0
    assert 0.0 <= steps[0]["reward"] <= 1.0
    ckpts = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "run" / "ckpt" / "iter_*")))
    assert ckpts == ["iter_0000001"], ckpts  # step 1 updated and saved; step 2 did not update


def test_the_loops_scorer_rewards_correct_answers_by_their_rule(tmp_path):
    from megadare.data.prompt_data import load_rl_prompts
    from megadare.data.tokenizer import ByteTokenizer
    from megadare.rewards import load_reward
    from megadare.rollout.engine import SamplingParams, Trajectory
    from megadare.trainer.reward_step import score_rollouts

    paths = [
        write_parquet(tmp_path / "math.parquet", math_rows()),
        write_parquet(tmp_path / "countdown.parquet", countdown_rows()),
    ]
    cfg = _cfg(tmp_path / "run", paths)
    tok = ByteTokenizer()
    train, _ = load_rl_prompts(cfg, tok)
    texts = [
        "\\boxed{2}",
        "so \\boxed{4}",
        "The answer is 7",
        "<answer>1+3</answer>",
        "<answer>2*4</answer>",
        "<answer>9</answer>",
    ]
    traj = [
        Trajectory(
            prompt_ids=p.prompt_ids,
            response_ids=tok.encode(t),
            commit_step=[0] * len(t),
            block_step=[0] * len(t),
            logprobs=[0.0] * len(t),
            finish_reason="stop",
            num_forwards=1,
            params=SamplingParams(),
        )
        for p, t in zip(train, texts)
    ]
    scores, stats = score_rollouts(cfg, load_reward(cfg.rewards.name), tok, traj, train, "check")
    assert scores == [1.0, 1.0, 0.0, 1.0, 0.1, 0.1] and stats["errors"] == 0


def test_every_rank_stops_not_only_rank0():
    assert spawn(reward_error_on_every_rank, 2, timeout_s=120) == [
        f"rank {r}: reward 'auto' failed at data.parquet:row 5" for r in (0, 1)
    ]
