"""Reward for the real-Slurm RL runs (rl.reward=slurm_reward:parity; tests/slurm is on the jobs' PYTHONPATH).

A random tiny model never solves the math prompts, so the math reward would give every sample 0: every group
filtered, no update. This one is 0 or 1 by the parity of the response's bytes: groups with both, real advantages,
real updates (deterministic, so a resumed run scores the same responses the same way)."""


def parity(response: str, record: dict) -> float:
    return float(sum(map(ord, response)) % 2)
