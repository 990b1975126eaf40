"""Benchmark evaluation of diffusion LMs: gsm8k, math500, aime24, aime25, humaneval, mbpp, countdown and sudoku (or
any file of DARE rows given as a task) from local files; and ``megadare data inspect``.

    megadare eval --model /ckpt/hf --tasks gsm8k,math500 eval.data_dir=/data/bench eval.n_samples=4 eval.k=[1,4]

* :mod:`.tasks`: the task registry (row fields, prompt templates of the anchor projects, reward, extraction);
* :mod:`.files`: locating ``<eval.data_dir>/<task>.jsonl|.parquet`` / ``eval.paths``, rows with their
  ``file:line``, atomic output files;
* :mod:`.metrics`: mean@n, unbiased pass@k (Chen et al. 2021), maj@k, response length, forwards per token;
* :mod:`.runner`: the command: Ray rollout engines (as in RL), the shared RL rewards, JSONL + summary.json;
* :mod:`.data_inspect`: ``megadare data inspect``, what a run would read from data files.
"""

from megadare.eval.metrics import maj_at_k, majority_winner, pass_at_k, task_metrics
from megadare.eval.runner import run_eval_command
from megadare.eval.tasks import TASKS, TaskSpec, task_spec

__all__ = [
    "run_eval_command",
    "pass_at_k",
    "maj_at_k",
    "majority_winner",
    "task_metrics",
    "TASKS",
    "TaskSpec",
    "task_spec",
]
