"""Sync vs asynchronous RL on the demo task, in one run: the same SFT checkpoint trained with offpolicy.mode=sync,
one_step_off and fully_async (max_staleness 2, decoupled IS); prints, per mode, held-out accuracy before -> after,
the rollout reward of the first and last quarter of the steps, and wall-clock per step (mean, rollout wait,
weight sync), plus the ratio of each mode's step time to sync's.

    python benchmarks/async_speedup.py [--sft-steps 500] [--rl-steps 30] [--nproc 1] [key=value ...]

Tiny SDAR, reverse task, built-in engine in one Ray actor (megadare/configs/demo_*.yaml). On a machine where the
engine and the trainer share the same cores (a 2-core laptop) the overlap buys little; with the engine on its own
GPU it hides the rollout behind training.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = {
    "sync": ["offpolicy.mode=sync"],
    "one_step_off": ["offpolicy.mode=one_step_off"],
    "fully_async": [
        "offpolicy.mode=fully_async",
        "offpolicy.max_staleness=2",
        "offpolicy.loss_mode=decoupled",
        "offpolicy.rollout_is=token",
    ],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft-steps", type=int, default=500)
    ap.add_argument("--rl-steps", type=int, default=30)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    from megadare.demo_setup import DemoRun
    from megadare.parallel.launch import spawn
    from megadare.trainer.rl import rl_worker
    from megadare.trainer.sft_loop import sft_worker

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        sft_cfg, _ = DemoRun(tmp, a.sft_steps, a.rl_steps, "tracerl", a.nproc, tuple(a.overrides)).configs()
        spawn(sft_worker, a.nproc, sft_cfg, timeout_s=3600)
        for mode, over in MODES.items():
            _, cfg = DemoRun(
                tmp, a.sft_steps, a.rl_steps, "tracerl", a.nproc, (*a.overrides, *over, "checkpoint.save_interval=0")
            ).configs()
            cfg.logging.run_dir = os.path.join(tmp, f"rl_{mode}")
            out = spawn(rl_worker, a.nproc, cfg, timeout_s=3600)[0]
            hist, evals = out["history"], out["evals"]
            q = max(len(hist) // 4, 1)
            timed = hist[1:] or hist  # skip the warm-up step
            n = len(timed)
            rows[mode] = {
                "acc0": evals[min(evals)]["accuracy"],
                "acc1": evals[max(evals)]["accuracy"],
                "r0": sum(h["reward"] for h in hist[:q]) / q,
                "r1": sum(h["reward"] for h in hist[-q:]) / q,
                **{k: sum(h.get(k, 0.0) for h in timed) / n for k in ("step_time_s", "rollout_wait_s", "sync_s")},
            }
    print(
        f"{'mode':13s} {'held-out acc':>14s} {'reward 1st->last q':>19s} {'step s':>7s} {'wait s':>7s} "
        f"{'sync s':>7s} {'vs sync':>8s}"
    )
    base = rows["sync"]["step_time_s"]
    for mode, r in rows.items():
        print(
            f"{mode:13s} {r['acc0']:6.2f} -> {r['acc1']:4.2f} {r['r0']:9.2f} -> {r['r1']:5.2f} "
            f"{r['step_time_s']:7.3f} {r['rollout_wait_s']:7.3f} {r['sync_s']:7.3f} {r['step_time_s'] / base:8.2f}"
        )


if __name__ == "__main__":
    main()
