"""PNG plots of a run (matplotlib, headless)."""

from __future__ import annotations

import os

from megadare.trainer.monitor import jsonl_records


def step_rewards(run_dir: str) -> dict[int, float]:
    """Mean rollout reward of every RL step of a run, from its ``metrics.jsonl`` (each step once, across resumes:
    a resumed run's own history holds only the steps it trained)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    records = [r for _, r in jsonl_records(path)] if os.path.exists(path) else []
    return {int(r["step"]): float(r["reward"]) for r in records if r is not None and "reward" in r}


def plot_rl_curve(rewards: dict[int, float], evals: dict[int, dict[str, float]], path: str, title: str = "RL") -> str:
    """Mean rollout reward per RL step (``rewards``: step -> reward), with held-out accuracy at the evaluated
    steps, written to ``path``."""
    import matplotlib  # heavy: only the demo plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): headless

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    steps = sorted(rewards)
    ax.plot(steps, [rewards[s] for s in steps], label="rollout reward (train prompts)")
    if evals:
        xs = sorted(evals)
        ax.plot(xs, [evals[x]["accuracy"] for x in xs], "o--", label="held-out accuracy (greedy)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
    return path
