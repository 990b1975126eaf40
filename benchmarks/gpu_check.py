"""megadare on one CUDA GPU in one command: time-boxed steps, each recording a result, none stopping the rest.

    python benchmarks/gpu_check.py                                 # every step, on the GPU, 560 s in all
    python benchmarks/gpu_check.py --carry benchmarks/carry --only env,parity,attention,engine,sft
    python benchmarks/gpu_check.py --device cpu --tiny             # the same plumbing on a CPU (CI runs a part)

Steps, in order of value (``--only`` picks, the budget cuts from the end):
  env        versions, the GPU, which of megadare's requirements import
  parity     per family: Megatron (world size 1, NCCL) and hf/ logits vs the float64 reference, fp32 and bf16
  attention  FlexAttention == SDPA == float64 kernels, flex compiles once per mask structure, and a Megatron
             model with megatron's local attention == SDPA == flex on the training and the inference mask
  engine     the built-in engine on the GPU vs on the CPU (greedy tokens), cached vs uncached
  sft        `megadare sft` 20 bf16 steps (the loss falls) and a resume
  train      benchmarks/train_throughput.py: SDAR-1.7B shape, seq 2048: first batch 4 with SDPA and each step fusion
             (--variants base gradfusion fused all: models/step_fusions.py; fused: SwiGLU, residual add, RMSNorm,
             RoPE), flex and a small MoE with and without them and its experts' grouped GEMMs (grouped,
             fusedgrouped: models/experts.py), then batch 1 with local / sdpa / flex
  rollout    benchmarks/rollout_throughput.py: SDAR-1.7B shape, batch 32, 128 + 256 new tokens, block 4;
             benchmarks/rollout_compile.py: rollout.compile (CUDA graphs) == eager in fp32, its bf16 speed
  planner    megadare's planner vs torch.cuda.max_memory_allocated of the same train step
  profile    one profiled training run: the top kernels by GPU time (profile_top_kernels.txt); --profile-variant
             picks the step fusions it runs with (train_throughput.py --variants)
  rl         `megadare rl` two steps per weight transport, and colocated with rollout.compile=true (needs Ray:
             carry benchmarks/carry/ray)

Each step runs in its own process group under a timeout (its share of what is left of ``--budget``); a crash, a
hang or an error becomes that step's result and the next step runs. Results go to ``--out`` (default ``$OUT``,
else runs/gpu_check), four files: ``results.json`` (every row), ``summary.md`` (the tables), ``gpu_check.log``
(every step's output), ``profile_top_kernels.txt`` (a step writes its rows to a temporary folder as it goes).
``--carry DIR`` first installs the wheels under DIR (made here by benchmarks/gpu_carry.sh) into a site folder the
steps import from; benchmarks/GPU.md says how they travel.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BUDGET = "@BUDGET@"  # in a step's command: the seconds it has when it starts
LOG_CHARS = 400_000  # of one command's output in gpu_check.log (the file comes back from the device)
ORDER = ["env", "parity", "attention", "engine", "sft", "train", "rollout", "planner", "profile", "rl"]
# seconds each step may take on a GPU (--tiny on a CPU: TINY_TIMEOUTS)
TIMEOUTS = {
    "env": 60,
    "parity": 150,
    "attention": 200,
    "engine": 90,
    "sft": 180,
    "train": 300,
    "rollout": 420,
    "planner": 120,
    "profile": 120,
    "rl": 420,
}
TINY_TIMEOUTS = {
    "env": 120,
    "parity": 300,
    "attention": 300,
    "engine": 300,
    "sft": 600,
    "train": 300,
    "rollout": 300,
    "planner": 300,
    "profile": 300,
    "rl": 900,
}


@dataclass
class Step:
    name: str
    commands: list[list[str]]  # run one after the other, each under what is left of the step's time
    timeout: float
    rows_file: str = ""  # the step's own rows (in-process steps), else rows from the output
    result: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- command lines
def train_commands(py: str, tiny: bool) -> list[list[str]]:
    """benchmarks/train_throughput.py through its command line (the one place that builds it)."""
    tt = os.path.join(HERE, "train_throughput.py")
    dense_sdpa_variants = [py, tt, "--shape", "dense", "--backends", "sdpa", "--variants"]
    moe_backend = [py, tt, "--shape", "moe", "--batch", "4", "--backends"]
    if tiny:  # the variants' plumbing (both fusions in "all"), one step at seq 64
        return [dense_sdpa_variants + ["base", "all", "--batch", "1", "--seq", "64", "--steps", "1"]]
    return [  # the step's timeout cuts from the end: the backend sweep was measured in both earlier sessions
        dense_sdpa_variants + ["base", "gradfusion", "fused", "all", "--batch", "4"],
        [py, tt, "--shape", "dense", "--batch", "4", "--backends", "flex", "--variants", "base", "all"],
        moe_backend + ["sdpa", "--variants", "base", "grouped", "all", "fusedgrouped"],
        moe_backend + ["flex", "--variants", "base", "all"],
        [py, tt, "--shape", "dense", "--batch", "1", "--backends", "local", "sdpa", "flex"],
    ]


def rollout_commands(py: str, tiny: bool) -> list[list[str]]:
    """benchmarks/rollout_throughput.py through its command line (the one place that builds it): SDAR-1.7B shape
    (today's engine runs too, its CUDA failure reported in a line), then the LLaDA-8B (dual cache) and Dream-7B
    shapes, one round each (a full forward of the canvas per step is their cost); then benchmarks/rollout_compile.py:
    ``rollout.compile`` (CUDA graphs) against eager, the trace in fp32 (token for token), the speed in bf16 with a
    profile (each compiles for about 70-80 s on an H200)."""
    rt = os.path.join(HERE, "rollout_throughput.py")
    rc = os.path.join(HERE, "rollout_compile.py")
    if tiny:
        small = ["--batch", "2", "--prompt", "16", "--new", "8", "--rounds", "1"]
        return [
            [py, rt, "--batch", "2", "--prompt", "8", "--new", "8", "--steps", "2"],
            [py, rc, "--dtype", "fp32"] + small,
        ]
    sdar = [[py, rt, "--batch", "32", "--prompt", "128", "--new", new, "--steps", "4"] for new in ("128", "256")]
    full = [
        py,
        rt,
        "--batch",
        "32",
        "--prompt",
        "128",
        "--new",
        "128",
        "--steps",
        "4",
        "--rounds",
        "1",
        "--baseline-ref",
        "none",
    ]
    compiled = [[py, rc, "--dtype", "fp32", "--new", "64"], [py, rc, "--dtype", "bf16", "--profile"]]
    return sdar + [full + ["--family", "llada", "--cache", "dual"], full + ["--family", "dream"]] + compiled


def build_steps(args, py: str) -> list[Step]:
    limits = TINY_TIMEOUTS if args.tiny else TIMEOUTS
    rows_dir = args.rows_dir
    common = ["--out", args.out, "--rows", rows_dir, "--device", args.device, "--families", args.families] + (
        ["--tiny"] if args.tiny else []
    )
    steps = []
    for name in [n for n in ORDER if n in args.only]:
        if name == "train":
            cmds, rows = train_commands(py, args.tiny), ""
        elif name == "rollout":
            cmds, rows = rollout_commands(py, args.tiny), ""
        else:
            cmds = [[py, os.path.join(HERE, "gpu_steps.py"), name] + common + ["--budget", BUDGET]]
            if name == "profile":
                cmds[0] += ["--variant", args.profile_variant]
            if name == "env" and "rl" not in args.only:  # a training-only call carries no Ray
                cmds[0] += ["--ray-optional"]
            rows = os.path.join(rows_dir, f"{name}.json")
        steps.append(Step(name, cmds, limits[name] * args.timeout_scale, rows))
    return steps


# ---------------------------------------------------------------------------------------------- running
def run_step(step: Step, left: float, env: dict, log) -> dict:
    """The step's commands under min(its timeout, what is left); rc, seconds, status, its rows."""
    t0 = time.perf_counter()
    limit = min(step.timeout, left)
    rc, status, lines = 0, "ok", []
    if step.rows_file and os.path.exists(step.rows_file):
        os.remove(step.rows_file)  # a warm machine keeps OUT: no rows of an older run
    for cmd in step.commands:
        remaining = limit - (time.perf_counter() - t0)
        log.write(f"\n===== [{step.name}] $ {' '.join(cmd)}  (timeout {remaining:.0f} s)\n")
        log.flush()
        rc, out = run_group([c.replace(BUDGET, f"{remaining - 10:.0f}") for c in cmd], env, max(1.0, remaining))
        if rc == 124:
            status = "timeout"
        log.write(out if len(out) < LOG_CHARS else f"[... {len(out) - LOG_CHARS} characters cut]\n" + out[-LOG_CHARS:])
        log.flush()
        lines += [ln for ln in out.replace("\r", "\n").splitlines() if ln.strip()]
        if rc != 0 and status != "timeout":
            status = "fail"
        if status == "timeout":
            break
    rows = _rows(step, lines)
    if status == "ok" and any(r.get("ok") is False for r in rows):
        status = "fail"
    return {
        "status": status,
        "rc": rc,
        "s": round(time.perf_counter() - t0, 1),
        "rows": rows,
        "tail": lines[-12:] if status != "ok" else [],
    }


def run_group(cmd: list[str], env: dict, timeout: float) -> tuple[int, str]:
    """``cmd`` in a process group of its own; on timeout the whole group is killed (the processes a step starts:
    a `megadare sft`, Ray's workers), so nothing of it keeps the GPU busy while the next step runs. (rc, output);
    rc 124 = timed out."""
    p = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return 124, out + f"\n[gpu_check] timed out after {timeout:.0f} s: process group killed\n"


def _rows(step: Step, lines: list[str]) -> list[dict]:
    if step.rows_file:
        if not os.path.exists(step.rows_file):
            return []
        with open(step.rows_file) as f:
            return json.load(f)["rows"]
    # an external benchmark: its own table lines, as printed
    keep = ("device:", "dense ", "moe ", "rollout ", "weight update", "shape  ")
    return [{"check": ln.rstrip(), "ok": None, "value": None} for ln in lines if ln.startswith(keep)]


def run_all(steps: list[Step], out: str, budget: float, env: dict) -> dict:
    """Every step in order; one that no longer fits in the budget (under 20 s left) is skipped, not started."""
    t0 = time.perf_counter()
    results = {}
    with open(os.path.join(out, "gpu_check.log"), "a") as log:
        for step in steps:
            left = budget - (time.perf_counter() - t0) - 5
            if left < 20:
                results[step.name] = {
                    "status": "skipped",
                    "rc": None,
                    "s": 0,
                    "rows": [],
                    "tail": [f"{left:.0f} s of the budget left"],
                }
            else:
                results[step.name] = run_step(step, left, env, log)
            r = results[step.name]
            print(
                f"[{time.perf_counter() - t0:5.0f}s] {step.name:9s} {r['status']:8s} {r['s']:6.1f}s "
                f"{len(r['rows'])} rows",
                flush=True,
            )
            write_results(out, results)
    return results


# ---------------------------------------------------------------------------------------------- reporting
def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v).replace("|", "/").replace("\n", " ")


def summary_markdown(results: dict) -> str:
    if "env" not in results:  # a call of other steps only: its machine was not recorded, not found without a GPU
        title = "machine not recorded (the env step did not run)"
    else:
        env = {r["check"]: r for r in results["env"].get("rows", [])}
        title = f"{env.get('gpu', {}).get('value', 'no GPU')}, torch {env.get('import torch', {}).get('value', '?')}"
    lines = [
        f"# megadare GPU check: {title}",
        "",
        "| step | status | s | rows ok / failed / measured | first problem |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        rows = r["rows"]
        bad = [x for x in rows if x.get("ok") is False]
        first = (
            (bad[0]["check"] + ": " + _fmt(bad[0].get("error", bad[0].get("value"))))
            if bad
            else (" / ".join(r["tail"][-2:]) if r["status"] != "ok" else "")
        )
        counts = f"{sum(x.get('ok') is True for x in rows)} / {len(bad)} / {sum(x.get('ok') is None for x in rows)}"
        lines.append(f"| {name} | {r['status']} | {r['s']} | {counts} | {_fmt(first)[:200]} |")
    for name, r in results.items():
        if not r["rows"]:
            continue
        lines += ["", f"## {name}", "", "| check | ok | value | details |", "|---|---|---|---|"]
        for x in r["rows"]:
            detail = ", ".join(f"{k}={_fmt(v)}" for k, v in x.items() if k not in ("check", "ok", "value"))
            ok = {True: "ok", False: "FAIL", None: ""}[x.get("ok")]
            lines.append(f"| {_fmt(x['check'])} | {ok} | {_fmt(x.get('value'))} | {detail[:300]} |")
    return "\n".join(lines) + "\n"


def write_results(out: str, results: dict) -> None:
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary_markdown(results))


# ---------------------------------------------------------------------------------------------- the carry
def install_carry(carry: str, site: str) -> str:
    """pip-install every wheel under ``carry`` (no index, no dependencies) into ``site``, once per set of wheels
    (a warm machine keeps it). Returns a line saying what happened."""
    wheels = sorted(glob.glob(os.path.join(carry, "**", "*.whl"), recursive=True))
    if not wheels:
        return f"carry: no wheels under {carry} (run benchmarks/gpu_carry.sh here and carry the folder)"
    stamp = hashlib.sha1("\n".join(f"{os.path.basename(w)} {os.path.getsize(w)}" for w in wheels).encode()).hexdigest()
    mark = os.path.join(site, ".gpu_check_carry")
    if os.path.exists(mark) and open(mark).read() == stamp:
        return f"carry: {len(wheels)} wheels already installed in {site}"
    os.makedirs(site, exist_ok=True)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--upgrade",
            "--target",
            site,
        ]
        + wheels,
        capture_output=True,
        text=True,
    )
    how = "pip"
    if p.returncode != 0 and "No module named pip" in p.stderr:
        for w in wheels:  # an interpreter without pip: a wheel is a zip of its files
            unpack_wheel(w, site)
        how = "unzip (no pip)"
    elif p.returncode != 0:
        return f"carry: pip install failed (rc {p.returncode}): {p.stderr.strip()[-400:]}"
    with open(mark, "w") as f:
        f.write(stamp)
    return f"carry: installed {len(wheels)} wheels into {site} ({how})"


def unpack_wheel(wheel: str, site: str) -> None:
    """Extract a wheel into ``site`` keeping its files' modes (Ray's raylet and gcs_server are executables)."""
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = z.extract(info, site)
            mode = info.external_attr >> 16
            if mode:
                os.chmod(path, mode)


def step_env_vars(args, site: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in (site, ROOT, env.get("PYTHONPATH", "")) if p])
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TORCH_LOGS", "recompiles")  # a FlexAttention recompile shows in gpu_check.log
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # every process, benchmarks included, takes its CPU path
    return env


def _has_gpu(env: dict) -> bool:
    """Whether the steps' torch sees a CUDA GPU, or a GPU device exists (then a broken CUDA set-up is what the env
    step is there to record)."""
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"
    if subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0:
        return True
    return any(n.startswith("nvidia") for n in os.listdir("/dev")) if os.path.isdir("/dev") else False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny models and short runs (the CPU plumbing check)")
    ap.add_argument("--only", default=",".join(ORDER), help=f"comma-separated steps of {','.join(ORDER)}")
    ap.add_argument("--skip", default="", help="comma-separated steps to leave out")
    ap.add_argument("--families", default="sdar,sdar_moe,llada,llada2,dream")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "runs", "gpu_check"))
    ap.add_argument("--budget", type=float, default=560, help="seconds for all steps (a device command: 600)")
    ap.add_argument("--profile-variant", default="base", help="the profile step's step fusions (base, all, ...)")
    ap.add_argument("--timeout-scale", type=float, default=1.0, help="factor on every step's timeout")
    ap.add_argument("--carry", default="", help="a folder of wheels to install first (benchmarks/gpu_carry.sh)")
    ap.add_argument("--site", default="/tmp/gpu_check_site", help="where --carry installs")
    args = ap.parse_args(argv)
    unknown = set(args.only.split(",")) - set(ORDER)
    if unknown:
        ap.error(f"--only: unknown steps {sorted(unknown)}; choose from {ORDER}")
    args.only = [n for n in args.only.split(",") if n and n not in args.skip.split(",")]
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    site = ""
    if args.carry:
        site = args.site
        print(install_carry(args.carry, site), flush=True)
    if args.device == "cuda" and not _has_gpu(step_env_vars(args, site)):
        print(
            "megadare GPU check: --device cuda, but this machine has no CUDA GPU (torch.cuda.is_available() is "
            "False, no /dev/nvidia*); run it on a GPU machine, or `--device cpu --tiny` for the CPU plumbing check",
            file=sys.stderr,
        )
        return 2
    print(
        f"megadare GPU check: device {args.device}{' (tiny)' if args.tiny else ''}, steps {args.only}, budget "
        f"{args.budget:.0f} s, results in {args.out}",
        flush=True,
    )
    args.rows_dir = tempfile.mkdtemp(prefix="gpu_check_rows_")  # each step's rows; merged into results.json
    try:
        results = run_all(build_steps(args, sys.executable), args.out, args.budget, step_env_vars(args, site))
    finally:
        shutil.rmtree(args.rows_dir, ignore_errors=True)
    print(summary_markdown(results).split("\n## ")[0], flush=True)
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
