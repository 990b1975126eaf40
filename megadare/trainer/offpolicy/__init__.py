"""Asynchronous (off-policy) RL: rollouts that run ahead of training, and the corrections that make their samples
usable.

queue.py          ``offpolicy.mode``: the rollout queue (lookahead, partial rollouts) and the behaviour weight snapshots
correction.py     the wiring inside the RL loop: behaviour log-probs, per-slot IS weights, replay match scores
settings.py       the off-policy settings checked against each other before a run (torch-free)
importance.py     the formulas: truncated / rejected importance weights, decoupled and bypass PPO losses
replay.py         the replay buffer: the last K behaviour versions' samples, selection, save / load
replay_scores.py  its variance-guided scores and multi-behaviour (balance-heuristic, per-version) weights
"""
