"""The demo task for every algorithm of the zoo: one SFT checkpoint per model family (megadare/configs/demo_sft.yaml),
then the demo's RL stage (demo_rl.yaml, 30 steps, with the algorithm's own demo settings, megadare.demo_setup.ALGO_DEMO)
for each algorithm from it; prints per algorithm the held-out accuracy before -> after, the gain and the minutes.

    python benchmarks/demo_sweep.py [--algos d1,tracerl] [--workdir runs/sweep] [--rl-steps 30] [key=value ...]

The full-attention algorithms (JustGRPO, ESPO) run on the tiny LLaDA (``megadare demo --family llada``), the rest on
the tiny SDAR (block diffusion, the demo's default). Runs one after the other; each result line is printed as it
comes (and the table at the end). Minutes are wall-clock on whatever machine runs it (shared or not).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FULL_ATTENTION = {"justgrpo": "llada", "espo": "llada"}  # README: these need a full-attention family


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algos", default=None, help="comma-separated (default: every registered algorithm)")
    ap.add_argument("--workdir", default="runs/sweep")
    ap.add_argument("--sft-steps", type=int, default=None)
    ap.add_argument("--rl-steps", type=int, default=None)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    from megadare.algos import REGISTRY
    from megadare.demo_setup import DemoRun
    from megadare.parallel.launch import spawn
    from megadare.trainer.rl import rl_worker
    from megadare.trainer.sft_loop import sft_worker

    algos = a.algos.split(",") if a.algos else sorted(REGISTRY)
    rows = []
    for family in sorted({FULL_ATTENTION.get(x, "sdar") for x in algos}):
        work = os.path.join(a.workdir, family)
        sft_cfg, _ = DemoRun(work, a.sft_steps, a.rl_steps, "tracerl", 1, tuple(a.overrides), family).configs()
        if not os.path.exists(os.path.join(work, "sft", "ckpt", "latest_checkpointed_iteration.txt")):
            t0 = time.time()
            spawn(sft_worker, 1, sft_cfg, timeout_s=3600)
            print(f"SFT {family}: {(time.time() - t0) / 60:.1f} min", flush=True)
        for algo in [x for x in algos if FULL_ATTENTION.get(x, "sdar") == family]:
            _, cfg = DemoRun(work, a.sft_steps, a.rl_steps, algo, 1, tuple(a.overrides), family).configs()
            cfg.logging.run_dir = os.path.join(work, f"rl_{algo}")
            t0 = time.time()
            evals = spawn(rl_worker, 1, cfg, timeout_s=3600)[0]["evals"]
            before, after = evals[min(evals)]["accuracy"], evals[max(evals)]["accuracy"]
            rows.append((algo, family, before, after, (time.time() - t0) / 60))
            print(
                f"{algo:15s} {family:6s} held-out {before:.2f} -> {after:.2f} ({after - before:+.2f}) "
                f"{rows[-1][-1]:.1f} min",
                flush=True,
            )
    print(f"\n{'algorithm':15s} {'family':6s} {'SFT acc':>8s} {'RL acc':>7s} {'gain':>6s} {'minutes':>8s}")
    for algo, family, before, after, minutes in rows:
        print(f"{algo:15s} {family:6s} {before:8.2f} {after:7.2f} {after - before:+6.2f} {minutes:8.1f}")


if __name__ == "__main__":
    main()
