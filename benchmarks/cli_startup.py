"""How fast ``megadare`` answers ``--help`` and refuses a bad config: CPU and wall seconds of one subprocess per case
and the number of modules it imported, against a baseline that imports megadare's full stack (the trainers, the
rollout, the CLI) in a subprocess of the same run. A config error that the config layer finds (a key, a type, a
choice, a range, an algo.name or lora.targets name, model.hf_path, a missing data file) is refused before torch
loads, a small fraction of the baseline; the cross-checks against the model (trainer/checks.py) are found after it.
``megadare plan`` (README "Planner") runs to its table: torch loads, megatron and the checkpoint I/O do not.
With ``--before DIR`` (a checkout of an older commit, e.g. ``git worktree add /tmp/old HEAD~3``) every case also
runs on that code in the same run, for a before / after comparison under one load. Prints a table; asserts nothing
(timings depend on the machine's load).

    python benchmarks/cli_startup.py            # every case once
    python benchmarks/cli_startup.py --repeat 3 # the least CPU time of 3 runs per case
    python benchmarks/cli_startup.py --before /tmp/old
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_RL = os.path.join(ROOT, "megadare", "configs", "demo_rl.yaml")
README_SFT = os.path.join(ROOT, "examples", "configs", "sft_sdar_tiny.yaml")  # README "Quick start"
PLAN_SDAR30B = os.path.join(ROOT, "examples", "configs", "plan_sdar30b.yaml")  # README "Planner"

# the child: run ``megadare ARGS`` (as ``python -m megadare``) and write how many modules it imported, and
# whether the heavy ones are among them, to the file named in MEGADARE_BENCH_OUT, at exit
_CHILD = (
    "import atexit, os, runpy, sys\n"
    "def _count():\n"
    "    heavy = [m for m in ('torch', 'megatron', 'ray', 'transformers') if m in sys.modules]\n"
    "    open(os.environ['MEGADARE_BENCH_OUT'], 'w').write(f\"{len(sys.modules)} {','.join(heavy) or '-'}\")\n"
    "atexit.register(_count)\n"
    "sys.argv = ['megadare'] + sys.argv[1:]\n"
    "runpy.run_module('megadare', run_name='__main__')\n"
)
_BASELINE = (
    "import atexit, os, sys\n"
    "import megadare.cli, megadare.trainer.rl, megadare.trainer.sft_loop, megadare.trainer.dpo_loop, megadare.eval\n"
    "heavy = [m for m in ('torch', 'megatron', 'ray', 'transformers') if m in sys.modules]\n"
    "open(os.environ['MEGADARE_BENCH_OUT'], 'w').write(f\"{len(sys.modules)} {','.join(heavy) or '-'}\")\n"
)


def _variant(src: str, out_dir: str, name: str, edit) -> str:
    """A copy of the YAML config ``src`` with ``edit`` applied to its dict, written to ``out_dir/name.yaml``."""
    with open(src) as f:
        cfg = yaml.safe_load(f)
    edit(cfg)
    path = os.path.join(out_dir, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def _set(section: str, **kv):
    def edit(cfg: dict) -> None:
        cfg.setdefault(section, {}).update(kv)

    return edit


def cases(tmp: str) -> list[tuple[str, list[str]]]:
    """(name, megadare arguments) of every case."""
    missing = os.path.join(tmp, "no_such_file.jsonl")
    typo = _variant(DEMO_RL, tmp, "rl_typo", _set("rollout", temprature=1.0))
    bad = _variant(DEMO_RL, tmp, "rl_bad", _set("model", dtype="fp17"))
    cross = _variant(DEMO_RL, tmp, "rl_cross", _set("optim", lr=-1.0))
    no_data = _variant(DEMO_RL, tmp, "rl_nodata", _set("data", synthetic=None, path=missing))
    algo = _variant(DEMO_RL, tmp, "rl_algo", _set("algo", name="tracrl"))
    lora = _variant(DEMO_RL, tmp, "rl_lora", _set("lora", rank=8, targets=["linear_qkvv"]))
    sft_typo = _variant(README_SFT, tmp, "sft_typo", _set("optim", learning_rate=1e-4))
    return [
        ("megadare --help", ["--help"]),
        ("megadare sft --help", ["sft", "--help"]),
        ("rl demo_rl: unknown key", ["rl", "--config", typo]),
        ("rl demo_rl: bad value", ["rl", "--config", bad]),
        ("rl demo_rl: algo.name typo", ["rl", "--config", algo]),
        ("rl demo_rl: lora.targets typo", ["rl", "--config", lora]),
        ("rl demo_rl: missing data file", ["rl", "--config", no_data]),
        ("eval demo_rl: missing task file", ["eval", "--config", DEMO_RL, "--tasks", missing]),
        ("rl demo_rl: cross-check lr<0", ["rl", "--config", cross]),  # config/rules.py
        ("sft README example: unknown key", ["sft", "--config", sft_typo]),
        ("plan sdar30b (README Planner)", ["plan", "--config", PLAN_SDAR30B]),  # a whole plan: config.json only
    ]


def measure(code: str, args: list[str], repeat: int, root: str = ROOT) -> tuple[float, float, str, int]:
    """(least CPU s, its wall s, modules imported + the heavy ones, exit status) of ``python -c code args`` run in
    ``root`` (whose megadare it imports)."""
    best = None
    with tempfile.NamedTemporaryFile("r", suffix=".txt") as out:
        env = dict(os.environ, MEGADARE_BENCH_OUT=out.name)
        for _ in range(repeat):
            before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
            rc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, cwd=root).returncode
            wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            if best is None or cpu < best[0]:
                best = (cpu, wall, open(out.name).read().strip(), rc)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1, help="runs per case; the least CPU time is shown")
    ap.add_argument("--before", help="a checkout of older code: each case runs on it too, in this run")
    args = ap.parse_args()
    repeat, before = args.repeat, args.before and os.path.abspath(args.before)
    load = os.getloadavg()[0]
    print(f"load average (1 min) {load:.2f} on {os.cpu_count()} CPUs; least CPU time of {repeat} run(s)")
    base_cpu, base_wall, base_mods, _ = measure(_BASELINE, [], repeat)
    extra = f" {'before':>7s} {'rc':>3s}  before: modules (heavy)" if before else ""
    print(f"{'case':34s} {'rc':>3s} {'CPU s':>7s} {'wall s':>7s} {'x base':>7s}  {'modules (heavy ones)':24s}{extra}")
    print(f"{'baseline: import the full stack':34s} {'':>3s} {base_cpu:7.2f} {base_wall:7.2f} {1:7.2f}  {base_mods}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, case_args in cases(tmp):
            cpu, wall, mods, rc = measure(_CHILD, case_args, repeat)
            row = f"{name:34s} {rc:3d} {cpu:7.2f} {wall:7.2f} {cpu / base_cpu:7.2f}  {mods:24s}"
            if before:
                b_cpu, _, b_mods, b_rc = measure(_CHILD, case_args, repeat, before)
                row += f" {b_cpu:7.2f} {b_rc:3d}  {b_mods}"
            print(row.rstrip())


if __name__ == "__main__":
    main()
