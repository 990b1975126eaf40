"""`megadare demo`: SFT then RL of a tiny block-diffusion model on CPU, through the real path (what it does and
its outputs: ``megadare.demo_setup.DESCRIPTION``, its ``--help``). Its options, runs and work directory are
checked in megadare/demo_setup.py, torch-free; here they run."""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import Callable, Optional

from megadare import demo_foundation
from megadare.demo_setup import DemoRun, check_workdir, demo_run, parser
from megadare.errors import StoppedBeforeTheLoop
from megadare.parallel.launch import spawn
from megadare.trainer.plots import plot_rl_curve, step_rewards
from megadare.trainer.rl import rl_worker
from megadare.trainer.sft_loop import sft_worker
from megadare.trainer.spec import resolve


def run_demo(demo: DemoRun, on_start: Callable[[], None] = lambda: None) -> dict:
    """SFT -> RL (``on_start`` once both configs are accepted); returns {'sft_accuracy', 'rl_accuracy',
    'history', 'evals', 'png', 'seconds'}, or {'stopped': the stage and step} where a SIGTERM stopped a stage (it
    saved a checkpoint; the demo's rerun resumes it): the next stage did not start."""
    check_workdir(demo)
    t0 = time.time()
    sft_cfg, rl_cfg = demo.configs()
    for cfg, job in ((sft_cfg, "sft"), (rl_cfg, "rl")):  # both stages' configs: a wrong RL one fails before SFT
        resolve(cfg, demo.nproc, job=job)
    on_start()
    sft = spawn(sft_worker, demo.nproc, sft_cfg, timeout_s=3600)[0]
    if sft["stopped_by_signal"]:  # a SIGTERM (scancel): the stage saved and stopped, and so does the demo
        return {"stopped": f"SFT at step {sft['step']}"}
    try:
        out = spawn(rl_worker, demo.nproc, rl_cfg, timeout_s=3600)[0]
    except StoppedBeforeTheLoop as stop:  # SFT finished and saved: not the command's "nothing new to save"
        if stop.__context__ is not None:  # an error was on its way out: the command reports it
            raise
        return {"stopped": f"RL's set-up, after SFT finished at step {sft['step']}"}
    if out["stopped_by_signal"]:
        return {"stopped": f"RL at step {out['step']}"}
    evals = out["evals"]
    first, last = min(evals), max(evals)
    png = plot_rl_curve(
        step_rewards(rl_cfg.logging.run_dir),  # every step, also when this run resumed
        evals,
        os.path.join(demo.workdir, "reward_curve.png"),
        title=f"{demo.algo} on a tiny {demo.family} (reverse task)",
    )
    return {
        "sft_accuracy": evals[first]["accuracy"],
        "rl_accuracy": evals[last]["accuracy"],
        "history": out["history"],
        "evals": evals,
        "png": png,
        "seconds": time.time() - t0,
    }


def main(argv: Optional[list[str]] = None, ap: Optional[argparse.ArgumentParser] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--foundation" in argv:
        argv.remove("--foundation")
        return demo_foundation.main(argv)
    demo = demo_run((ap or parser()).parse_args(argv))
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    warnings.filterwarnings("ignore")
    heading = f"megadare demo: SFT then RL ({demo.algo}) of a tiny {demo.family} on CPU; outputs in {demo.workdir}"
    res = run_demo(demo, on_start=lambda: print(heading, flush=True))
    if "stopped" in res:
        print(
            f"demo stopped by SIGTERM during {res['stopped']} (its checkpoint saved); run the same command again "
            "to resume it",
            flush=True,
        )
        return 0
    print(f"reward curve: {res['png']}; tensorboard: tensorboard --logdir {demo.workdir}; {res['seconds']:.0f} s")
    print(f"held-out accuracy: SFT {res['sft_accuracy']:.2f} -> RL {res['rl_accuracy']:.2f}")
    return 0
