"""Wall-clock per RL step: synchronous vs one-step-off (the next rollout overlaps this step's training), same
config, same process tree, one run after the other.

    python benchmarks/async_speedup.py [--steps 8] [--nproc 1] [key=value ...]

Uses the demo's RL config (tiny SDAR, reverse task, built-in engine in one Ray actor) unless overridden. On a
machine where the engine and the trainer share the same cores (a 2-core laptop) the overlap buys little; with the
engine on its own GPU it hides the rollout behind training. Prints mean step time, rollout wait, and the ratio.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from importlib import resources

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    from megadare.config import load_config
    from megadare.parallel.launch import spawn
    from megadare.trainer.rl import rl_worker

    base = str(resources.files("megadare") / "configs" / "demo_rl.yaml")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sync", "one_step_off"):
            cfg = load_config(base, [f"logging.run_dir={tmp}/{mode}", f"rl.steps={a.steps}", f"rl.mode={mode}",
                                     "rl.eval_size=8", "checkpoint.save_interval=0", *a.overrides])
            hist = spawn(rl_worker, a.nproc, cfg, timeout_s=3600)[0]["history"][1:]  # skip the warm-up step
            n = max(len(hist), 1)
            rows[mode] = {k: sum(h[k] for h in hist) / n for k in ("step_time_s", "rollout_wait_s", "sync_s")}
    print(f"{'mode':14s} {'step s':>8s} {'rollout wait s':>15s} {'sync s':>8s}")
    for mode, r in rows.items():
        print(f"{mode:14s} {r['step_time_s']:8.3f} {r['rollout_wait_s']:15.3f} {r['sync_s']:8.3f}")
    print(f"one_step_off / sync step time: {rows['one_step_off']['step_time_s'] / rows['sync']['step_time_s']:.2f}")


if __name__ == "__main__":
    main()
