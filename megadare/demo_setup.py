"""`megadare demo`'s options, runs and work directory, torch-free: a work directory the demo refuses (another
demo's, or one holding the user's files) is refused in a second, before torch, megatron and ray load (megadare.demo
runs it)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from importlib import resources
from typing import Optional

from megadare.config import Config, load_config
from megadare.errors import RunStateError
from megadare.options import positive_int

DESCRIPTION = """`megadare demo`: SFT then RL of a tiny block-diffusion model on CPU, through the real path.

1. SFT (megadare/configs/demo_sft.yaml): a tiny random SDAR (block diffusion, block 4) learns to reverse
   3-letter strings from noisy demonstrations -- half of them copy the string instead -- so it imitates the
   mistake.
2. RL (megadare/configs/demo_rl.yaml): the SFT checkpoint is trained with a zoo algorithm (TraceRL by
   default) and a verifiable reward (exact match with the true reversal): a Megatron actor, a Ray-managed
   built-in rollout engine, weights synced into the engine every step.
3. Held-out accuracy (strings never seen in SFT or RL, greedy decoding) before and after RL; tensorboard logs
   and ``reward_curve.png`` under the work directory. The last line reads

       held-out accuracy: SFT <a> -> RL <b>

``--family sdar|llada|dream|llada2`` runs the same task on a tiny model of that family (full-attention algorithms
such as JustGRPO need LLaDA or Dream: ``megadare demo --family llada --algo justgrpo``).
``megadare demo --foundation`` runs the conversion / parallelism demo of the foundation instead.

Outputs go to ``runs/demo`` (SDAR, TraceRL) or ``runs/demo_<family>_<algo>``; a rerun of the same demo resumes
there, and a work directory holding another family's or algorithm's demo is refused (``--workdir``).
"""

# ``--family``: a tiny model of that family on the same task. Full-attention families (LLaDA, Dream) train with
# random-masking SFT and decode the 4-token answer as one semi-AR block; block families keep the 4-token block.
FAMILIES = {
    "sdar": [],
    "llada2": ["model.family=llada2"],
    "llada": ["model.family=llada", "model.block_size=null", "sft.mode=random", "rollout.block_size=4"],
    "dream": ["model.family=dream", "model.block_size=null", "sft.mode=random", "rollout.block_size=4"],
}
# what an algorithm's rollout contract needs on the demo task (JustGRPO: autoregressive order; ESPO: its
# published RLOO advantages and several updates per rollout, each on its own masks)
ALGO_DEMO = {
    "justgrpo": ["rollout.block_size=1", "rollout.steps_per_block=1"],
    "espo": ["advantage.estimator=rloo", "rl.ppo_epochs=4"],
}


@dataclass(frozen=True)
class DemoRun:
    """One demo run as the user asked for it: outputs under ``workdir``; the step counts (None: the YAML's); the RL
    algorithm; the trainer processes; key=value overrides for both stages (``rl.*`` / ``sft.*`` for one); the tiny
    model family."""

    workdir: str
    sft_steps: Optional[int] = None
    rl_steps: Optional[int] = None
    algo: str = "tracerl"
    nproc: int = 1
    overrides: tuple[str, ...] = ()
    family: str = "sdar"

    def configs(self) -> tuple[Config, Config]:
        """(SFT config, RL config) of the demo, with outputs under ``workdir``."""
        base = resources.files("megadare") / "configs"
        if self.family not in FAMILIES:
            raise ValueError(f"--family {self.family!r}: choose one of {sorted(FAMILIES)}")
        fam, workdir = FAMILIES[self.family], self.workdir
        sft_over = fam + [f"logging.run_dir={workdir}/sft"]
        if self.sft_steps:  # a short SFT warms up for at most its own length (demo_sft.yaml: 10 steps)
            sft_over += [f"train.steps={self.sft_steps}", f"optim.warmup_steps={min(self.sft_steps, 10)}"]
        rl_over = (
            fam
            + ALGO_DEMO.get(self.algo, [])
            + [f"logging.run_dir={workdir}/rl", f"checkpoint.load={workdir}/sft/ckpt", f"algo.name={self.algo}"]
        )
        rl_over += [f"rl.steps={self.rl_steps}"] if self.rl_steps else []
        if self.nproc > 1:
            sft_over.append(f"parallel.world_size={self.nproc}")
            rl_over.append(f"parallel.world_size={self.nproc}")
        overrides = list(self.overrides)
        sft = load_config(
            str(base / "demo_sft.yaml"),
            [o for o in sft_over if not o.startswith("rollout.")] + [o for o in overrides if not o.startswith("rl.")],
        )
        rl = load_config(
            str(base / "demo_rl.yaml"),
            [o for o in rl_over if not o.startswith("sft.")] + [o for o in overrides if not o.startswith("sft.")],
        )
        return sft, rl


def default_workdir(family: str, algo: str) -> str:
    """``runs/demo`` for the default demo (SDAR, TraceRL), ``runs/demo_<family>_<algo>`` for any other: one demo
    never resumes another's checkpoints."""
    return "runs/demo" if (family, algo) == ("sdar", "tracerl") else f"runs/demo_{family}_{algo}"


DEMO_OUTPUTS = ("sft", "rl", "reward_curve.png")  # what a demo writes into its work directory


def check_workdir(demo: DemoRun) -> None:
    """Refuse a work directory holding anything a demo does not write (the demo writes sft/, rl/ and the PNG into
    it, replacing a reward_curve.png), or whose runs are another family's or algorithm's demo: resuming them would
    report that demo's accuracy under this one's name."""
    wd = demo.workdir
    if os.path.lexists(wd) and not os.path.isdir(wd):
        raise RunStateError(f"--workdir {wd}: is a file, not a directory; pass --workdir NEW_DIR")
    foreign = sorted(set(os.listdir(wd)) - set(DEMO_OUTPUTS)) if os.path.isdir(wd) else []
    if foreign:
        raise RunStateError(
            f"{wd} holds {os.path.join(wd, foreign[0])}, which no demo writes: the demo writes "
            f"{', '.join(DEMO_OUTPUTS)} there; pass --workdir NEW_DIR (a new or empty directory)"
        )
    for stage in ("sft", "rl"):
        path = os.path.join(demo.workdir, stage, "config.yaml")
        if not os.path.exists(path):
            continue
        old = load_config(path, [])
        was, now = (old.model.family, old.algo.name), (demo.family, demo.algo)
        if was[0] != now[0] or (stage == "rl" and was[1] != now[1]):
            what = f"{was[1]} on a tiny {was[0]}" if stage == "rl" else f"a tiny {was[0]}"
            raise RunStateError(
                f"{demo.workdir} holds the demo of {what} ({path}); pass --workdir NEW_DIR to run {now[1]} on a "
                f"tiny {now[0]}"
            )


def parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The demo's options (``megadare demo`` builds it with its one-line-error parser class)."""
    ap = parser_class(
        prog="megadare demo", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--workdir", help="outputs: checkpoints, tensorboard, PNG (default: runs/demo, or runs/demo_<family>_<algo>)"
    )
    ap.add_argument("--algo", default="tracerl", help="RL algorithm (megadare.algos.REGISTRY)")
    ap.add_argument("--family", default="sdar", choices=sorted(FAMILIES), help="tiny model family")
    ap.add_argument(
        "--sft-steps", type=positive_int, default=None, help="SFT steps (default: the demo config's train.steps)"
    )
    ap.add_argument(
        "--rl-steps", type=positive_int, default=None, help="RL steps (default: the demo config's rl.steps)"
    )
    ap.add_argument("--nproc", type=positive_int, default=1, help="trainer processes (e.g. 2 with parallel.tp=2)")
    ap.add_argument("--foundation", action="store_true", help="run the conversion / parallelism demo instead")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for both stages (rl.* / sft.* for one)")
    return ap


def demo_run(args: argparse.Namespace) -> DemoRun:
    """The run ``parser()``'s ``args`` ask for (``--workdir``: the demo's own by default)."""
    workdir = args.workdir or default_workdir(args.family, args.algo)
    return DemoRun(workdir, args.sft_steps, args.rl_steps, args.algo, args.nproc, tuple(args.overrides), args.family)


def stopped_line(demo: DemoRun) -> str:
    """The line of a demo a SIGTERM (``scancel``) stopped outside its stages' loops (its set-up, between SFT and
    RL): what its stages saved (each ``<stage>/ckpt``'s newest checkpoint) is kept, and a rerun resumes it."""
    kept = []
    for stage in ("sft", "rl"):
        tracker = os.path.join(demo.workdir, stage, "ckpt", "latest_checkpointed_iteration.txt")
        try:
            with open(tracker) as f:
                kept.append(f"{stage.upper()} at step {int(f.read().strip())}")
        except (OSError, ValueError):  # none written yet (or unreadable: the rerun's resume says why)
            continue
    if not kept:
        return "demo stopped by SIGTERM before its first step: nothing to save; run the same command again"
    return (
        f"demo stopped by SIGTERM between steps: nothing new to save, its checkpoints kept ({', '.join(kept)}); run "
        "the same command again to resume it"
    )
