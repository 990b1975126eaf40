"""The demo's reward_curve.png: drawn from the run's metrics.jsonl, so a resumed demo plots every step."""

import json

from megadare.trainer.plots import plot_rl_curve, step_rewards


def test_a_resumed_runs_curve_has_every_step_at_its_own_step(tmp_path):
    # `megadare demo` run again after it finished (or after a stop at step 2) plotted only the steps that process
    # trained, at 1..k: an empty reward curve, or steps 3..4 drawn at 1..2
    rows = [{"step": 0, "eval/accuracy": 0.28}] + [{"step": s, "reward": s / 4} for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rewards = step_rewards(str(tmp_path))
    assert rewards == {1: 0.25, 2: 0.5, 3: 0.75, 4: 1.0}
    png = plot_rl_curve(rewards, {0: {"accuracy": 0.28}, 4: {"accuracy": 1.0}}, str(tmp_path / "curve.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert step_rewards(str(tmp_path / "no_run")) == {}
